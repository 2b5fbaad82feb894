"""The manifest hash of a ModelArtifact: sha256 over the canonical JSON of its spec.

Canonical JSON, version 1 (changing any rule below changes every hash, so it is versioned):

1. The spec is parsed with the v1alpha1 model, then dumped with camelCase keys, leaving out
   fields that are unset (null) or equal to their default. So spelling a default out and
   leaving it implicit hash the same, and adding a defaulted field in a later API version does
   not change existing hashes.
2. Object keys are sorted by Unicode code point; list order is kept (it is meaningful: files
   load in order, stop tokens are tried in order).
3. Numbers: a float with an integral value is written as an integer (1.0, 1, 1e0 → `1`);
   other floats use the shortest repr that round-trips (0.1 → `0.1`); NaN and ±Infinity are
   rejected. Booleans are `true`/`false`.
4. No insignificant whitespace (separators `,` and `:`), UTF-8, non-ASCII not escaped.

The **base hash** is the same hash over the spec without `adapters`: an adapter names the base
it was trained on by this hash, which cannot include the adapters themselves.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from kvfleet.api.modelartifact import ModelArtifactSpec

CANONICAL_JSON_VERSION = 1


def _normalize(value: Any, path: str) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: {value} is not a finite number")
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        return {str(k): _normalize(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normalize(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"{path}: {type(value).__name__} has no canonical JSON form")


def canonical_json(data: Any) -> bytes:
    """Canonical JSON bytes of plain data (dicts, lists, str, int, float, bool, None)."""
    text = json.dumps(
        _normalize(data, "$"),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return text.encode("utf-8")


def canonical_spec(spec: ModelArtifactSpec | dict[str, Any]) -> dict[str, Any]:
    """The spec as the plain data that is hashed (rule 1 above)."""
    model = spec if isinstance(spec, ModelArtifactSpec) else ModelArtifactSpec.model_validate(spec)
    dumped: dict[str, Any] = model.model_dump(
        mode="json", by_alias=True, exclude_none=True, exclude_defaults=True
    )
    return dumped


def manifest_hash(spec: ModelArtifactSpec | dict[str, Any]) -> str:
    """Lower-case hex sha256 of the canonical JSON of the spec."""
    return hashlib.sha256(canonical_json(canonical_spec(spec))).hexdigest()


def base_hash(spec: ModelArtifactSpec | dict[str, Any]) -> str:
    """Manifest hash of the spec without its adapters: what adapters must name as their base."""
    data = canonical_spec(spec)
    data.pop("adapters", None)
    return hashlib.sha256(canonical_json(data)).hexdigest()
