"""Tensors on transparent huge pages: what they hold, where, and the fallback without them."""

from __future__ import annotations

import mmap

import pytest
import torch

from kvfleet.engine import hugepages


def test_zeros_is_torch_zeros_in_an_advised_mapping() -> None:
    t = hugepages.zeros(3, 1024, 700, dtype=torch.float32)
    assert t.shape == (3, 1024, 700) and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()
    t[1, 2, 3] = 5.0  # writable, and its own memory
    assert t.sum().item() == 5.0
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert t.data_ptr() % mmap.PAGESIZE == 0  # a mapping of its own, not the heap


def test_gather_copies_side_by_side_aligned() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 255, (5, 7), dtype=torch.uint8, generator=gen),
               torch.randn(3, 33, generator=gen), torch.empty(0),
               torch.randn(2, 5, generator=gen).t()]  # not contiguous
    copies = hugepages.gather(tensors)
    for original, copy in zip(tensors, copies, strict=True):
        assert copy.dtype == original.dtype and torch.equal(copy, original)
        assert copy.is_contiguous() and copy.data_ptr() % 64 == 0
    # One mapping: every copy views the same storage; the originals are not touched.
    storages = {c.untyped_storage().data_ptr() for c in copies}
    assert len(storages) == 1
    copies[1].zero_()
    assert tensors[1].any()


def test_without_huge_pages_plain_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    t = hugepages.zeros(4, 5, dtype=torch.float64)
    assert t.dtype == torch.float64 and not t.any()
    assert torch.equal(hugepages.gather([torch.ones(3)])[0], torch.ones(3))
