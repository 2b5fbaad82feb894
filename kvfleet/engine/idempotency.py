"""Idempotency keys: a retried request gets the original request's result or live stream.

A key is scoped by tenant (two tenants may pick the same key) and bound to a fingerprint of
the request body: the same key with a different body is a client bug, reported as a conflict
rather than answered with the wrong result. Entries live for `ttl_seconds` after their request
finishes and at most `capacity` entries are kept (least recently used dropped first), so the
cache cannot grow without bound.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


def fingerprint(body: object) -> str:
    """A stable digest of a JSON-able request body (key order does not matter)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(slots=True)
class _Entry(Generic[T]):
    fingerprint: str
    value: T
    finished_at: float | None = None


class IdempotencyConflict(Exception):
    """The key was used before with a different request body."""


class IdempotencyCache(Generic[T]):
    def __init__(self, capacity: int = 4096, ttl_seconds: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1 or ttl_seconds <= 0:
            raise ValueError(f"idempotency capacity must be >= 1 and ttl > 0, got "
                             f"{capacity}, {ttl_seconds}")
        self._capacity = capacity
        self._ttl = ttl_seconds
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], _Entry[T]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, tenant: str, key: str, body_fingerprint: str) -> T | None:
        """The value stored for (tenant, key); IdempotencyConflict if the body differs."""
        self._expire()
        entry = self._entries.get((tenant, key))
        if entry is None:
            return None
        if entry.fingerprint != body_fingerprint:
            raise IdempotencyConflict(key)
        self._entries.move_to_end((tenant, key))
        return entry.value

    def put(self, tenant: str, key: str, body_fingerprint: str, value: T) -> None:
        self._entries[(tenant, key)] = _Entry(body_fingerprint, value)
        self._entries.move_to_end((tenant, key))
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def discard(self, tenant: str, key: str) -> None:
        self._entries.pop((tenant, key), None)

    def mark_finished(self, tenant: str, key: str) -> None:
        """Start the entry's time to live (a running request's entry never expires)."""
        entry = self._entries.get((tenant, key))
        if entry is not None and entry.finished_at is None:
            entry.finished_at = self._clock()

    def _expire(self) -> None:
        now = self._clock()
        expired = [k for k, e in self._entries.items()
                   if e.finished_at is not None and now - e.finished_at > self._ttl]
        for k in expired:
            del self._entries[k]
