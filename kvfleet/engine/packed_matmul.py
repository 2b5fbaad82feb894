"""Weight matmuls on weights packed once into MKL's layout (`csrc/packed_matmul.cpp`).

`torch.mm` re-packs the weight into MKL's panel layout on every call, which at the row
counts of an engine step is a large part of the call. Packing once at start-up and
multiplying with MKL's packed API made a SmolLM2 step's weight matmuls faster at every row
count a step has (2 threads, the same shapes side by side: 40 vs 59 ms at 8 rows, 75 vs 102
at 64, 101 vs 130 at 103, 403 vs 444 at 512; inside engine decode steps, two runs each:
40-45 vs 53-58 ms at 8 running, 71-86 vs 90-105 at 64). The results are float32 like `torch.mm`'s
but not always bit for bit (MKL may sum a long row in another order), so batch-invariant
mode keeps `torch.mm` on the unpacked weights.

Built on first use like every compiled part of the engine (see `native`).
`KVFLEET_MATMUL=torch` turns packing off; when it cannot be built (or torch has no MKL) the
engine logs why once and uses `torch.mm`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from kvfleet.engine import native

ENV_SWITCH = "KVFLEET_MATMUL"


class Packer(Protocol):
    def pack_weight(self, weight_t: torch.Tensor) -> torch.Tensor: ...

    def packed_matmul(self, x: torch.Tensor, packed: torch.Tensor, out: int) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """An [in, out] weight in MKL's packed layout, and the packer that multiplies by it."""

    packed: torch.Tensor
    in_features: int
    out_features: int
    packer: Packer

    @classmethod
    def pack(cls, weight_t: torch.Tensor, packer: Packer) -> PackedWeight:
        weight_t = weight_t.detach().contiguous()
        return cls(packer.pack_weight(weight_t), weight_t.shape[0], weight_t.shape[1], packer)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight for rows x [M, in]."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"packed matmul: rows of {x.shape[-1]} features for a weight of "
                             f"{self.in_features} inputs")
        return self.packer.packed_matmul(x.contiguous(), self.packed, self.out_features)


def load_packer() -> Packer | None:
    """The packer, or None (switched off, or not buildable here: the reason is logged once)."""
    if os.environ.get(ENV_SWITCH, "mkl").lower() == "torch":
        return None
    if not torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
        return None
    module = native.build("packed_matmul", "packed weight matmul",
                          "weight matmuls use torch.mm", f"{ENV_SWITCH}=torch")
    return cast(Packer, module) if module is not None else None
