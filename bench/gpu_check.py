"""The GPU check: one script, under 8 minutes on one GPU, one summary line per figure.

    .venv/bin/python bench/gpu_check.py                 # on a machine with a CUDA GPU
    .venv/bin/python bench/gpu_check.py --device cpu    # a dry run of the same steps here

1. The Triton paged-attention kernels compiled for the device, against plain attention
   (tests/unit/test_triton_attention.py with TRITON_INTERPRET=0).
2. HF parity on the device for the embedded SmolLM2 (HF's own dequantization of the same
   GGUF, float32 on both sides): the max |logit difference| over prompts and greedy
   continuations token for token; then kvfleet in bfloat16 (weights and KV) against that
   float32 reference: greedy agreement.
3. HF parity for a random-weight Qwen3 (q/k head norms) saved by transformers, float32.
4. Throughput at concurrency 1, 16 and 64 (bfloat16, 128 output tokens each, random prompts
   of 64-512 tokens): output tokens/s.
5. A decode step at 1, 16 and 64 running against the HBM bound: bytes the step streams (the
   weights as stored + the K/V read for the batch's context + the logits written) / the
   device's measured copy bandwidth; printed as step time / bound.

Each line reads `GPU-CHECK <figure> <value> [unit] [detail]`; a figure that failed prints
`GPU-CHECK <figure> FAILED <why>` and the script goes on. Nothing here has run on a GPU until
bench/README.md records its output.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Kubernetes operators watch",
           "Once upon a time, in a land far away,", "1, 2, 3, 4, 5,", "Les modèles de langage",
           "Summarize: paged attention stores the KV cache in fixed-size blocks.",
           "A haiku about GPUs:"]


def report(figure: str, value: str, detail: str = "") -> None:
    print(f"GPU-CHECK {figure} {value} {detail}".rstrip(), flush=True)


def step(figure: str, run: Callable[[], None]) -> None:
    started = time.monotonic()
    try:
        run()
    except Exception as error:  # one failing figure must not hide the others
        traceback.print_exc()
        report(figure, "FAILED", f"{type(error).__name__}: {error}")
    print(f"  ({figure}: {time.monotonic() - started:.1f} s)", file=sys.stderr, flush=True)


def kernels(device: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0" if device.startswith("cuda") else "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests/unit/test_triton_attention.py")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    last = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
    report("triton-kernels", "ok" if run.returncode == 0 else "FAILED", last)


def hf_smollm(device: str) -> Any:
    from transformers import AutoModelForCausalLM

    from kvfleet.engine.model.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.to(device).eval()


@torch.inference_mode()
def hf_greedy(model: Any, ids: list[int], tokens: int, device: str) -> tuple[list[int], Any]:
    sequence, first = list(ids), None
    for _ in range(tokens):
        logits = model(torch.tensor([sequence], device=device)).logits[0, -1].float().cpu()
        first = logits if first is None else first
        sequence.append(int(logits.argmax()))
    return sequence[len(ids):], first


def parity(device: str, new_tokens: int) -> None:
    from kvfleet.engine.llm import LLM
    from kvfleet.engine.request import SamplingParams

    reference = hf_smollm(device)
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        llm = LLM(device=device, dtype=dtype, kv_cache_dtype="auto", show_progress=False,
                  enable_prefix_caching=False)
        outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        same, worst = 0, 0.0
        for output in outputs:
            theirs, first = hf_greedy(reference, list(output.prompt_token_ids), new_tokens,
                                      device)
            same += list(output.token_ids) == theirs
            if dtype == "float32" and first is not None:
                worst = max(worst, _first_logit_gap(llm, output.prompt_token_ids, first))
        detail = f"{same}/{len(PROMPTS)} prompts token-identical over {new_tokens} tokens"
        if dtype == "float32":
            report("hf-parity-smollm2-fp32", f"{worst:.2e}", f"max|dlogit|; {detail}")
        else:
            report("hf-agreement-smollm2-bf16", f"{same}/{len(PROMPTS)}", detail)
        del llm
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def _first_logit_gap(llm: Any, prompt: Any, reference: torch.Tensor) -> float:
    """kvfleet's logits for the prompt's next token, from a fresh one-request step."""
    from kvfleet.engine.model_runner import ModelRunner
    from kvfleet.engine.scheduler_output import ScheduledChunk, SchedulerOutput

    ids = tuple(prompt)
    runner = ModelRunner(llm.core.runner.model, num_blocks=-(-len(ids) // 16), block_size=16)
    chunk = ScheduledChunk("r", ids, 0, tuple(range(-(-len(ids) // 16))), sample=True)
    logits = runner.execute(SchedulerOutput(chunks=(chunk,), num_scheduled_tokens=len(ids)))
    return float((logits["r"] - reference).abs().max())


def qwen3(device: str) -> None:
    sys.path.insert(0, str(ROOT / "tests/integration"))
    from test_hf_architectures import hf_model  # the test's own random-weight builder
    from transformers import AutoTokenizer

    from kvfleet.engine.llm import LLM
    from kvfleet.engine.model.loader import default_model_path
    from kvfleet.engine.request import SamplingParams

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    reference = hf_model("qwen3", len(tokenizer), seed=7)
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        llm = LLM(folder, device=device, dtype="float32", show_progress=False)
        reference = reference.to(device)
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(PROMPTS[:4], greedy, use_tqdm=False)
        same, worst = 0, 0.0
        for output in outputs:
            theirs, first = hf_greedy(reference, list(output.prompt_token_ids), 16, device)
            same += list(output.token_ids) == theirs
            worst = max(worst, _first_logit_gap(llm, output.prompt_token_ids, first))
    report("hf-parity-qwen3-random-fp32", f"{worst:.2e}",
           f"max|dlogit|; {same}/4 prompts token-identical over 16 tokens")


def throughput(device: str, output_tokens: int) -> None:
    from kvfleet.engine.llm import LLM
    from kvfleet.engine.request import SamplingParams

    llm = LLM(device=device, dtype="bfloat16" if device.startswith("cuda") else "float32",
              show_progress=False, enable_prefix_caching=False, max_num_running=64,
              kv_cache_memory_bytes=(8 << 30) if device.startswith("cuda") else 512 << 20)
    vocab = llm.model.config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[[rng.randrange(vocab) for _ in range(64)]],
                 sampling_params=SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    for concurrency in (1, 16, 64):
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(64, 512))]
                   for _ in range(concurrency)]
        _sync(device)
        started = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        _sync(device)
        took = time.perf_counter() - started
        report(f"throughput-c{concurrency}", f"{concurrency * output_tokens / took:.1f}",
               f"output tok/s ({concurrency} x {output_tokens} tokens in {took:.2f} s)")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy (read + write), best of 5."""
    size = (1 << 30) if device.startswith("cuda") else (256 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        started = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size / best


def roofline(device: str) -> None:
    from kvfleet.engine.config import CacheConfig, SchedulerConfig
    from kvfleet.engine.device import dtype_name
    from kvfleet.engine.engine import build_engine_core
    from kvfleet.engine.model.loader import load_model
    from kvfleet.engine.request import Request, SamplingParams

    bandwidth = copy_bandwidth(device)
    report("copy-bandwidth", f"{bandwidth / 1e9:.0f}", "GB/s (read + write)")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    loaded = load_model(show_progress=False, device=device, dtype=dtype_name(dtype))
    kv_name = dtype_name(dtype)
    core = build_engine_core(loaded, CacheConfig(num_blocks=4096, kv_cache_dtype=kv_name),
                             SchedulerConfig(max_num_running=64, max_num_batched_tokens=8192))
    config, model = loaded.config, core.runner.model  # type: ignore[attr-defined]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = config.num_layers * 2 * config.kv_dim * dtype.itemsize
    context = 256
    for running in (1, 16, 64):
        for i in range(running):
            core.add_request(Request(f"r{running}-{i}", [5] * context, sampling_params=(
                SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))))
        while any(r.num_computed_tokens < context for r in core.scheduler.running) or (
                core.scheduler.waiting):
            core.step()  # prefill
        times = []
        for _ in range(20):
            _sync(device)
            started = time.perf_counter()
            core.step()
            _sync(device)
            times.append(time.perf_counter() - started)
        step_s = sorted(times)[len(times) // 2]
        streamed = weight_bytes + running * (context + 10) * kv_per_token + (
            running * config.vocab_size * 4)
        bound = streamed / (bandwidth / 2)  # a read stream runs at about half a copy's bytes
        note = "" if device.startswith("cuda") else " (CPU dry run: packed weights uncounted)"
        report(f"decode-step-c{running}", f"{step_s * 1000:.2f}",
               f"ms; bound {bound * 1000:.3f} ms ({streamed / 1e6:.0f} MB); "
               f"step/bound {step_s / bound:.1f}x{note}")
        for request in list(core.scheduler.running):
            core.abort_request(request.request_id)
        core.step()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--output-tokens", type=int, default=128)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device is visible: run with --device cpu for a dry run", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    report("device", name.replace(" ", "-"), f"torch {torch.__version__} cuda "
           f"{torch.version.cuda}")
    step("triton-kernels", lambda: kernels(args.device))
    step("hf-parity-smollm2", lambda: parity(args.device, args.tokens))
    step("hf-parity-qwen3", lambda: qwen3(args.device))
    step("throughput", lambda: throughput(args.device, args.output_tokens))
    step("decode-roofline", lambda: roofline(args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
