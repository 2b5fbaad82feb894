"""The model runner with each attention path and KV dtype, against a plain full-sequence
forward: the Triton kernels (run here by Triton's interpreter, as on a GPU they run
compiled), the SDPA fallback, and a 16-bit KV cache on either."""

from __future__ import annotations

import pytest
import torch
from test_model_runner import BLOCK_SIZE, chunk, make_step, random_tokens, reference_logits
from tiny_llama import random_weights, tiny_config

from kvfleet.engine import triton_attention
from kvfleet.engine.model.llama import LlamaModel
from kvfleet.engine.model_runner import ModelRunner, kv_bytes_per_block

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    config = tiny_config()
    return LlamaModel(config, random_weights(config, seed=3)).eval()


def run_steps(runner: ModelRunner, vocab: int) -> dict[str, list[torch.Tensor]]:
    """Two requests: one prefilled in two chunks across blocks then decoding, one prefilled
    while the first decodes (a mixed step), then both decoding; the logits of each step."""
    a, b = random_tokens(11, 1, vocab), random_tokens(6, 2, vocab)
    blocks_a, blocks_b = [5, 2, 7, 0], [3, 6, 1]
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    steps = [
        make_step(chunk("a", a[:7], 0, blocks_a)),
        make_step(chunk("a", a, 7, blocks_a)),
        make_step(chunk("a", [*a, 9], 11, blocks_a), chunk("b", b, 0, blocks_b)),
        make_step(chunk("a", [*a, 9, 4], 12, blocks_a), chunk("b", [*b, 8], 6, blocks_b)),
    ]
    for step in steps:
        logits = runner.execute(step)
        for request_id in logits:
            got[request_id].append(logits[request_id])
    return got


def expected(model: LlamaModel, vocab: int) -> dict[str, list[torch.Tensor]]:
    a, b = random_tokens(11, 1, vocab), random_tokens(6, 2, vocab)
    full_a = reference_logits(model, [*a, 9, 4])
    full_b = reference_logits(model, [*b, 8])
    return {"a": [full_a[6], full_a[10], full_a[11], full_a[12]], "b": [full_b[5], full_b[6]]}


@pytest.mark.parametrize(("attention", "kv_dtype", "atol"), [
    ("triton", torch.float32, 1e-4),
    ("sdpa", torch.float32, 1e-4),
    # 16-bit K/V: each stored value rounded to 8 (bf16) or 11 (fp16) mantissa bits.
    ("triton", torch.bfloat16, 0.1),
    ("sdpa", torch.bfloat16, 0.1),
    ("kernel", torch.bfloat16, 0.1),
    ("triton", torch.float16, 2e-2),
    ("sdpa", torch.float16, 2e-2),
])
def test_every_attention_path_and_kv_dtype_matches_the_full_forward(
        model: LlamaModel, monkeypatch: pytest.MonkeyPatch, attention: str,
        kv_dtype: torch.dtype, atol: float) -> None:
    monkeypatch.setenv("KVFLEET_ATTENTION", attention)
    runner = ModelRunner(model, num_blocks=8, block_size=BLOCK_SIZE, kv_dtype=kv_dtype)
    assert isinstance(runner.kernel, triton_attention.TritonKernel) == (attention == "triton")
    assert (runner.kernel is None) == (attention == "sdpa")
    assert runner.kv_cache.dtype == kv_dtype
    vocab = model.config.vocab_size
    got, want = run_steps(runner, vocab), expected(model, vocab)
    for request_id in ("a", "b"):
        for ours, theirs in zip(got[request_id], want[request_id], strict=True):
            assert ours.dtype == torch.float32
            assert (ours - theirs).abs().max().item() <= atol, (request_id, attention)
            if kv_dtype == torch.float32:
                assert int(ours.argmax()) == int(theirs.argmax())


def test_a_16_bit_cache_takes_half_the_bytes(model: LlamaModel) -> None:
    cfg = model.config
    assert kv_bytes_per_block(cfg, 16, torch.bfloat16) * 2 == kv_bytes_per_block(cfg, 16)
    runner = ModelRunner(model, num_blocks=8, block_size=16, kv_dtype=torch.float16)
    assert runner.kv_cache.numel() * 2 == 8 * kv_bytes_per_block(cfg, 16, torch.float16)


def test_the_compiled_cpu_kernel_reads_a_bfloat16_cache_and_not_a_float16_one(
        model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """It reads float32 or bfloat16 K/V: a float16 cache on the CPU runs SDPA over converted
    blocks."""
    monkeypatch.delenv("KVFLEET_ATTENTION", raising=False)
    assert ModelRunner(model, 8, BLOCK_SIZE, kv_dtype=torch.bfloat16).kernel is not None
    assert ModelRunner(model, 8, BLOCK_SIZE, kv_dtype=torch.float16).kernel is None


@pytest.mark.parametrize("attention", ["triton", "sdpa"])
def test_16_bit_weights_as_on_a_gpu(model: LlamaModel, monkeypatch: pytest.MonkeyPatch,
                                    attention: str) -> None:
    """The GPU's path on this CPU: weights and activations in bfloat16 (moved with
    `to_device`, so not packed and without the CPU's fused ops), norms and softmax in float32,
    float32 logits out, close to the float32 model's."""
    monkeypatch.setenv("KVFLEET_ATTENTION", attention)
    config = model.config
    half = LlamaModel(config, random_weights(config, seed=3)).eval()
    half.to_device(torch.device("cpu"), torch.bfloat16)
    assert half.embed_tokens.dtype == torch.bfloat16 and half.lm_head is half.embed_tokens
    runner = ModelRunner(half, num_blocks=8, block_size=BLOCK_SIZE, kv_dtype=torch.bfloat16)
    got, want = run_steps(runner, config.vocab_size), expected(model, config.vocab_size)
    scale = max(t.abs().max().item() for w in want.values() for t in w)
    for request_id in ("a", "b"):
        for ours, theirs in zip(got[request_id], want[request_id], strict=True):
            assert ours.dtype == torch.float32
            assert (ours - theirs).abs().max().item() <= 0.03 * scale, request_id
