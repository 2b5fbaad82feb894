"""Engine throughput: kvfleet vs HF transformers `generate`, side by side in one run.

    python bench/engine_throughput.py                      # the full workload (minutes)
    python bench/engine_throughput.py --quick              # a smaller one for a smoke run

1. Offline throughput. The same workload (default: 128 requests, input lengths 32-512
   log-uniform, outputs 16-256 uniform, fixed seed, random token ids, eos ignored so every
   request produces exactly its output length) runs through kvfleet's `LLM.generate` and
   through HF `generate` with static batches of 16 (left-padded, each batch decoding until its
   longest request is done). Both count only the requested output tokens. Printed: output
   tokens/s of each and their ratio.
2. Batched decode vs the CPU compute roof. With B requests running (B = 8, 32, 64), the
   tokens/s of pure decode steps, against roof = peak matmul FLOP/s (measured here, fp32) /
   FLOPs per token (the weight matmuls incl. the LM head), and against the same step's
   weight matmuls alone (the same weights and GEMM calls, nothing else): what fp32 GEMMs on
   this machine reach at B rows, streaming the weights from memory every step.
3. Engine RSS after the kvfleet run, before HF is loaded (current and peak).
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
import torch.nn.functional as F

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
        max_num_batched_tokens=args.max_num_batched_tokens))
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


def peak_matmul_flops(size: int = 1024, repeats: int = 10) -> float:
    """Best observed fp32 FLOP/s of a square matmul on this machine, now."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - t))
    return best


def decode_tokens_per_second(core: EngineCore, batch: int, steps: int, vocab: int) -> float:
    rng = random.Random(batch)
    requests = [Request(f"d{batch}-{i}", [rng.randrange(100, vocab) for _ in range(32)],
                        sampling_params=SamplingParams(max_tokens=steps + 2, temperature=0.0,
                                                       ignore_eos=True))
                for i in range(batch)]
    for request in requests:
        core.add_request(request)
    while any(r.num_output_tokens == 0 for r in requests):  # prefill everyone first
        core.step()
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    elapsed = time.perf_counter() - start
    while core.has_unfinished_requests():
        core.step()
    return batch * steps / elapsed


def gemm_only_tokens_per_second(model: LoadedModel, batch: int, repeats: int = 5) -> float:
    """Tokens/s of a decode step that did nothing but its weight matmuls: the same weight
    tensors (so the same trips to memory: 540 MB of fp32 weights do not fit in any cache),
    the same GEMM calls as the engine's default (not batch-invariant) mode, B rows each; no
    attention, norms, RoPE or sampling. The ceiling any engine computing this model in fp32
    with torch's GEMMs can reach here."""
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
        F.linear(x, m.lm_head)

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
    parser.add_argument("--decode-batches", default="8,32,64")
    parser.add_argument("--decode-steps", type=int, default=16)
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

    peak = peak_matmul_flops()
    flops_per_token = model.config.matmul_flops_per_token()
    roof = peak / flops_per_token
    decode = {}
    gemm_only = {}
    core = build_engine_core(model, CacheConfig(), SchedulerConfig(max_num_running=64))
    for batch in (int(b) for b in args.decode_batches.split(",")):
        decode[batch] = decode_tokens_per_second(core, batch, args.decode_steps,
                                                 model.config.vocab_size)
        gemm_only[batch] = gemm_only_tokens_per_second(model, batch)
        log(f"decode B={batch}: {decode[batch]:.0f} tok/s (GEMMs alone: "
            f"{gemm_only[batch]:.0f} tok/s)")

    hf_tps = None if args.skip_hf else run_hf(workload, args)

    print(f"workload: {args.num_requests} requests, inputs {args.min_input}-{args.max_input} "
          f"log-uniform, outputs {args.min_output}-{args.max_output}, seed {args.seed}")
    print(f"kvfleet output throughput: {kvfleet_tps:8.1f} tok/s")
    if hf_tps is not None:
        print(f"HF generate (static batches of {args.hf_batch_size}): {hf_tps:8.1f} tok/s")
        print(f"kvfleet / HF: {kvfleet_tps / hf_tps:.2f}x   (target >= 4x)")
    print(f"peak fp32 matmul: {peak / 1e9:.1f} GFLOP/s; {flops_per_token / 1e6:.1f} MFLOP/token"
          f" -> compute roof {roof:.0f} tok/s")
    for batch, tps in decode.items():
        print(f"batched decode, {batch:3d} running: {tps:8.1f} tok/s = {tps / roof:6.1%} of "
              f"roof (target >= 75%); GEMMs alone {gemm_only[batch]:6.0f} tok/s = "
              f"{gemm_only[batch] / roof:6.1%} of roof; engine = {tps / gemm_only[batch]:6.1%} "
              "of its GEMMs")
    print(f"engine RSS after the kvfleet run: {rss / 2**20:.0f} MiB, of which anonymous "
          f"{rss_anon / 2**20:.0f} MiB (the rest is mapped shared libraries); peak "
          f"{peak_rss / 2**20:.0f} MiB   (target <= 1536 MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
