"""Per-key coalescing of reconciles.

Many triggers for one pool (its own create, four child objects appearing, Deployment status
updates, the drift loop) must not become many concurrent or queued reconciles: at most one
runs per key, and every trigger that arrives while one runs is served by a single follow-up run
that starts after it — which is what a level-based reconcile needs to see the latest state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


def _retrieve(future: asyncio.Future[None]) -> None:
    # Mark the outcome as seen: a follow-up nobody joined must not log "never retrieved".
    if not future.cancelled():
        future.exception()


class Coalescer(Generic[K]):
    """At most one run per key; a key's bookkeeping lives only while a trigger for it is in
    flight, so a deleted object leaves nothing behind (no per-object entry outlives its
    last reconcile)."""

    def __init__(self, run: Callable[[K], Awaitable[None]]) -> None:
        self._run = run
        self._locks: dict[K, asyncio.Lock] = {}
        self._users: dict[K, int] = {}  # triggers holding or awaiting the key's lock
        self._waiting: dict[K, asyncio.Future[None]] = {}

    @property
    def num_keys(self) -> int:
        """Keys with a trigger in flight."""
        return len(self._locks)

    def pending(self, key: K) -> bool:
        """A run of `key` is triggered and has not started: a trigger now would only join it,
        and that run reads the state of when it starts, so a caller that needs no result
        (a watch event) has nothing to add."""
        return key in self._waiting

    async def trigger(self, key: K) -> None:
        """Return once a run that started after this call has finished (raise if it failed)."""
        waiting = self._waiting.get(key)
        if waiting is not None:
            await asyncio.shield(waiting)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
        self._waiting[key] = future
        lock = self._locks.setdefault(key, asyncio.Lock())
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with lock:
                # From here on, new triggers need a new run: this one may already have read
                # state.
                del self._waiting[key]
                try:
                    await self._run(key)
                except asyncio.CancelledError:
                    future.cancel()
                    raise
                except Exception as exc:
                    future.set_exception(exc)
                    raise
                future.set_result(None)
        finally:
            if self._waiting.get(key) is future:
                # Cancelled while waiting for the lock: the next trigger must start a run of
                # its own, not join one that will never happen.
                del self._waiting[key]
                future.cancel()
            self._users[key] -= 1
            if self._users[key] == 0:
                del self._users[key], self._locks[key]
