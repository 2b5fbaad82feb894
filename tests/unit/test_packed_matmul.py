"""Packed weight matmuls (MKL float32, 4-bit Q4_1): the same products as torch.mm, the model
on packed weights, and the fallback when an extension cannot be built."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from native_helpers import warning_when_every_build_fails
from test_model_runner import ContiguousAttention
from tiny_llama import random_weights, tiny_config, write_gguf

from kvfleet.engine import packed_matmul
from kvfleet.engine.model import load_model
from kvfleet.engine.model.llama import LlamaModel
from kvfleet.engine.packed_matmul import (
    PackedWeight,
    Packer,
    Q4Kernel,
    Q4Weight,
    load_packer,
    load_q4_kernel,
)

Q4_1 = gguf.GGMLQuantizationType.Q4_1


@pytest.fixture(scope="module")
def packer() -> Packer:
    built = load_packer()
    if built is None:
        pytest.skip("no MKL in this torch build or no C++ compiler")
    return built


@pytest.fixture(scope="module")
def q4() -> Q4Kernel:
    # The test machine has a C++ compiler and ninja: the kernel must build here.
    built = load_q4_kernel()
    assert built is not None, "the 4-bit matmul did not build (see the log)"
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




def q4_1_matrix(out_features: int, in_features: int, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw Q4_1 rows [out, in / 32 * 20] as a GGUF stores them, their float32 dequantization)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen).numpy()
    raw = gguf.quants.quantize(weight, Q4_1)
    dequantized = np.array(gguf.quants.dequantize(raw, Q4_1), dtype=np.float32)
    return torch.from_numpy(np.array(raw)), torch.from_numpy(dequantized)


def test_q4_weights_are_exactly_the_loaders_float32_weights(q4: Q4Kernel) -> None:
    raw, weight = q4_1_matrix(48, 96, seed=1)
    # x = identity: each product is one weight times 1 plus zeros, so any dequantization
    # difference (e.g. d * q + m fused into one rounding) shows.
    got = Q4Weight.pack(raw, 96, q4).matmul(torch.eye(96))
    assert torch.equal(got, weight.t())


@pytest.mark.parametrize("rows", [0, 1, 5, 12, 13, 30, 103])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576), (64, 48)])  # 48: a half panel
def test_q4_product_matches_torch_mm(q4: Q4Kernel, rows: int, k: int, n: int) -> None:
    raw, weight = q4_1_matrix(n, k, seed=rows + k)
    gen = torch.Generator().manual_seed(rows)
    # Rows of a wider tensor, as the model passes slices of a fused projection.
    x = torch.randn(rows, k + 8, generator=gen)[:, :k]
    got = Q4Weight.pack(raw, k, q4).matmul(x)
    assert got.shape == (rows, n)
    # Against float64: a float32 sum of 1,536 products of size ~1 is off by ~1e-4 either way.
    expected = (x.double() @ weight.double().t()).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=3e-4)


def test_q4_a_rows_bits_do_not_depend_on_the_other_rows(q4: Q4Kernel) -> None:
    raw, _ = q4_1_matrix(64, 576, seed=5)
    weight = Q4Weight.pack(raw, 576, q4)
    x = torch.randn(29, 576, generator=torch.Generator().manual_seed(6))
    together = weight.matmul(x)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # another split of panels across threads changes nothing either
    try:
        for r in (0, 11, 12, 28):
            assert torch.equal(weight.matmul(x[r : r + 1].clone())[0], together[r])
            assert torch.equal(weight.matmul(x[r : r + 14].clone())[0], together[r])
    finally:
        torch.set_num_threads(threads)


def test_q4_refuses_rows_of_the_wrong_width_and_matrices_it_cannot_take(q4: Q4Kernel) -> None:
    raw, _ = q4_1_matrix(32, 64, seed=0)
    with pytest.raises(ValueError, match="rows of 60 features for a weight of 64 inputs"):
        Q4Weight.pack(raw, 64, q4).matmul(torch.randn(2, 60))
    with pytest.raises(ValueError, match=r"raw rows \(8, 40\) are not Q4_1 blocks of 64 inputs"):
        Q4Weight.pack(raw[:8], 64, q4)  # 8 output rows: not a multiple of 16


@torch.inference_mode()
def test_a_gguf_with_q4_1_layers_runs_on_the_4bit_kernel_as_on_float32(
    q4: Q4Kernel, packer: Packer, tmp_path: Path
) -> None:
    config = tiny_config()
    layer_matrices = {f"layers.{i}.{name}" for i in range(config.num_layers)
                      for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                   "up_proj", "down_proj")}
    qtypes = {name: Q4_1 for name in layer_matrices}
    qtypes["layers.1.o_proj"] = gguf.GGMLQuantizationType.Q8_0  # stays float32 (MKL)
    path = write_gguf(tmp_path / "q4.gguf", config, random_weights(config, seed=8), qtypes)
    plain = load_model(path, show_progress=False).model
    packed = load_model(path, show_progress=False).model
    packed.pack_weights(packer, q4)
    kinds = [type(w).__name__ for layer in packed._packed or [] for w in layer]
    assert kinds == ["Q4Weight"] * 5 + ["PackedWeight"] + ["Q4Weight"] * 2, kinds
    ids = torch.tensor([3, 17, 5, 9, 30, 2, 11])
    positions = torch.arange(len(ids))
    want = plain.compute_logits(plain(ids, positions, ContiguousAttention(plain)))
    # Q/K rows are unpermuted in the 4-bit blocks as in the float32 weights, or RoPE would
    # rotate the wrong pairs and this would be far off.
    got = packed.compute_logits(packed(ids, positions, ContiguousAttention(packed)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("load", "off"), [(load_packer, ["torch"]),
                                           (load_q4_kernel, ["mkl", "torch"])])
def test_switched_off_by_environment(load: Callable[[], object], off: list[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for value in off:
        monkeypatch.setenv(packed_matmul.ENV_SWITCH, value)
        assert load() is None


@pytest.mark.parametrize(("load", "instead"), [
    (load_packer, "weight matmuls use torch.mm"),
    (load_q4_kernel, "Q4_1 weights are multiplied as float32"),
])
def test_a_failed_build_falls_back_with_one_warning(
    load: Callable[[], object], instead: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert instead in warning_when_every_build_fails(load, monkeypatch, caplog)
