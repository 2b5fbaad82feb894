"""Drift: does an observed object still carry everything the operator wants in it?

The apiserver adds defaults and metadata the operator never sets (uid, managedFields,
`protocol`, probe timeouts, …), so equality is the wrong test. An object has drifted when a
field the operator sets is missing or different: `desired` must be a subset of `observed`,
recursively, with lists compared element by element (their order is meaningful: args, env).
"""

from __future__ import annotations

from typing import Any


def first_difference(desired: Any, observed: Any, path: str = "") -> str | None:
    """The path of the first field where `observed` departs from `desired`, or None."""
    if isinstance(desired, dict):
        if not isinstance(observed, dict):
            return path or "."
        for key, value in desired.items():
            if key not in observed:
                return f"{path}.{key}"
            found = first_difference(value, observed[key], f"{path}.{key}")
            if found is not None:
                return found
        return None
    if isinstance(desired, list):
        if not isinstance(observed, list) or len(desired) != len(observed):
            return path
        for index, (want, have) in enumerate(zip(desired, observed, strict=True)):
            found = first_difference(want, have, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    return None if desired == observed else path


def has_drifted(desired: dict[str, Any], observed: dict[str, Any]) -> str | None:
    """Where an owned object drifted (metadata: only labels, annotations, owners count)."""
    meta = desired.get("metadata", {})
    owned_meta = {k: meta[k] for k in ("labels", "annotations", "ownerReferences") if k in meta}
    found = first_difference(owned_meta, observed.get("metadata", {}), "metadata")
    if found is not None:
        return found
    body = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "metadata")}
    return first_difference(body, observed)
