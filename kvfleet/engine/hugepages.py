"""Tensors on transparent huge pages, for the engine's large, long-lived memory: the KV cache
and the quantized weights.

A step streams every weight (~110 MB for SmolLM2 at 4 and 8 bits, ~27,000 pages of 4 KiB) and
reads the KV cache block by block across hundreds of MiB (a block of one layer's K is 12 KiB,
three pages): with 4 KiB pages most of those pages cost a TLB miss and a page walk. On 2 MiB
pages, measured in separate processes taken in turns (SmolLM2, 2 threads, three of each): a
decode step 23.0-24.3 instead of 25.9-35.2 ms; prompts' prefill within the noise.

Linux only backs memory with huge pages when asked (`madvise` mode, the common default) or
always; elsewhere, or if the kernel says no, the memory is ordinary and nothing else changes.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
from collections.abc import Sequence

import torch


def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(*shape, dtype=dtype)` (its pages not yet touched), in an anonymous mapping
    advised to use huge pages. The tensor holds the mapping (through its storage); it is
    unmapped when the tensor goes."""
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes == 0:
        return torch.empty(*shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # A kernel without transparent huge pages refuses: ordinary pages then.
    with contextlib.suppress(OSError):
        region.madvise(advice)
    return torch.frombuffer(region, dtype=dtype, count=count).view(shape)


def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros` on huge pages. Anonymous memory reads as zeros already; writing it faults
    every page in now (as torch.zeros does), at start-up, not on the first steps that touch
    each part."""
    return empty(*shape, dtype=dtype).zero_()


def gather(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of `tensors`, side by side (64-byte aligned) in one mapping on huge
    pages: one, because huge pages back only whole 2 MiB ranges and most layer weights are
    smaller (SmolLM2's are 0.4-1.3 MB)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    # Each copy starts 64-byte aligned; the last entry is the total.
    starts = [0, *itertools.accumulate(-(-n // 64) * 64 for n in sizes)]
    arena = empty(starts[-1], dtype=torch.uint8)
    return [arena[start:start + n].view(t.dtype).view(t.shape).copy_(t)
            for t, start, n in zip(tensors, starts, sizes, strict=False)]
