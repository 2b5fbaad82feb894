"""MKL-packed weight matmuls: the same products as torch.mm, the model on packed weights,
and the fallback when the extension cannot be built."""

from __future__ import annotations

import pytest
import torch
from native_helpers import warning_when_every_build_fails
from test_model_runner import ContiguousAttention
from tiny_llama import random_weights, tiny_config

from kvfleet.engine import packed_matmul
from kvfleet.engine.model.llama import LlamaModel
from kvfleet.engine.packed_matmul import PackedWeight, Packer, load_packer


@pytest.fixture(scope="module")
def packer() -> Packer:
    built = load_packer()
    if built is None:
        pytest.skip("no MKL in this torch build or no C++ compiler")
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
    ids = torch.tensor([3, 17, 5, 9, 30, 2, 11])
    positions = torch.arange(len(ids))
    want = plain.compute_logits(plain(ids, positions, ContiguousAttention(plain)))
    got = packed.compute_logits(packed(ids, positions, ContiguousAttention(packed)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    with pytest.raises(RuntimeError, match="load the model again for a batch-invariant"):
        packed(ids, positions, ContiguousAttention(packed), batch_invariant=True)


def test_switched_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(packed_matmul.ENV_SWITCH, "torch")
    assert load_packer() is None


def test_a_failed_build_falls_back_to_torch_mm_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    warning = warning_when_every_build_fails(load_packer, monkeypatch, caplog)
    assert "weight matmuls use torch.mm" in warning
