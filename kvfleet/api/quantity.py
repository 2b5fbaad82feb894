"""Kubernetes byte quantities ("24Gi", "16G", "1073741824") as exact integers, and CPU
quantities ("2", "500m") as cores.

Binary suffixes (Ki, Mi, Gi, …) are powers of 1024, decimal ones (k, M, G, …) powers of 1000,
as in Kubernetes. Parsing is exact (Fraction), so "1.5Gi" is 1,610,612,736 bytes, and a value
that is not a whole number of bytes is an error rather than silently rounded.
"""

from __future__ import annotations

import re
from fractions import Fraction

_SUFFIXES: dict[str, int] = {
    "": 1,
    "k": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "P": 1000**5,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
}
# The CLI also accepts the spellings people type: "24GiB", "2GB", "512MiB".
_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)\s*([kKMGTP]i?)?B?\s*$")


class QuantityError(ValueError):
    """A byte quantity that cannot be parsed or is not a whole number of bytes."""


def parse_bytes(text: str | int) -> int:
    """Bytes of a quantity: `parse_bytes("24Gi") == 25769803776`."""
    if isinstance(text, int):
        if text < 0:
            raise QuantityError(f"byte quantity {text} is negative")
        return text
    match = _QUANTITY.match(text)
    if match is None:
        raise QuantityError(
            f"{text!r} is not a byte quantity; write e.g. 24Gi, 24GiB, 16G or 1073741824"
        )
    number, suffix = match.group(1), match.group(2) or ""
    if suffix == "K":
        suffix = "k"
    if suffix == "Ki" or suffix == "ki":
        suffix = "Ki"
    value = Fraction(number) * _SUFFIXES[suffix]
    if value.denominator != 1:
        raise QuantityError(f"{text!r} is not a whole number of bytes")
    return int(value)


_CPU = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k)?$")


def parse_cpu(text: str) -> float:
    """Cores of a CPU quantity: "2", "0.5", "500m" (0.5), "1k" (as the apiserver may write
    1000); QuantityError otherwise."""
    match = _CPU.match(text.strip())
    if match is None:
        raise QuantityError(f"{text!r} is not a CPU quantity; write e.g. 2, 0.5 or 500m")
    scale = {"m": 0.001, "k": 1000.0}.get(match.group(2) or "", 1.0)
    return float(match.group(1)) * scale


def whole_cpus(text: str) -> int:
    """The whole CPUs of a CPU quantity, never below one: "1500m" is 1, "250m" is 1. What a
    thread count or a set of pinned CPUs can be."""
    return max(1, int(parse_cpu(text)))


GIB = 1024**3
GB = 1000**3


def format_bytes(num_bytes: int) -> str:
    """'1,207,959,552 B (1.208 GB, 1.125 GiB)': both units, since vendors and tools differ."""
    return f"{num_bytes:,} B ({num_bytes / GB:.3f} GB, {num_bytes / GIB:.3f} GiB)"
