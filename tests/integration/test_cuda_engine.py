"""The engine on a CUDA device: what only a GPU can show. Skipped without one (pytest reports
the skip and its reason); bench/gpu_check.py measures the same machine's figures."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.llm import LLM
from kvfleet.engine.request import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
if not torch.cuda.is_available():
    pytest.skip("no CUDA device is visible", allow_module_level=True)

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Kubernetes operators watch",
           "1, 2, 3, 4,"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_float32_on_the_gpu_generates_what_the_cpu_does() -> None:
    cpu = LLM(device="cpu", show_progress=False).generate(PROMPTS, GREEDY, use_tqdm=False)
    gpu_llm = LLM(device="cuda", dtype="float32", show_progress=False)
    assert gpu_llm.core.runner.kv_cache.device.type == "cuda"  # type: ignore[attr-defined]
    gpu = gpu_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    same = sum(list(a.token_ids) == list(b.token_ids) for a, b in zip(cpu, gpu, strict=True))
    assert same >= len(PROMPTS) - 1, "float32 on the GPU diverged on more than one prompt"


def test_bfloat16_with_the_triton_kernels_serves_and_frees_its_blocks() -> None:
    llm = LLM(device="cuda", show_progress=False)  # auto: bfloat16 weights and KV
    assert llm.model.model.embed_tokens.dtype in (torch.bfloat16, torch.float16)
    outputs = llm.generate(PROMPTS * 8, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == 24 for o in outputs)
    assert llm.stats().kv_cache_usage == 0.0
