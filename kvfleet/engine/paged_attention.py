"""The compiled attention kernels (`csrc/paged_attention.cpp`), built on first use.

Attention is most of what a step does besides its weight matmuls, and the SDPA path pays for a
copy: it gathers each sequence's K/V blocks into one contiguous tensor and then reads that
copy. The kernels read the cached positions straight from the blocks: decode for every decode
row of a step in one call, prefill for one prompt chunk (causal, after any cached prefix).
After a prefix-cache hit (103 new tokens over 921 cached, SmolLM2) prefill attention took
1.2-1.4 vs 1.9-2.1 ms a layer with SDPA's gather, two calls and merge (2 threads).

It is built on first use like every compiled part of the engine (see `native`).

`KVFLEET_ATTENTION=sdpa` turns the kernels off; when they cannot be built the engine logs why
once and uses SDPA (same results within float rounding, slower).
"""

from __future__ import annotations

import os
from typing import Protocol, cast

import torch

from kvfleet.engine import native

ENV_SWITCH = "KVFLEET_ATTENTION"


class Kernel(Protocol):
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor) -> None: ...

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        start: int,
        scale: float,
    ) -> torch.Tensor: ...


def load_kernel() -> Kernel | None:
    """The kernel, or None (switched off, or not buildable here: the reason is logged once)."""
    if os.environ.get(ENV_SWITCH, "kernel").lower() == "sdpa":
        return None
    module = native.build("paged_attention", "paged attention kernel",
                          "decode attention uses SDPA", f"{ENV_SWITCH}=sdpa")
    return cast(Kernel, module) if module is not None else None
