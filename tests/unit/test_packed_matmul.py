"""Packed weight matmuls (MKL float32, quantized Q4_1/Q8_0): the same products as torch.mm,
the model on packed weights, and the fallback when an extension cannot be built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from native_helpers import warning_when_every_build_fails
from test_model_runner import ContiguousAttention
from tiny_llama import random_weights, tiny_config, write_gguf

from kvfleet.engine import packed_matmul
from kvfleet.engine.matmul_plan import MatmulPlan, ShapeChoice
from kvfleet.engine.model import load_model
from kvfleet.engine.model.llama import LlamaModel
from kvfleet.engine.packed_matmul import (
    PackedWeight,
    Packer,
    QuantBlocks,
    QuantKernel,
    QuantWeight,
    load_packer,
    load_quant_kernel,
)


@pytest.fixture(scope="module")
def packer() -> Packer:
    built = load_packer()
    if built is None:
        pytest.skip("no MKL in this torch build or no C++ compiler")
    return built


@pytest.fixture(scope="module")
def quant() -> QuantKernel:
    # The test machine has a C++ compiler and ninja: the kernel must build here.
    built = load_quant_kernel()
    assert built is not None, "the quantized matmul did not build (see the log)"
    return built


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 130])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576), (48, 32)])
def test_packed_product_equals_torch_mm(packer: Packer, rows: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + k)
    weight_t = torch.randn(k, n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    got = PackedWeight.pack(weight_t, packer).matmul(x)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, x @ weight_t, rtol=1e-5, atol=1e-4)


def test_rows_of_the_wrong_width_are_refused(packer: Packer) -> None:
    weight = PackedWeight.pack(torch.randn(8, 4), packer)
    with pytest.raises(ValueError, match="rows of 5 features for a weight of 8 inputs"):
        weight.matmul(torch.randn(3, 5))


@torch.inference_mode()
def test_model_on_packed_weights_matches_unpacked(packer: Packer) -> None:
    config = tiny_config()
    plain = LlamaModel(config, random_weights(config, seed=3)).eval()
    packed = LlamaModel(config, random_weights(config, seed=3)).eval()
    packed.pack_weights(packer)
    packed.pack_weights(packer)  # a second call changes nothing
    assert packed.is_packed and not plain.is_packed
    assert packed.qkv_t[0].numel() == 0  # the [in, out] copy is gone
    assert packed._lm_head_packed is not None  # the logits below come from the packed head
    ids = torch.tensor([3, 17, 5, 9, 30, 2, 11])
    positions = torch.arange(len(ids))
    want = plain.compute_logits(plain(ids, positions, ContiguousAttention(plain)))
    got = packed.compute_logits(packed(ids, positions, ContiguousAttention(packed)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    with pytest.raises(RuntimeError, match="load the model again for a batch-invariant"):
        packed(ids, positions, ContiguousAttention(packed), batch_invariant=True)


def quant_matrix(ggml_type: str, out_features: int, in_features: int, seed: int
                 ) -> tuple[QuantBlocks, torch.Tensor]:
    """(raw blocks [out, in / 32 * block bytes] as a GGUF stores them, their float32
    dequantization)."""
    qtype = gguf.GGMLQuantizationType[ggml_type]
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen).numpy()
    raw = gguf.quants.quantize(weight, qtype)
    dequantized = np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32)
    return QuantBlocks(ggml_type, torch.from_numpy(np.array(raw))), torch.from_numpy(dequantized)


QUANT_TYPES = pytest.mark.parametrize("ggml_type", ["Q4_1", "Q8_0"])


@QUANT_TYPES
def test_quantized_weights_are_exactly_the_loaders_float32_weights(
    quant: QuantKernel, ggml_type: str
) -> None:
    blocks, weight = quant_matrix(ggml_type, 48, 96, seed=1)
    # x = identity: each product is one weight times 1 plus zeros, so any dequantization
    # difference (e.g. Q4_1's d * q + m fused into one rounding) shows.
    got = QuantWeight.pack(blocks, 96, quant).matmul(torch.eye(96))
    assert torch.equal(got, weight.t())


@QUANT_TYPES
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 12, 13, 30, 103])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576), (64, 48)])  # 48: a half panel
def test_quantized_product_matches_float64(
    quant: QuantKernel, ggml_type: str, rows: int, k: int, n: int
) -> None:
    blocks, weight = quant_matrix(ggml_type, n, k, seed=rows + k)
    gen = torch.Generator().manual_seed(rows)
    # Rows of a wider tensor, as the model passes slices of a fused projection.
    x = torch.randn(rows, k + 8, generator=gen)[:, :k]
    got = QuantWeight.pack(blocks, k, quant).matmul(x)
    assert got.shape == (rows, n)
    # Against float64: a float32 sum of 1,536 products of size ~1 is off by ~1e-4 either way.
    expected = (x.double() @ weight.double().t()).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=3e-4)


@QUANT_TYPES
@pytest.mark.parametrize("n_out", [64, 48])  # 48: 3 groups, one left over by the 1-2 row path
def test_quantized_a_rows_bits_do_not_depend_on_the_other_rows(
    quant: QuantKernel, ggml_type: str, n_out: int
) -> None:
    blocks, _ = quant_matrix(ggml_type, n_out, 576, seed=5)
    weight = QuantWeight.pack(blocks, 576, quant)
    x = torch.randn(29, 576, generator=torch.Generator().manual_seed(6))
    together = weight.matmul(x)  # panels: more than 16 rows
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # another split of panels across threads changes nothing either
    try:
        for r in (0, 11, 12, 28):
            # 3, 4, 8, 9 and 12 rows take the register path (no panel buffer; 3-4 rows both
            # register slices of a group at once on AVX2), 13 the panels where registers hold
            # 12 rows (AVX2: a last chunk of 1 row would cost a whole pass over the weights),
            # 9 where they hold 8 (SSE), 14 the register path there (8 + 6), 17 the panels
            # everywhere: the same products of the dequantized weights in the same order.
            for n in (3, 4, 8, 9, 12, 13, 14, 17):
                start = min(r, len(x) - n)  # n rows that hold row r
                assert torch.equal(weight.matmul(x[start : start + n].clone())[r - start],
                                   together[r])
            # 1 and 2 rows take the narrow path (a block's codes first, its scale once):
            # other float32 roundings, the same bits for a row either way.
            alone = weight.matmul(x[r : r + 1].clone())[0]
            assert torch.equal(weight.matmul(x[r : r + 2].clone())[0], alone)
            if r > 0:
                assert torch.equal(weight.matmul(x[r - 1 : r + 1].clone())[1], alone)
            torch.testing.assert_close(alone, together[r], rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(threads)


@QUANT_TYPES
def test_the_register_path_for_more_rows_gives_the_panels_bits(
    quant: QuantKernel, ggml_type: str
) -> None:
    # `register_rows` (the plan's `quant_wide`) moves 17-64 rows from the panel buffer to
    # weights dequantized in registers once per chunk of rows: a speed choice, so every row
    # must keep its bits, including a last chunk of 1 row and the rows past the limit.
    blocks, _ = quant_matrix(ggml_type, 48, 576, seed=7)
    panels = QuantWeight.pack(blocks, 576, quant)
    wide = panels.with_register_rows(64)
    assert wide.packed is panels.packed  # one stored weight, two ways to multiply by it
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(8))
    for n in (17, 20, 25, 32, 33, 37, 64, 65, 70):  # last chunks of 1 row: 25, 37 (12 a pass), 33
        assert torch.equal(wide.matmul(x[:n]), panels.matmul(x[:n]))
    with pytest.raises(RuntimeError, match="register_rows must be >= 0"):
        quant.quant_matmul(x[:3], panels.packed, -1)


def int8_reference(x: torch.Tensor, blocks: QuantBlocks) -> torch.Tensor:
    """What the 8-bit-activation path computes, in float64 from the raw Q4_1 blocks: x rounded
    to int8 per 32-input block (scale max|x| / 127, ties to even), then per block
    d * dx * sum q qx + m * dx * sum qx."""
    raw = blocks.rows.numpy().reshape(blocks.rows.shape[0], -1, 20)
    d = torch.from_numpy(raw[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64))
    m = torch.from_numpy(raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
    nibbles = torch.from_numpy(raw[:, :, 4:].astype(np.int64))
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=2).double()  # [out, blocks, 32]
    xb = x.double().view(x.shape[0], -1, 32)
    dx = (xb.abs().amax(dim=2) / 127).float().double()  # float32, as the kernel's scale
    qx = torch.round(xb / torch.where(dx > 0, dx, 1)[..., None]).clamp(-127, 127)
    dots = torch.einsum("rbk,obk->rob", qx, q)  # [rows, out, blocks]
    return (d[None] * dx[:, None] * dots + m[None] * dx[:, None] * qx.sum(2)[:, None]).sum(2)


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576)])
def test_int8_activations_compute_the_rounded_product(quant: QuantKernel, rows: int, k: int,
                                                      n: int) -> None:
    blocks, weight = quant_matrix("Q4_1", n, k, seed=k + rows)
    x = torch.randn(rows, k + 8, generator=torch.Generator().manual_seed(rows))[:, :k]
    got = quant.quant_matmul_q8(x.contiguous(), QuantWeight.pack(blocks, k, quant).packed)
    torch.testing.assert_close(got.double(), int8_reference(x, blocks), rtol=1e-5, atol=1e-4)
    # The rounding of x is the whole difference from the exact product: about 0.5 %.
    exact = x.double() @ weight.double().t()
    assert 1e-4 < float((got.double() - exact).norm() / exact.norm()) < 0.02


def test_int8_rows_route_only_the_few_row_calls_of_q4_1_weights(quant: QuantKernel) -> None:
    blocks, _ = quant_matrix("Q4_1", 64, 576, seed=8)
    plain = QuantWeight.pack(blocks, 576, quant)
    int8 = packed_matmul.with_activation_rounding(plain, packed_matmul.INT8_ACTIVATION_ROWS,
                                                  False)
    assert isinstance(int8, QuantWeight) and int8.packed is plain.packed  # no second copy
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(9))
    for rows in (1, 2):
        assert torch.equal(int8.matmul(x[:rows]), quant.quant_matmul_q8(x[:rows], plain.packed))
        assert not torch.equal(int8.matmul(x[:rows]), plain.matmul(x[:rows]))
    assert torch.equal(int8.matmul(x), plain.matmul(x))  # 3 rows: the float path
    # A row's result is its own: alone or beside another.
    assert torch.equal(int8.matmul(x[1:2])[0], int8.matmul(x[:2])[1])
    assert torch.equal(packed_matmul.with_activation_rounding(int8, 0, False).matmul(x[:1]),
                       plain.matmul(x[:1]))
    q8_blocks, _ = quant_matrix("Q8_0", 64, 576, seed=8)
    head = QuantWeight.pack(q8_blocks, 576, quant)
    # an 8-bit weight keeps float x at 1-2 rows
    assert packed_matmul.with_activation_rounding(head, 2, False) == head


def int16_reference(x: torch.Tensor, blocks: QuantBlocks) -> torch.Tensor:
    """What the 16-bit-activation path computes, in float64 from the raw blocks: x rounded to
    int16 per 32-input block (scale max|x| / 32767 in float32, ties to even), then per block
    d * dx * sum q qx (+ m * dx * sum qx for Q4_1)."""
    q4 = blocks.ggml_type == "Q4_1"
    raw = blocks.rows.numpy().reshape(blocks.rows.shape[0], -1, 20 if q4 else 34)
    d = torch.from_numpy(raw[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64))
    if q4:
        m = torch.from_numpy(raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
        nibbles = torch.from_numpy(raw[:, :, 4:].astype(np.int64))
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=2).double()  # [out, blocks, 32]
    else:
        q = torch.from_numpy(raw[:, :, 2:].copy().view(np.int8).astype(np.float64))
    xb = x.float().view(x.shape[0], -1, 32)
    amax = xb.abs().amax(dim=2)
    dx = (amax / 32767).double()
    # A tensor divided by a tensor: `32767 / amax` is computed as 32767 * (1 / amax) in torch,
    # one rounding more than the kernel's 32767.f / amax (and a tie's other side now and then).
    inverse = torch.where(amax > 0, torch.full_like(amax, 32767) / torch.where(amax > 0, amax, 1),
                          0)
    qx = torch.round(xb * inverse[..., None]).double()
    out = (d[None] * dx[:, None] * torch.einsum("rbk,obk->rob", qx, q))
    if q4:
        out += m[None] * dx[:, None] * qx.sum(2)[:, None]
    return out.sum(2)


@QUANT_TYPES
@pytest.mark.parametrize("rows", [1, 5, 33, 70])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 48)])
def test_int16_activations_compute_the_rounded_product(quant: QuantKernel, ggml_type: str,
                                                       rows: int, k: int, n: int) -> None:
    # n = 48: a last panel of 16 features; 5, 33 and 70 rows: chunks and tiles with a last
    # partial one, on the register path (up to 16 or 64 rows) and on the panels.
    blocks, weight = quant_matrix(ggml_type, n, k, seed=k + rows)
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, k + 8, generator=gen) * torch.rand(1, k + 8, generator=gen) * 4)
    x = x[:, :k]  # strided rows
    x[0, :32] = 0.0  # a block of zeros has scale 0
    got = quant.quant_matmul_i16(x, QuantWeight.pack(blocks, k, quant).packed)
    torch.testing.assert_close(got.double(), int16_reference(x, blocks), rtol=1e-5, atol=1e-4)
    # The rounding of x is the whole difference from the exact product: ~3e-5, 1/200 of the
    # 8-bit path's.
    exact = x.double() @ weight.double().t()
    assert 1e-7 < float((got.double() - exact).norm() / exact.norm()) < 2e-4


def test_int16_activations_pass_non_finite_inputs_through(quant: QuantKernel) -> None:
    blocks, _ = quant_matrix("Q4_1", 32, 64, seed=3)
    packed = QuantWeight.pack(blocks, 64, quant).packed
    x = torch.randn(3, 64)
    x[1, 40] = float("nan")
    x[2, 3] = float("inf")
    got = quant.quant_matmul_i16(x, packed)
    assert torch.isfinite(got[0]).all() and not torch.isfinite(got[1:]).any()


def test_int16_takes_every_call_but_the_int8_ones(quant: QuantKernel) -> None:
    for ggml_type in ("Q4_1", "Q8_0"):
        blocks, _ = quant_matrix(ggml_type, 64, 576, seed=8)
        plain = QuantWeight.pack(blocks, 576, quant)
        int16 = packed_matmul.with_activation_rounding(plain, 0, True)
        assert isinstance(int16, QuantWeight) and int16.packed is plain.packed
        x = torch.randn(70, 576, generator=torch.Generator().manual_seed(9))
        for rows in (1, 2, 9, 70):  # the register path (up to 16 or 64 rows) and the panels
            assert torch.equal(int16.matmul(x[:rows]), quant.quant_matmul_i16(x[:rows],
                                                                              plain.packed))
            assert not torch.equal(int16.matmul(x[:rows]), plain.matmul(x[:rows]))
        # A row's result is its own, whatever else the call holds and whichever path it takes.
        assert torch.equal(int16.matmul(x[5:6])[0], int16.matmul(x)[5])
        assert torch.equal(int16.matmul(x[:9])[5], int16.matmul(x)[5])
        # With 8-bit rows too, those keep 8 bits (Q4_1) and the rest take 16.
        both = packed_matmul.with_activation_rounding(plain, 2, True)
        assert torch.equal(both.matmul(x[:3]), int16.matmul(x[:3]))
        assert torch.equal(both.matmul(x[:2]), (quant.quant_matmul_q8 if ggml_type == "Q4_1"
                                                else quant.quant_matmul_i16)(x[:2], plain.packed))


def test_quantized_refuses_rows_of_the_wrong_width_and_matrices_it_cannot_take(
    quant: QuantKernel,
) -> None:
    blocks, _ = quant_matrix("Q4_1", 32, 64, seed=0)
    with pytest.raises(ValueError, match="rows of 60 features for a weight of 64 inputs"):
        QuantWeight.pack(blocks, 64, quant).matmul(torch.randn(2, 60))
    with pytest.raises(ValueError, match=r"raw rows \(8, 40\) are not Q4_1 blocks of 64 inputs"):
        QuantWeight.pack(QuantBlocks("Q4_1", blocks.rows[:8]), 64, quant)  # not 16 rows
    q8, _ = quant_matrix("Q8_0", 32, 64, seed=0)
    with pytest.raises(ValueError, match=r"raw rows \(32, 68\) are not Q4_1 blocks"):
        QuantWeight.pack(QuantBlocks("Q4_1", q8.rows), 64, quant)  # Q8_0 blocks called Q4_1
    assert QuantBlocks.concat([blocks, q8]) is None  # one fused matmul needs one type


@torch.inference_mode()
def test_a_gguf_with_quantized_layers_runs_on_the_quantized_kernel_as_on_float32(
    quant: QuantKernel, packer: Packer, tmp_path: Path
) -> None:
    config = tiny_config()
    layer_matrices = {f"layers.{i}.{name}" for i in range(config.num_layers)
                      for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                   "up_proj", "down_proj")}
    qtypes = {name: gguf.GGMLQuantizationType.Q4_1 for name in layer_matrices}
    qtypes["layers.1.o_proj"] = gguf.GGMLQuantizationType.Q8_0
    qtypes["layers.1.down_proj"] = gguf.GGMLQuantizationType.F16  # stays float32 (MKL)
    qtypes["layers.0.up_proj"] = gguf.GGMLQuantizationType.Q8_0  # fused with a Q4_1 gate: MKL
    path = write_gguf(tmp_path / "q4.gguf", config, random_weights(config, seed=8), qtypes)
    plain = load_model(path, show_progress=False).model
    packed = load_model(path, show_progress=False).model
    packed.pack_weights(packer, quant)
    kinds = [type(w).__name__ for layer in packed._packed or [] for w in layer]
    quantized, mkl = "QuantWeight", "PackedWeight"
    assert kinds == [quantized, quantized, mkl, quantized, quantized, quantized, quantized,
                     mkl], kinds
    ids = torch.tensor([3, 17, 5, 9, 30, 2, 11])
    positions = torch.arange(len(ids))
    want = plain.compute_logits(plain(ids, positions, ContiguousAttention(plain)))
    # Q/K rows are unpermuted in the raw blocks as in the float32 weights, or RoPE would
    # rotate the wrong pairs and this would be far off.
    got = packed.compute_logits(packed(ids, positions, ContiguousAttention(packed)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("tied", [True, False])
@torch.inference_mode()
def test_a_q8_0_lm_head_runs_on_the_quantized_kernel(quant: QuantKernel, tied: bool) -> None:
    # The tiny GGUF's vocabulary (268) is no multiple of 16: a model of 272 tokens instead.
    config = replace(tiny_config(tie_word_embeddings=tied), vocab_size=272)
    weights = random_weights(config, seed=4)
    head = "embed_tokens" if tied else "lm_head"
    blocks, weights[head] = quant_matrix("Q8_0", 272, config.hidden_size, seed=9)
    plain = LlamaModel(config, weights).eval()
    packed = LlamaModel(config, weights, quant_blocks={head: blocks}).eval()
    packed.pack_weights(None, quant)
    assert isinstance(packed._lm_head_packed, QuantWeight)
    hidden = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden),
                               rtol=0, atol=1e-4)
    # Batch-invariant logits stay on the float32 matrix.
    assert torch.equal(packed.compute_logits(hidden, batch_invariant=True),
                       plain.compute_logits(hidden, batch_invariant=True))


@pytest.mark.parametrize(("load", "off"), [(load_packer, ["torch"]),
                                           (load_quant_kernel, ["mkl", "torch"])])
def test_switched_off_by_environment(load: Callable[[], object], off: list[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for value in off:
        monkeypatch.setenv(packed_matmul.ENV_SWITCH, value)
        assert load() is None


@pytest.mark.parametrize(("load", "instead"), [
    (load_packer, "weight matmuls use torch.mm"),
    (load_quant_kernel, "Q4_1/Q8_0 weights are multiplied as float32"),
])
def test_a_failed_build_falls_back_with_one_warning(
    load: Callable[[], object], instead: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, tmp_path: Path,
) -> None:
    assert instead in warning_when_every_build_fails(load, monkeypatch, caplog, tmp_path)


def test_weight_bytes_read_follow_the_path_each_row_count_takes(
    quant: QuantKernel, packer: Packer, tmp_path: Path
) -> None:
    config = tiny_config()
    q4 = {f"layers.{i}.{name}": gguf.GGMLQuantizationType.Q4_1
          for i in range(config.num_layers)
          for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj")}
    path = write_gguf(tmp_path / "q4.gguf", config, random_weights(config, seed=3), q4)
    model = load_model(path, show_progress=False).model
    float32 = model.weight_bytes_read(1)
    params = sum(4 * w.numel() for w in (*model.qkv_t, *model.o_t, *model.gate_up_t,
                                        *model.down_t)) + model.lm_head.nbytes
    assert float32 == params
    # Up to 4 rows on the 4-bit blocks, MKL-packed float32 above: 20 bytes per 32 weights
    # (the packing keeps the block scales as float32, a little more) vs 4 bytes a weight.
    plan = MatmulPlan(timings={}, choices={
        s.shape.key: ShapeChoice((4, 2**62), ("quant", "mkl"))
        for s in model.weight_samples() if s.shape.name != "lm_head"})
    model.pack_weights(packer, quant, plan)
    head = model.lm_head.nbytes
    layers_f32 = float32 - head
    small, large = model.weight_bytes_read(4) - head, model.weight_bytes_read(5) - head
    assert large == layers_f32
    assert layers_f32 * 20 / 128 <= small < layers_f32 / 4
