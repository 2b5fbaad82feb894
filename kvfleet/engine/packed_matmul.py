"""Weight matmuls on weights packed once at start-up: GGUF's 4- and 8-bit blocks
(`csrc/quant_matmul.cpp`) or MKL's float32 layout (`csrc/packed_matmul.cpp`).

Q4_1 and Q8_0 (the embedded SmolLM2 file's layer matrices, and its tied Q8_0 embedding, which
is also the LM head): the weights stay quantized and each thread dequantizes a 32-feature
panel into a float32 buffer in its L2 just before multiplying every row of the step by it. The
values are exactly the loader's float32 weights; a step moves ~5x (Q4_1) or ~3.5x (Q8_0) fewer
weight bytes, which a float32 step at a few rows spends most of its time waiting for. Each row
is summed in one fixed order whatever the other rows are. All 120 weight matmuls of a SmolLM2
forward pass, side by side with MKL-packed float32 (2 threads, two runs): 14-15 vs 20-21 ms at
1 row, 17-19 vs 31-32 at 8, 57-64 vs 60-67 at 64, 81-88 vs 94-101 at 103, 372-386 vs 350-373
at 512. Engine memory falls by the float32 copies (RSS 1097 vs 1463 MiB for SmolLM2,
`bench/engine_throughput.py`). The LM head (49,152 x 576) on Q8_0 reads 30 instead of 113 MB a
step: in one process, alternating, a prefix-cache hit took 418 vs 438 ms and 8 requests of 33
tokens 4.9 vs 5.4 s against the MKL-packed float32 head (a slow phase of this host).

MKL (every other weight type):

`torch.mm` re-packs the weight into MKL's panel layout on every call, which at the row
counts of an engine step is a large part of the call. Packing once at start-up and
multiplying with MKL's packed API made a SmolLM2 step's weight matmuls faster at every row
count a step has (2 threads, the same shapes side by side: 40 vs 59 ms at 8 rows, 75 vs 102
at 64, 101 vs 130 at 103, 403 vs 444 at 512; inside engine decode steps, two runs each:
40-45 vs 53-58 ms at 8 running, 71-86 vs 90-105 at 64). The results are float32 like `torch.mm`'s
but not always bit for bit (MKL may sum a long row in another order), so batch-invariant
mode keeps `torch.mm` on the unpacked weights.

The figures above are from an AVX-512 host. Which of the quantized kernel, MKL and
`torch.mm` serves a weight at a given row count is measured on each host (`matmul_plan`):
`RowRoutedWeight` holds a weight in two representations where the measurement says one would
cost too much at some row count, `TorchWeight` is the plain path.

Both are built on first use like every compiled part of the engine (see `native`).
`KVFLEET_MATMUL=mkl` keeps Q4_1/Q8_0 matrices on MKL too, `KVFLEET_MATMUL=torch` turns packing off;
when one cannot be built (or torch has no MKL) the engine logs why once and uses the next.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
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


class QuantKernel(Protocol):
    def q4_1_pack(self, raw: torch.Tensor, in_features: int) -> torch.Tensor: ...

    def q8_0_pack(self, raw: torch.Tensor, in_features: int) -> torch.Tensor: ...

    def quant_matmul(self, x: torch.Tensor, packed: torch.Tensor,
                     register_rows: int = 0) -> torch.Tensor: ...

    def quant_matmul_q8(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor: ...

    def quant_matmul_i16(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor: ...


class WeightMatmul(Protocol):
    """A layer weight that multiplies rows x [M, in] into [M, out]."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...


class TorchWeight:
    """A weight no packing takes: `torch.mm(x, weight_t)` on the float32 [in, out] matrix (a
    transposed view of an [out, in] one is fine: MKL reads it in place)."""

    def __init__(self, weight_t: torch.Tensor) -> None:
        self.weight_t = weight_t.detach()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.weight_t)


@dataclass(frozen=True, slots=True)
class RowRoutedWeight:
    """One weight in two or more representations, each serving calls up to a row count (see
    `matmul_plan`): `weights[i]` takes calls of up to `max_rows[i]` rows, the last any more."""

    max_rows: tuple[int, ...]
    weights: tuple[WeightMatmul, ...]

    def for_rows(self, rows: int) -> WeightMatmul:
        """The representation that takes a call of `rows` rows."""
        for limit, weight in zip(self.max_rows, self.weights, strict=True):
            if rows <= limit:
                return weight
        return self.weights[-1]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.for_rows(x.shape[0]).matmul(x)


# Bytes of one 32-weight block of each GGUF type the quantized kernel takes.
QUANT_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
# Calls of up to this many rows take the 8-bit-activation path when it is switched on
# (`QuantWeight.int8_rows`): the kernel multiplies two rows per pass over the weights, so more
# rows would stream the weights again for every two.
INT8_ACTIVATION_ROWS = 2


@dataclass(frozen=True, slots=True)
class QuantBlocks:
    """A matrix [out, in] as a GGUF stores it: raw blocks, uint8 [out, in / 32 * block bytes]."""

    ggml_type: str  # a key of QUANT_BLOCK_BYTES
    rows: torch.Tensor

    def fits(self, in_features: int) -> bool:
        """Whether the blocks have the shape the kernel takes (16 outputs per group)."""
        block = QUANT_BLOCK_BYTES.get(self.ggml_type)
        rows = self.rows
        return (block is not None and rows.dim() == 2 and rows.shape[0] % 16 == 0
                and in_features % 32 == 0 and rows.shape[1] == in_features // 32 * block)

    @staticmethod
    def concat(parts: list[QuantBlocks]) -> QuantBlocks | None:
        """Matrices fused along the output features (e.g. Q, K, V), if all have one type."""
        types = {part.ggml_type for part in parts}
        if len(types) != 1:
            return None
        return QuantBlocks(types.pop(), torch.cat([part.rows for part in parts]))


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A Q4_1 or Q8_0 weight in the quantized kernel's layout, and the kernel."""

    packed: torch.Tensor
    in_features: int
    out_features: int
    kernel: QuantKernel
    ggml_type: str  # a key of QUANT_BLOCK_BYTES
    # Calls of up to this many rows round x to 8 bits per 32-input block and sum in integers
    # (`quant_matmul_q8`, Q4_1 only): ~1.1-1.25x faster at one row on an AVX2 host, llama.cpp's
    # numerics rather than the float32 weights' exact products, so opt-in (see `with_rounding`).
    int8_rows: int = 0
    # Every other call rounds x to 16 bits per 32-input block and sums code x input pairs in
    # integers (`quant_matmul_i16`): SmolLM2's weight matmuls 1.1-1.9x faster at 1-64 rows
    # where the CPU has AVX-512 VNNI (bench/README.md); logits move ~7e-3 from HF's, so opt-in.
    int16: bool = False
    # Calls of up to this many rows dequantize each weight in registers, once per 16 rows (8 on
    # AVX2), rather than into a panel buffer that all rows share; 0: the kernel's built-in
    # limit. The matmul plan measures which is faster per host and shape (`with_register_rows`).
    register_rows: int = 0

    @classmethod
    def pack(cls, blocks: QuantBlocks, in_features: int, kernel: QuantKernel) -> QuantWeight:
        if not blocks.fits(in_features):
            raise ValueError(f"quantized matmul: raw rows {tuple(blocks.rows.shape)} are not "
                             f"{blocks.ggml_type} blocks of {in_features} inputs in a multiple "
                             f"of 16 rows")
        pack = kernel.q4_1_pack if blocks.ggml_type == "Q4_1" else kernel.q8_0_pack
        return cls(pack(blocks.rows.contiguous(), in_features), in_features,
                   blocks.rows.shape[0], kernel, blocks.ggml_type)

    def with_rounding(self, int8_rows: int, int16: bool) -> QuantWeight:
        """The same weight (same packed tensor) rounding x to 8 bits in calls of up to
        `int8_rows` rows and, if `int16`, to 16 bits in the others. A Q8_0 weight keeps x at
        least 16 bits (8 bits gained ~8 % on a memory-bound LM head and would round the
        logits' input much more coarsely)."""
        return replace(self, int8_rows=int8_rows if self.ggml_type == "Q4_1" else 0,
                       int16=int16)

    def with_register_rows(self, rows: int) -> QuantWeight:
        """The same weight (same packed tensor) taking the register path up to `rows` rows."""
        return replace(self, register_rows=rows)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T for rows x [M, in]."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"quantized matmul: rows of {x.shape[-1]} features for a weight "
                             f"of {self.in_features} inputs")
        rows = x if x.stride(-1) == 1 else x.contiguous()
        if self.int8_rows and x.shape[0] <= self.int8_rows:
            return self.kernel.quant_matmul_q8(rows, self.packed)
        if self.int16:
            return self.kernel.quant_matmul_i16(rows, self.packed)
        return self.kernel.quant_matmul(rows, self.packed, self.register_rows)


def with_activation_rounding(weight: WeightMatmul, int8_rows: int, int16: bool) -> WeightMatmul:
    """`weight` with its 4-bit-kernel paths rounding x as `QuantWeight.with_rounding` says
    (where a plan routes those calls to that kernel); other paths unchanged."""
    if isinstance(weight, QuantWeight):
        return weight.with_rounding(int8_rows, int16)
    if isinstance(weight, RowRoutedWeight):
        return RowRoutedWeight(weight.max_rows, tuple(
            w.with_rounding(int8_rows, int16) if isinstance(w, QuantWeight) else w
            for w in weight.weights))
    return weight


def bytes_read(weight: WeightMatmul, rows: int) -> int:
    """Bytes a multiplication of `rows` rows by `weight` reads of the weight itself: the
    representation its path takes at that row count (4-bit or 8-bit blocks, float32 packed or
    plain). The weight half of a step's memory traffic (bench/engine_throughput.py's roof)."""
    if isinstance(weight, RowRoutedWeight):
        return bytes_read(weight.for_rows(rows), rows)
    if isinstance(weight, QuantWeight):
        return weight.packed.nbytes
    if isinstance(weight, PackedWeight):
        # MKL's buffer is padded to its panel sizes; what a product streams is the matrix.
        return weight.in_features * weight.out_features * 4
    if isinstance(weight, TorchWeight):
        return weight.weight_t.nbytes
    raise TypeError(f"bytes_read: unknown weight type {type(weight).__name__}")


def load_quant_kernel() -> QuantKernel | None:
    """The quantized kernel, or None (switched off, or not buildable here: logged once)."""
    if os.environ.get(ENV_SWITCH, "auto").lower() in ("mkl", "torch"):
        return None
    module = native.build("quant_matmul", "quantized weight matmul",
                          "Q4_1/Q8_0 weights are multiplied as float32", f"{ENV_SWITCH}=mkl")
    return cast(QuantKernel, module) if module is not None else None


def load_packer() -> Packer | None:
    """The packer, or None (switched off, or not buildable here: the reason is logged once)."""
    if os.environ.get(ENV_SWITCH, "auto").lower() == "torch":
        return None
    if not torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
        return None
    module = native.build("packed_matmul", "packed weight matmul",
                          "weight matmuls use torch.mm", f"{ENV_SWITCH}=torch")
    return cast(Packer, module) if module is not None else None
