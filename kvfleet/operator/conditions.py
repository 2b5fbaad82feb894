"""Standard conditions (metav1.Condition) on wire-format status dicts.

`set_condition` keeps `lastTransitionTime` when the status did not change, so a level-based
reconcile that recomputes every condition each time does not make them flap in `kubectl get`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Cond:
    """One condition as a reconciler decides it (the time is filled in by `merge_conditions`)."""

    type: str
    status: bool | None  # None = Unknown
    reason: str
    message: str = ""

    @property
    def status_text(self) -> str:
        return "Unknown" if self.status is None else ("True" if self.status else "False")


def rfc3339(now: datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_conditions(
    previous: list[dict[str, Any]], decided: list[Cond], generation: int | None, now: datetime
) -> list[dict[str, Any]]:
    """The new conditions list: decided ones in order, then untouched previous ones."""
    by_type = {c.get("type"): c for c in previous}
    merged: list[dict[str, Any]] = []
    for cond in decided:
        old = by_type.pop(cond.type, None)
        changed = old is None or old.get("status") != cond.status_text
        entry: dict[str, Any] = {
            "type": cond.type,
            "status": cond.status_text,
            "reason": cond.reason,
            "message": cond.message[:32768],
            "lastTransitionTime": rfc3339(now)
            if changed or old is None
            else old.get("lastTransitionTime", rfc3339(now)),
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        merged.append(entry)
    merged.extend(by_type.values())
    return merged


def find(conditions: list[dict[str, Any]], cond_type: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == cond_type), None)


def is_true(conditions: list[dict[str, Any]], cond_type: str) -> bool:
    found = find(conditions, cond_type)
    return found is not None and found.get("status") == "True"
