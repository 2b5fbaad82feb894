"""Idempotency keys: a retried request gets the original request's result or live stream.

A key is scoped by tenant (two tenants may pick the same key) and bound to a fingerprint of
the request body: the same key with a different body is a client bug, reported as a conflict
rather than answered with the wrong result. Entries live for `ttl_seconds` after their request
finishes. Finished entries are also bounded by count (`capacity`) and by bytes (`max_bytes`,
each entry weighed by `size` when it finishes: a whole stream is an event per token), the least
recently used dropped first. An entry whose request is still running is never dropped: a retry
would then start a second generation of the same request. Running entries are bounded by the
engine's admission limits instead.
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
    size: int = 0  # bytes, weighed when the request finished


class IdempotencyConflict(Exception):
    """The key was used before with a different request body."""


class IdempotencyCache(Generic[T]):
    def __init__(self, capacity: int = 4096, ttl_seconds: float = 600.0,
                 clock: Callable[[], float] = time.monotonic, *,
                 max_bytes: int = 64 << 20, size: Callable[[T], int] = lambda _: 0) -> None:
        if capacity < 1 or ttl_seconds <= 0 or max_bytes < 0:
            raise ValueError(f"idempotency capacity must be >= 1, ttl > 0 and max_bytes >= 0, "
                             f"got {capacity}, {ttl_seconds}, {max_bytes}")
        self._capacity = capacity
        self._ttl = ttl_seconds
        self._clock = clock
        self._max_bytes = max_bytes
        self._size = size
        self._bytes = 0  # of the finished entries
        self._entries: OrderedDict[tuple[str, str], _Entry[T]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def finished_bytes(self) -> int:
        return self._bytes

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
        self.discard(tenant, key)
        self._entries[(tenant, key)] = _Entry(body_fingerprint, value)
        self._evict()

    def discard(self, tenant: str, key: str) -> None:
        entry = self._entries.pop((tenant, key), None)
        if entry is not None and entry.finished_at is not None:
            self._bytes -= entry.size

    def mark_finished(self, tenant: str, key: str) -> None:
        """Start the entry's time to live and weigh it (a running request's entry never
        expires and is never evicted)."""
        entry = self._entries.get((tenant, key))
        if entry is not None and entry.finished_at is None:
            entry.finished_at = self._clock()
            entry.size = self._size(entry.value)
            self._bytes += entry.size
            self._evict()

    def _evict(self) -> None:
        """Least recently used finished entries out until both bounds hold (or none is left:
        running entries stay)."""
        if len(self._entries) <= self._capacity and self._bytes <= self._max_bytes:
            return
        for k in [k for k, e in self._entries.items() if e.finished_at is not None]:
            if len(self._entries) <= self._capacity and self._bytes <= self._max_bytes:
                break
            self.discard(*k)

    def _expire(self) -> None:
        now = self._clock()
        expired = [k for k, e in self._entries.items()
                   if e.finished_at is not None and now - e.finished_at > self._ttl]
        for k in expired:
            self.discard(*k)
