"""The fused elementwise ops (`csrc/fused_ops.cpp`): the torch ops' results up to float32
rounding, each row on its own (bits independent of the batch and the thread count), their
refusals, the model on them, and the fallback when they cannot be built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from native_helpers import warning_when_every_build_fails
from test_model_runner import ContiguousAttention
from tiny_llama import random_weights, tiny_config

from kvfleet.engine.fused_ops import FusedOps, load_fused_ops
from kvfleet.engine.model.llama import LlamaModel, _rms_norm


@pytest.fixture(scope="module")
def ops() -> FusedOps:
    # The test machine has a C++ compiler and ninja: the ops must build here.
    built = load_fused_ops()
    assert built is not None, "the fused ops did not build (see the log)"
    return built


def rows(n: int, width: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)) * scale


# Widths with and without a scalar tail after the 16-float vectors.
@pytest.mark.parametrize("width", [576, 40, 7])
@pytest.mark.parametrize("n", [0, 1, 103])
def test_rms_norm_is_hf_rms_norm(ops: FusedOps, n: int, width: int) -> None:
    x, weight = rows(n, width, 1), rows(1, width, 2)[0]
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), _rms_norm(x, weight, 1e-5),
                               rtol=1e-5, atol=1e-6)
    # Rows of a wider tensor (a view with a row stride) are read in place.
    wide = rows(n, width + 9, 3)
    torch.testing.assert_close(ops.rms_norm(wide[:, :width], weight, 1e-5),
                               _rms_norm(wide[:, :width], weight, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("width", [576, 40])
def test_add_rms_norm_adds_in_place_then_normalizes(ops: FusedOps, width: int) -> None:
    hidden, weight = rows(9, width, 4), rows(1, width, 6)[0]
    delta = rows(9, width + 3, 5)[:, :width]  # rows with a stride
    before = hidden.clone()
    out = ops.add_rms_norm_(hidden, delta, weight, 1e-6)
    assert torch.equal(hidden, before + delta)  # one float32 add per element, as torch's
    torch.testing.assert_close(out, _rms_norm(before + delta, weight, 1e-6), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("width", [1536, 24])
def test_silu_mul_is_silu_of_gate_times_up(ops: FusedOps, width: int) -> None:
    gate_up = rows(17, 2 * width, 7, scale=6.0)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-30])  # exp's clamps, zero, tiny
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 40, 16])
def test_rope_rotates_q_and_k_in_place_and_leaves_v(ops: FusedOps, head_dim: int) -> None:
    heads, kv_heads, n = 3, 1, 11
    x = rows(n, (heads + 2 * kv_heads) * head_dim, 8)
    cos, sin = rows(n, head_dim, 9), rows(n, head_dim, 10)
    want = x.clone()
    qk = want[:, : (heads + kv_heads) * head_dim].view(n, heads + kv_heads, head_dim)
    qk.copy_(qk * cos[:, None] + qk.roll(head_dim // 2, -1) * sin[:, None])
    got = x.clone()
    ops.rope_(got, cos, sin, heads + kv_heads, head_dim)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    v = slice((heads + kv_heads) * head_dim, None)
    assert torch.equal(got[:, v], x[:, v])


def test_a_row_has_the_same_bits_alone_in_a_batch_and_on_any_thread_count(
        ops: FusedOps) -> None:
    x, weight = rows(37, 576, 11), rows(1, 576, 12)[0]
    gate_up = rows(37, 3072, 13)
    cos, sin = rows(37, 64, 14), rows(37, 64, 15)

    def run() -> list[torch.Tensor]:
        qkv = rows(37, 960, 16)
        ops.rope_(qkv, cos, sin, 12, 64)
        hidden = x.clone()
        added = ops.add_rms_norm_(hidden, gate_up[:, :576], weight, 1e-5)
        return [ops.rms_norm(x, weight, 1e-5), added, ops.silu_mul(gate_up), qkv, hidden]

    batched = run()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single_thread = run()
    finally:
        torch.set_num_threads(before)
    for a, b in zip(batched, single_thread, strict=True):
        assert torch.equal(a, b)
    alone = ops.rms_norm(x[20:21], weight, 1e-5)
    assert torch.equal(alone[0], batched[0][20])
    assert torch.equal(ops.silu_mul(gate_up[5:6])[0], batched[2][5])


def test_bad_inputs_are_refused_with_the_op_and_argument_named(ops: FusedOps) -> None:
    x = rows(4, 32, 17)
    with pytest.raises(RuntimeError, match=r"rms_norm: weight must be a contiguous float32 \[32\]"):
        ops.rms_norm(x, torch.ones(31), 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm: x must be a float32"):
        ops.rms_norm(x.double(), torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="add_rms_norm_: hidden must be contiguous and delta"):
        ops.add_rms_norm_(x, rows(4, 16, 18), torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="silu_mul: gate_up must have an even width"):
        ops.silu_mul(rows(2, 7, 19))
    with pytest.raises(RuntimeError, match=r"rope_: cos and sin_signed must be contiguous"):
        ops.rope_(x, rows(3, 16, 20), rows(4, 16, 21), 2, 16)
    with pytest.raises(RuntimeError, match="rope_: heads \\* head_dim must fit a row"):
        ops.rope_(x, rows(4, 16, 20), rows(4, 16, 21), 3, 16)


@torch.inference_mode()
def test_model_on_fused_ops_matches_torch_ops(ops: FusedOps) -> None:
    config = tiny_config()
    plain = LlamaModel(config, random_weights(config, seed=3)).eval()
    fused = LlamaModel(config, random_weights(config, seed=3)).eval()
    fused.use_fused_ops(ops)
    ids = torch.tensor([3, 17, 5, 9, 30, 2, 11])
    positions = torch.arange(len(ids))
    want = plain.compute_logits(plain(ids, positions, ContiguousAttention(plain)))
    got = fused.compute_logits(fused(ids, positions, ContiguousAttention(fused)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # Only the last row's hidden state, as a prefill that samples one row asks for.
    last = torch.tensor([len(ids) - 1])
    got_last = fused.compute_logits(
        fused(ids, positions, ContiguousAttention(fused), output_rows=last))
    torch.testing.assert_close(got_last, want[-1:], rtol=0, atol=1e-4)


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLEET_FUSED_OPS", "torch")
    assert load_fused_ops() is None


def test_a_failed_build_falls_back_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    warning = warning_when_every_build_fails(load_fused_ops, monkeypatch, caplog, tmp_path)
    assert "norms, RoPE and SiLU run as torch ops" in warning
    assert "KVFLEET_FUSED_OPS=torch" in warning
