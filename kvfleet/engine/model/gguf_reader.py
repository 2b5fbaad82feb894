"""A small, strict GGUF container parser: metadata, tensor directory, raw tensor bytes.

`gguf.GGUFReader` builds a numpy memmap view per metadata element, which takes seconds for
a 49k-token vocabulary; this parser reads the same layout with `struct` in ~0.1 s and checks
every length against the file size, so a truncated or corrupt file is a `ModelLoadError`
instead of a numpy reshape error. Dequantization still uses `gguf.quants`.

Layout (little-endian, GGUF v2/v3): magic "GGUF", u32 version, u64 tensor count, u64 KV count;
KV pairs (string key, u32 value type, value); tensor infos (string name, u32 n_dims, u64 dims
in ggml order, u32 ggml type, u64 offset); padding to `general.alignment`; tensor data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from kvfleet.engine.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_CORRUPT_REMEDY = "The file is truncated or corrupt; re-download it and check its sha256"

# GGUF metadata value types -> struct format of one scalar.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_NUMPY = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9


class _Corrupt(Exception):
    """Internal: the byte stream does not parse; turned into ModelLoadError at the boundary."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (numpy/torch) order: ggml dims reversed
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.pos = 0
        self.size = len(buffer)

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > self.size:
            raise _Corrupt(f"unexpected end of file at byte {self.pos}")
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.take("Q")
        if self.pos + length > self.size:
            raise _Corrupt(f"string of {length} bytes at byte {self.pos} runs past the end")
        raw = self.buffer[self.pos : self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # llama.cpp vocabularies may hold tokens that are not valid UTF-8 on their own.
            return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.take(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.take("I"), self.take("Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type]).newbyteorder("<")
                end = self.pos + count * dtype.itemsize
                if end > self.size:
                    raise _Corrupt(f"array of {count} items at byte {self.pos} runs past the end")
                items = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
                self.pos = end
                return items.tolist()
            if count > self.size:  # every element takes at least one byte
                raise _Corrupt(f"array length {count} exceeds the file size")
            return [self.value(item_type) for _ in range(count)]
        raise _Corrupt(f"unknown metadata value type {value_type} at byte {self.pos}")


class GGUFFile:
    """A parsed GGUF file; tensor bytes are read lazily from a read-only memory map."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with path.open("rb") as handle:
                magic = handle.read(4)
                if magic != GGUF_MAGIC:
                    raise ModelLoadError(
                        path,
                        f"not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})",
                        "Pass a .gguf model file or an HF checkpoint directory",
                    )
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ModelLoadError(
                path, f"cannot read the file ({exc.strerror})", "Check the path and its permissions"
            ) from exc
        try:
            self.metadata, self.tensors = self._parse()
        except (_Corrupt, struct.error, ValueError, OverflowError) as exc:
            raise ModelLoadError(
                path, f"unreadable GGUF structure ({exc})", _CORRUPT_REMEDY
            ) from exc

    def _parse(self) -> tuple[dict[str, Any], list[TensorInfo]]:
        cur = _Cursor(self._map)
        cur.pos = 4
        version = cur.take("I")
        if version not in (2, 3):
            raise _Corrupt(f"GGUF version {version} (supported: 2, 3)")
        num_tensors, num_kv = cur.take("Q"), cur.take("Q")
        if num_tensors > cur.size or num_kv > cur.size:
            raise _Corrupt(f"header claims {num_tensors} tensors and {num_kv} keys")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.take("I"))
        raw_infos = []
        for _ in range(num_tensors):
            name = cur.string()
            n_dims = cur.take("I")
            if n_dims > 8:
                raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
            dims = [cur.take("Q") for _ in range(n_dims)]
            raw_infos.append((name, dims, cur.take("I"), cur.take("Q")))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise _Corrupt(f"general.alignment {alignment} is not a power of two")
        data_start = -(-cur.pos // alignment) * alignment
        tensors = [
            self._tensor_info(name, dims, type_id, data_start + offset)
            for name, dims, type_id, offset in raw_infos
        ]
        return metadata, tensors

    def _tensor_info(self, name: str, dims: list[int], type_id: int, offset: int) -> TensorInfo:
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError as exc:
            raise _Corrupt(f"tensor {name!r} has unknown ggml type {type_id}") from exc
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if dims and dims[0] % block:
            raise _Corrupt(f"tensor {name!r} row length {dims[0]} is not a multiple of {block}")
        nbytes = elements // block * type_size
        if offset + nbytes > len(self._map):
            raise _Corrupt(
                f"tensor {name!r} ends at byte {offset + nbytes}, past the end of "
                f"the {len(self._map)}-byte file"
            )
        return TensorInfo(name, tuple(reversed(dims)), ggml_type, offset, nbytes)

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 [rows..., bytes_per_row] (a view of the memory map)."""
        row_bytes = info.nbytes // max(1, int(np.prod(info.shape[:-1], dtype=np.int64)))
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return data.reshape(*info.shape[:-1], row_bytes)
