"""Wiring for `kvfleet serve`: a model file plus flags → a ready-to-start `AsyncEngine`.

Kept apart from the CLI module so the CLI's import stays light (no torch until the command
actually serves), and from `runtime` so the runtime can be tested with a fake engine.
"""

from __future__ import annotations

import argparse
import gc
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from kvfleet.engine.admission import AdmissionLimits, ServedModel
from kvfleet.engine.async_engine import AsyncEngine
from kvfleet.engine.config import (
    CPU_PREFILL_TOKENS_PER_STEP,
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    MIB,
    CacheConfig,
    SchedulerConfig,
)
from kvfleet.engine.device import (
    KVBudgetError,
    apply_cpu_threads,
    check_pinned,
    dtype_name,
    measure,
    resolve_device,
    resolve_kv_dtype,
)
from kvfleet.engine.engine import build_engine_core
from kvfleet.engine.fetch import cache_from_env, fetch, files_from_env
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.engine.model.loader import LoadedModel, default_model_path, load_model
from kvfleet.engine.model.verify import verify_manifest, verify_weights
from kvfleet.engine.model_runner import kv_bytes_per_block
from kvfleet.engine.runtime import LoadedEngine

logger = logging.getLogger("kvfleet.engine.load")

WARMUP_PROMPT = "Hello"


def _log_progress(done: int, total: int) -> None:
    # Roughly every quarter, as JSON log lines (a tqdm bar would corrupt the JSON stream).
    if total and (done == total or done * 4 // total != (done - 1) * 4 // total):
        logger.info("loading weights %d/%d", done, total,
                    extra={"fields": {"event": "loading", "done": done, "total": total}})


def _fetch_log() -> Callable[[str, int, int], None]:
    """A fetch's progress per file at 0, 25, 50, 75 and 100 % (the chunks are MiBs)."""
    logged: dict[str, int] = {}

    def log_fetch(name: str, done: int, total: int) -> None:
        quarter = 4 * done // max(total, 1)
        if logged.get(name) != quarter:
            logged[name] = quarter
            logger.info("fetching %s %d/%d bytes", name, done, total, extra={"fields": {
                "event": "fetching", "file": name, "done": done, "total": total}})

    return log_fetch


def _cache_config(args: argparse.Namespace, model: LoadedModel, device: torch.device,
                  weights: torch.dtype) -> CacheConfig:
    """The KV cache: the pinned block count if it fits (KVBudgetError with the ledger if
    not), else --kv-cache-memory-mib, else what the device has left after the weights."""
    kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, weights)
    kv_name = dtype_name(kv_dtype)
    per_block = kv_bytes_per_block(model.config, args.block_size, kv_dtype)
    ledger = measure(device, model.config, args.max_num_batched_tokens, args.max_num_seqs)
    if ledger is not None:
        logger.info("memory ledger: %s", ledger.text(),
                    extra={"fields": {"event": "kv_ledger", "budget_bytes": ledger.budget}})
    if args.num_kv_blocks is not None:
        check_pinned(args.num_kv_blocks, per_block, ledger)
        memory = args.num_kv_blocks * per_block
    elif args.kv_cache_memory_mib is not None:
        memory = args.kv_cache_memory_mib * MIB
    elif ledger is not None:
        if ledger.budget < per_block:
            raise KVBudgetError(f"no room for one KV block ({per_block / MIB:.2f} MiB): "
                                f"{ledger.text()}. Give the pod more memory or use a smaller "
                                "--max-num-batched-tokens")
        memory = ledger.budget
    else:
        memory = DEFAULT_KV_CACHE_MEMORY_BYTES
    return CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks,
                       kv_cache_memory_bytes=memory,
                       enable_prefix_caching=args.enable_prefix_caching,
                       kv_cache_dtype=kv_name)


def build_loader(args: argparse.Namespace, limits: AdmissionLimits
                 ) -> Callable[[], LoadedEngine]:
    """A function that loads the model named by the `kvfleet serve` flags (run in a thread)."""
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_running=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        policy=args.scheduling_policy, tenant_weights=args.tenant_weights,
        priority_aging_seconds=args.priority_aging_seconds)

    def load() -> LoadedEngine:
        path = args.model
        files = files_from_env() if path is None else None
        if files:
            # The files the operator named ($KVFLEET_WEIGHT_FILES): the pod's init step has
            # fetched them into the cache already, so this only finds them (and fetches what
            # it did not, e.g. outside Kubernetes), with the server up and not yet ready.
            path = fetch(files, cache_from_env(), progress=_fetch_log())
            logger.info("model files in %s", path,
                        extra={"fields": {"event": "fetched", "path": str(path)}})
        # Verify before loading: a pod must never serve weights the manifest did not name.
        verify_weights(Path(path) if path else default_model_path(), args.expected_sha256)
        device = resolve_device(args.device)
        # Before loading: the matmul paths are measured at load with the threads steps use.
        threads = apply_cpu_threads(args.cpu_threads)
        logger.info("%d CPU threads: %s", threads.threads, threads.reason, extra={"fields": {
            "event": "cpu_threads", "threads": threads.threads, "reason": threads.reason}})
        model = load_model(path, progress=_log_progress, device=str(device), dtype=args.dtype)
        verify_manifest(model, tokenizer_sha256=args.expected_tokenizer_sha256,
                        chat_template_sha256=args.expected_chat_template_sha256)
        cache_config = _cache_config(args, model, device, model.model.embed_tokens.dtype)
        prefill_cap = args.max_prefill_tokens_per_step
        if prefill_cap is None:  # auto
            prefill_cap = CPU_PREFILL_TOKENS_PER_STEP if device.type == "cpu" else 0
        core = build_engine_core(model, cache_config,
                                 replace(scheduler_config,
                                         max_prefill_tokens_per_step=prefill_cap or None),
                                 batch_invariant=args.batch_invariant,
                                 int8_activations=args.int8_activations,
                                 int16_activations=args.int16_activations)
        max_context = model.config.max_context
        if args.max_model_len is not None:
            max_context = min(max_context, args.max_model_len)
        served = ServedModel(
            name=args.served_model_name or model.name,
            revision=args.revision or f"sha256:{model.revision}",
            max_context=max_context, block_size=cache_config.block_size,
            num_kv_blocks=core.scheduler.kv.num_blocks)
        metrics = EngineMetrics(served.name, served.revision)
        metrics.record_cache_config(cache_config.block_size, served.num_kv_blocks,
                                    cache_config.kv_cache_dtype, str(device))
        engine = AsyncEngine(core, served, model.tokenizer, metrics,
                             limits=limits, log_text=args.log_text)
        logger.info("model loaded", extra={"fields": {
            "event": "loaded", "model": served.name, "revision": served.revision,
            "max_context": max_context, "num_kv_blocks": served.num_kv_blocks,
            "block_size": served.block_size}})
        # What is loaded lives as long as the process: out of the cyclic collector's reach.
        # A full pass over it (~226,000 objects with SmolLM2) took 90-115 ms, every step and
        # stream of the engine waiting (the GIL; bench/gc_pause.py); objects made later are
        # still collected. The loading's own garbage goes first: a frozen cycle is kept for ever.
        gc.collect()
        gc.freeze()
        return LoadedEngine(engine, model.chat_template,
                            tuple(model.tokenizer.encode(WARMUP_PROMPT)))

    return load
