"""A Kubernetes Event a reconciler decides to post (the runtime posts it on the object)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str
