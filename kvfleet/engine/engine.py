"""`EngineCore`: one step = schedule → execute → sample → update. Nothing else.

The core runs on one thread (the engine thread). It owns the scheduler (and through it the
KV block accounting), the model runner (the KV tensors and the forward pass) and the sampler.
Text, stop strings and delivery live above it (`LLM`, the async server layer).

`build_engine_core` wires a loaded model to a core: it sizes the KV pool from the memory
budget and builds the prefix-cache salt from the model revision and chat-template version,
so a cached block is never reused across models or templates.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from kvfleet.engine import native
from kvfleet.engine.config import CacheConfig, SchedulerConfig
from kvfleet.engine.kv_cache_manager import make_cache_salt
from kvfleet.engine.metrics import EngineStats
from kvfleet.engine.request import FinishReason, Request
from kvfleet.engine.sampler import Sampler
from kvfleet.engine.scheduler import Scheduler
from kvfleet.engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from kvfleet.engine.model.loader import LoadedModel

log = logging.getLogger(__name__)


class ModelRunnerProtocol(Protocol):
    def execute(self, out: SchedulerOutput) -> Mapping[str, torch.Tensor]: ...


class EngineCore:
    def __init__(self, runner: ModelRunnerProtocol, scheduler: Scheduler, sampler: Sampler,
                 *, model_hash: str = "", template_version: str = "") -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler
        self.model_hash = model_hash
        self.template_version = template_version

    def add_request(self, request: Request) -> None:
        """Admit a request (InvalidRequestError if it could never run). `request.cache_salt`
        is its prefix-cache scope (the tenant by default); the core adds model and template."""
        request.cache_salt = make_cache_salt(request.cache_salt or request.tenant,
                                             self.model_hash, "", self.template_version)
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str,
                      reason: FinishReason = FinishReason.CANCELLED) -> None:
        """Idempotent; the request's blocks are freed at the next step boundary."""
        self.scheduler.abort_request(request_id, reason)

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        """End a request from the engine thread (e.g. a stop string matched)."""
        self.scheduler.finish_request(request_id, reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[Request]:
        """Run one step; returns the requests that got a token or finished in it."""
        output = self.scheduler.schedule()
        self.sampler.forget(output.finished_request_ids)
        if output.is_empty:
            return []
        logits = self.runner.execute(output)
        requests = self.scheduler.requests
        to_sample = [requests[c.request_id] for c in output.chunks if c.sample]
        sampled = self.sampler.sample(logits, to_sample)
        return self.scheduler.update_from_output(output, sampled)

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage,
            num_prefix_cache_queries=kv.prefix_cache_queries,
            num_prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
        )


def build_engine_core(model: LoadedModel, cache_config: CacheConfig | None = None,
                      scheduler_config: SchedulerConfig | None = None, *,
                      batch_invariant: bool = False,
                      int8_activations: bool = False,
                      int16_activations: bool = False) -> EngineCore:
    """A core for `model` with a KV pool sized by `cache_config` (default: 512 MiB).

    `batch_invariant`: a request's output bits do not depend on the rest of its batch, at the
    cost of padding small steps (see `kvfleet.engine.model.llama`). Without it the model's
    layer weights are packed (4-bit or for MKL, see `packed_matmul`), after which the same
    loaded model cannot serve a batch-invariant engine.

    `int8_activations`: decode steps of 1-2 rows multiply the Q4_1 layer weights by inputs
    rounded to 8 bits per 32-value block (llama.cpp's numerics, not the float32 weights' exact
    products; see `packed_matmul.QuantWeight.int8_rows`). Only the CPU's 4-bit kernel has
    that path: elsewhere it is logged and has no effect.

    `int16_activations`: every other weight matmul on the 4-bit kernel (layers and LM head)
    rounds its input to 16 bits per 32-value block and sums in integers
    (`packed_matmul.QuantWeight.int16`): 1.1-1.9x faster matmuls on AVX-512 VNNI, logits
    within ~7e-3 of HF's. The same caveats."""
    from kvfleet.engine.device import DTYPES
    from kvfleet.engine.fused_ops import load_fused_ops
    from kvfleet.engine.matmul_plan import plan_for
    from kvfleet.engine.model_runner import ModelRunner, kv_bytes_per_block
    from kvfleet.engine.packed_matmul import (
        INT8_ACTIVATION_ROWS,
        load_packer,
        load_quant_kernel,
    )

    cache_config = cache_config or CacheConfig()
    scheduler_config = scheduler_config or SchedulerConfig()
    kv_dtype = DTYPES[cache_config.kv_cache_dtype]
    num_blocks = cache_config.resolve_num_blocks(kv_bytes_per_block(model.config, 1, kv_dtype))
    eos_ids = [] if model.tokenizer.eos_token_id is None else [model.tokenizer.eos_token_id]
    scheduler = Scheduler(scheduler_config, cache_config, num_blocks=num_blocks,
                          max_model_len=model.config.max_context, eos_token_ids=eos_ids)
    weights = model.model.embed_tokens
    # The packed matmuls and fused ops are CPU kernels over float32 weights; on a GPU (or in
    # 16 bits) the torch ops serve.
    cpu_float32 = weights.device.type == "cpu" and weights.dtype == torch.float32
    rounding = [flag for flag, on in (("--int8-activations", int8_activations),
                                      ("--int16-activations", int16_activations)) if on]
    if rounding and batch_invariant:
        raise ValueError(f"{' and '.join(rounding)} round each step's matmul input, which batch "
                         f"invariance exists to keep exact: drop {' and '.join(rounding)} or "
                         f"--batch-invariant")
    if cpu_float32 and not batch_invariant and not model.model.is_packed:
        packer, quant = load_packer(), load_quant_kernel()
        if packer is not None or quant is not None:
            plan = plan_for(model.model.weight_samples(), packer, quant)
            model.model.pack_weights(packer, quant, plan)
    if model.model.is_packed:  # a model packed for an earlier engine keeps no old setting
        model.model.use_activation_rounding(
            INT8_ACTIVATION_ROWS if int8_activations else 0,
            int16_activations)
    elif rounding:  # a GPU, 16-bit weights or no kernel: a pool's setting is moot
        log.warning("%s asked for, but the CPU's 4-bit kernel is not in use here (%s, %s): "
                    "every matmul keeps its input as it is", " and ".join(rounding),
                    weights.device, weights.dtype)
    if cpu_float32:
        model.model.use_fused_ops(load_fused_ops())
    runner = ModelRunner(model, num_blocks, cache_config.block_size, batch_invariant,
                         kv_dtype=kv_dtype)
    native.return_freed_memory()
    template = model.chat_template
    return EngineCore(runner, scheduler, Sampler(eos_ids), model_hash=model.revision,
                      template_version=template.sha256 if template is not None else "")
