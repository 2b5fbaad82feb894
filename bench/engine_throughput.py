"""Engine throughput: kvfleet vs HF transformers `generate`, side by side in one run.

    python bench/engine_throughput.py                      # the full workload (minutes)
    python bench/engine_throughput.py --quick              # a smaller one for a smoke run

1. Offline throughput. The same workload (default: 128 requests, input lengths 32-512
   log-uniform, outputs 16-256 uniform, fixed seed, random token ids, eos ignored so every
   request produces exactly its output length) runs through kvfleet's `LLM.generate` and
   through HF `generate` with static batches of 16 (left-padded, each batch decoding until its
   longest request is done). Both count only the requested output tokens. Printed: output
   tokens/s of each and their ratio.
2. Batched decode vs a roof that counts bytes as well as FLOPs. With B requests running
   (B = 1, 8, 32, 64; prompts of --decode-prompt tokens), the time of a pure decode step
   against its bound max(bytes / bandwidth, FLOPs / peak): bandwidth from a STREAM-like triad
   and peak from register-resident float32 multiply-adds at the engine's ISA level
   (`fma_peak.py`; a 1024^3 `torch.mm` was the peak until session 24, but MKL takes its AVX2
   code on AMD CPUs: 221 of 543 GFLOP/s on a Zen 5), both measured with the same threads just
   before and just after each B's timed steps (the better of the two, each); bytes = the
   weights as the kernels read them at B rows (`weight_bytes_read`: 4-bit blocks where the
   plan multiplies by them) + the K/V the batch's attention reads at its mean context + the
   float32 logits written; FLOPs = B x the weight matmuls' FLOPs per token. Printed: step
   time / bound (1.0 = at the roof), and the step's weight matmuls alone (the same weight
   objects and calls, nothing else) for comparison.
3. Engine RSS after the kvfleet run, before HF is loaded (current and peak).

`--int16-activations` runs kvfleet (both parts) with that opt-in: the 4-bit matmuls round their
input to 16 bits and multiply in integers, so a step may beat the float32 roof.
"""

from __future__ import annotations

import argparse
import math
import random
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from fma_peak import fma_peak_flops, mkl_matmul_flops

from kvfleet.engine import native
from kvfleet.engine.config import CacheConfig, SchedulerConfig
from kvfleet.engine.engine import EngineCore, build_engine_core
from kvfleet.engine.llm import LLM
from kvfleet.engine.model.llama import DOWN, GATE_UP, O_PROJ, QKV
from kvfleet.engine.model.loader import LoadedModel, default_model_path, load_model
from kvfleet.engine.request import Request, SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    prompts, outputs = [], []
    for _ in range(args.num_requests):
        length = round(math.exp(rng.uniform(math.log(args.min_input),
                                                math.log(args.max_input))))
        prompts.append([rng.randrange(100, vocab_size) for _ in range(length)])
        outputs.append(rng.randint(args.min_output, args.max_output))
    return Workload(prompts, outputs)


def run_kvfleet(model: LoadedModel, workload: Workload, args: argparse.Namespace) -> float:
    core = build_engine_core(model, CacheConfig(), SchedulerConfig(
        max_num_running=args.max_num_running,
        max_num_batched_tokens=args.max_num_batched_tokens),
        int16_activations=args.int16_activations)
    llm = LLM.from_core(core, model.tokenizer, model.chat_template)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=workload.prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(f"kvfleet produced {produced} tokens, expected "
                           f"{workload.num_output_tokens}")
    stats = core.stats()
    log(f"kvfleet: {elapsed:.1f} s, {stats.num_preemptions} preemptions, "
        f"{core.scheduler.kv.num_blocks} KV blocks")
    return workload.num_output_tokens / elapsed


def run_hf(workload: Workload, args: argparse.Namespace) -> float:
    from transformers import AutoModelForCausalLM

    path = default_model_path() if args.model is None else Path(args.model)
    log(f"HF: loading {path.name} with transformers (dequantized to fp32)")
    hf: Any = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                   dtype=torch.float32)
    hf.eval()
    pad = 0
    start = time.perf_counter()
    size = args.hf_batch_size
    for first in range(0, len(workload.prompts), size):
        prompts = workload.prompts[first:first + size]
        max_new = max(workload.output_lens[first:first + size])
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                        min_new_tokens=max_new, do_sample=False, pad_token_id=pad)
        log(f"HF: batch {first // size + 1}/{math.ceil(len(workload.prompts) / size)} "
            f"({len(prompts)} x <= {width} in, {max_new} out) {time.perf_counter() - t:.1f} s")
    elapsed = time.perf_counter() - start
    log(f"HF: {elapsed:.1f} s")
    return workload.num_output_tokens / elapsed


def anonymous_rss() -> int:
    """Resident memory the process itself allocated (Linux), excluding mapped libraries."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def triad_bandwidth(num_floats: int = 1 << 25, repeats: int = 8) -> float:
    """Best observed bytes/s of a = b + s * c over float32 arrays far larger than any cache
    (3 x 128 MiB), STREAM's triad: 2 arrays read and 1 written per element."""
    b, c = torch.rand(num_floats), torch.rand(num_floats)
    a = torch.empty(num_floats)
    torch.add(b, c, alpha=2.0, out=a)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        torch.add(b, c, alpha=2.0, out=a)
        best = max(best, 3 * 4 * num_floats / (time.perf_counter() - t))
    return best


@dataclass(frozen=True)
class StepBound:
    """What a decode step of `batch` rows must move and compute, and the time that takes at
    this host's measured bandwidth and peak."""

    weight_bytes: int
    kv_bytes: int
    logit_bytes: int
    flops: float
    seconds: float

    @classmethod
    def of(cls, model: LoadedModel, batch: int, mean_context: float, kv_dtype_bytes: int,
           bandwidth: float, peak: float) -> StepBound:
        cfg = model.config
        weights = model.model.weight_bytes_read(batch)
        kv = int(batch * mean_context * cfg.num_layers * 2 * cfg.kv_dim * kv_dtype_bytes)
        logits = batch * cfg.vocab_size * 4
        flops = float(batch * cfg.matmul_flops_per_token())
        seconds = max((weights + kv + logits) / bandwidth, flops / peak)
        return cls(weights, kv, logits, flops, seconds)


def decode_max_tokens(batch: int, steps: int, prompt_len: int) -> int:
    """Output tokens a decode request may make: the timed steps, plus the tokens the first
    prefilled requests decode while the later ones still prefill (the default token budget a
    step, which the decode core keeps)."""
    budget = SchedulerConfig().max_num_batched_tokens
    return steps + 2 + -(-batch * prompt_len // budget)


def decode_tokens_per_second(core: EngineCore, batch: int, steps: int, vocab: int,
                             prompt_len: int) -> float:
    rng = random.Random(batch)
    max_tokens = decode_max_tokens(batch, steps, prompt_len)
    requests = [Request(f"d{batch}-{i}", [rng.randrange(100, vocab) for _ in range(prompt_len)],
                        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                       ignore_eos=True))
                for i in range(batch)]
    for request in requests:
        core.add_request(request)
    while any(r.num_output_tokens == 0 for r in requests):  # prefill everyone first
        core.step()
    before = sum(r.num_output_tokens for r in requests)
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    elapsed = time.perf_counter() - start
    generated = sum(r.num_output_tokens for r in requests) - before
    if generated != batch * steps:
        raise RuntimeError(f"decode at {batch} running: {generated} tokens in {steps} steps, "
                           f"not {batch * steps}: not every request ran every step")
    while core.has_unfinished_requests():
        core.step()
    return generated / elapsed


def gemm_only_tokens_per_second(model: LoadedModel, batch: int, repeats: int = 5) -> float:
    """Tokens/s of a decode step that did nothing but its weight matmuls: the same weight
    objects (so the same trips to memory) and the same calls as the engine's default (not
    batch-invariant) mode, B rows each, the LM head included (through `compute_logits`, as a
    step does: it once timed the fp32 head, 113 MB a pass, that the engine does not use); no
    attention, RoPE or sampling."""
    m = model.model
    hidden = m.config.hidden_size
    x = torch.randn(batch, hidden)
    act = torch.randn(batch, m.config.intermediate_size)
    attn = torch.randn(batch, m.config.num_heads * m.config.head_dim)

    def one_pass() -> None:
        for layer in range(m.config.num_layers):
            m.weight_matmul(layer, QKV, x)
            m.weight_matmul(layer, O_PROJ, attn)
            m.weight_matmul(layer, GATE_UP, x)
            m.weight_matmul(layer, DOWN, act)
        m.compute_logits(x)

    with torch.inference_mode():
        one_pass()
        start = time.perf_counter()
        for _ in range(repeats):
            one_pass()
    return batch * repeats / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: embedded SmolLM2)")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--min-input", type=int, default=32)
    parser.add_argument("--max-input", type=int, default=512)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-num-running", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--decode-batches", default="1,8,32,64")
    parser.add_argument("--kv-cache-dtype", default="float32",
                        choices=("float32", "bfloat16", "float16"),
                        help="the decode steps' KV cache (the offline run keeps float32)")
    parser.add_argument("--decode-prompt", type=int, default=32,
                        help="prompt tokens of each decode request (the context the K/V "
                             "read grows from; ~300 makes the K/V a large part of a step)")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--int16-activations", action="store_true",
                        help="kvfleet serve --int16-activations (4-bit matmuls in integers; "
                             "the roof stays float32's, which they can beat)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice); on a shared, "
                             "oversubscribed machine 1 can be faster")
    parser.add_argument("--quick", action="store_true",
                        help="32 requests, inputs 32-256, outputs 16-64, 8 decode steps")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.max_input, args.max_output, args.decode_steps = 32, 256, 64, 8

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    log(f"torch threads: {torch.get_num_threads()}")
    model = load_model(args.model)
    workload = make_workload(args, model.config.vocab_size)
    log(f"workload: {args.num_requests} requests, {sum(map(len, workload.prompts))} prompt "
        f"tokens, {workload.num_output_tokens} output tokens (seed {args.seed})")

    kvfleet_tps = run_kvfleet(model, workload, args)
    rss = psutil.Process().memory_info().rss
    rss_anon = anonymous_rss()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    flops_per_token = model.config.matmul_flops_per_token()
    decode = {}
    gemm_only = {}
    bounds = {}
    batches = [int(b) for b in args.decode_batches.split(",")]
    # A pool that holds the largest batch at its longest context: with the default 512 MiB,
    # 64 requests of 300 tokens would not all run (the step would time fewer rows).
    block_size = CacheConfig().block_size
    max_tokens = args.decode_prompt + decode_max_tokens(max(batches), args.decode_steps,
                                                        args.decode_prompt)
    cache_config = CacheConfig(
        num_blocks=max(batches) * -(-max_tokens // block_size) + 16,
        kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False)
    core = build_engine_core(model, cache_config,
                             SchedulerConfig(max_num_running=max(batches)),
                             int16_activations=args.int16_activations)
    # Each request's context during the timed steps runs from prompt + 1 to prompt + steps.
    mean_context = args.decode_prompt + 1 + args.decode_steps / 2
    kv_dtype_bytes = 4 if args.kv_cache_dtype == "float32" else 2
    target = native.cpu_target()[0]
    mkl = mkl_matmul_flops()
    roofs = {}
    for batch in batches:
        # The roof measured just before and just after the timed steps, the better of each:
        # this host's speed drifts 20-40 % within minutes, and one roof for the whole run made
        # a step's ratio move with the phase the roof happened to be measured in.
        peak, bandwidth = fma_peak_flops(), triad_bandwidth()
        decode[batch] = decode_tokens_per_second(core, batch, args.decode_steps,
                                                 model.config.vocab_size, args.decode_prompt)
        roofs[batch] = max(peak, fma_peak_flops()), max(bandwidth, triad_bandwidth())
        gemm_only[batch] = gemm_only_tokens_per_second(model, batch)
        bounds[batch] = StepBound.of(model, batch, mean_context, kv_dtype_bytes,
                                     roofs[batch][1], roofs[batch][0])
        log(f"decode B={batch}: {decode[batch]:.0f} tok/s (GEMMs alone: "
            f"{gemm_only[batch]:.0f} tok/s)")

    hf_tps = None if args.skip_hf else run_hf(workload, args)

    print(f"workload: {args.num_requests} requests, inputs {args.min_input}-{args.max_input} "
          f"log-uniform, outputs {args.min_output}-{args.max_output}, seed {args.seed}")
    print(f"kvfleet output throughput: {kvfleet_tps:8.1f} tok/s")
    if hf_tps is not None:
        print(f"HF generate (static batches of {args.hf_batch_size}): {hf_tps:8.1f} tok/s")
        print(f"kvfleet / HF: {kvfleet_tps / hf_tps:.2f}x   (target >= 4x)")
    print(f"{flops_per_token / 1e6:.1f} MFLOP/token; decode prompts {args.decode_prompt} "
          f"tokens, mean context {mean_context:.0f}; K/V {args.kv_cache_dtype}; 4-bit matmul "
          f"input {'16-bit (--int16-activations)' if args.int16_activations else 'float32'}")
    print(f"CPU: {native.cpu_identity()}, level {target}; torch.mm 1024^3 "
          f"{mkl / 1e9:.1f} GFLOP/s (beside the FMA peak of the roof below)")
    for batch, tps in decode.items():
        b = bounds[batch]
        step = batch / tps
        print(f"decode, {batch:3d} running: roof {roofs[batch][0] / 1e9:.1f} GFLOP/s (fp32 "
              f"FMA peak, {target}), {roofs[batch][1] / 1e9:.1f} GB/s (triad)")
        print(f"decode, {batch:3d} running: step {step * 1e3:7.2f} ms ({tps:7.1f} tok/s); bound "
              f"{b.seconds * 1e3:6.2f} ms = max(({b.weight_bytes / 1e6:.0f} MB weights + "
              f"{b.kv_bytes / 1e6:.0f} MB K/V + {b.logit_bytes / 1e6:.1f} MB logits) / "
              f"bandwidth, {b.flops / 1e9:.2f} GFLOP / peak); step / bound "
              f"{step / b.seconds:5.2f}x (aim <= 1.5x); GEMMs alone "
              f"{batch / gemm_only[batch] * 1e3:7.2f} ms")
    print(f"engine RSS after the kvfleet run: {rss / 2**20:.0f} MiB, of which anonymous "
          f"{rss_anon / 2**20:.0f} MiB (the rest is mapped shared libraries); peak "
          f"{peak_rss / 2**20:.0f} MiB   (target <= 1536 MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
