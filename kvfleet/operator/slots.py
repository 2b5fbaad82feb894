"""Reconcile slots with a fast lane.

Like controller-runtime's MaxConcurrentReconciles, at most `n` reconciles run at once and the
rest wait. A burst of bulk work (a thousand pools created at once) then queues for a minute
or more; a reconcile that carries out a decision already taken (the autoscaler's new count,
a Rollout's next step or rollback) must not wait behind it. Those take the urgent lane: the
next free slot goes to the oldest urgent waiter, and only then to the oldest bulk one. Within
a lane the order is first come, first served, so neither lane's waiters starve each other
for long: urgent work is rare and short. A bulk waiter that becomes urgent while it waits (its
pool got a decision) is promoted: the decision does not wait behind the burst because an
ordinary reconcile of the same pool was already queued.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable


class Slots:
    def __init__(self, n: int) -> None:
        self._free = n
        self._lanes: dict[bool, deque[asyncio.Future[None]]] = {True: deque(), False: deque()}
        self._tagged: dict[Hashable, asyncio.Future[None]] = {}  # bulk waiters, by tag

    def waiting(self, urgent: bool) -> int:
        """Live waiters in a lane (a scan: for tests and diagnostics, not the hot path)."""
        return sum(not f.done() for f in self._lanes[urgent])

    async def acquire(self, urgent: bool = False, tag: Hashable | None = None) -> bool:
        """Wait for a slot; a bulk waiter with a `tag` can be promoted by it. Whether the slot
        came by the urgent lane."""
        # (A free slot means no one waits: `release` hands a slot to a waiter before it
        # counts one free. So no lane needs scanning here, whatever the burst's length.)
        if self._free > 0:
            self._free -= 1
            return urgent
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._lanes[urgent].append(slot)
        if not urgent and tag is not None:
            self._tagged[tag] = slot
        try:
            await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():
                self.release()  # handed a slot as it was cancelled: pass it on
            raise
        finally:
            promoted = tag is not None and not urgent and self._tagged.get(tag) is not slot
            if tag is not None and self._tagged.get(tag) is slot:
                del self._tagged[tag]
        return urgent or promoted

    def promote(self, tag: Hashable) -> None:
        """The bulk waiter of `tag`, if any, into the urgent lane (it leaves the bulk one:
        a done future there is skipped)."""
        slot = self._tagged.pop(tag, None)
        if slot is not None and not slot.done():
            self._lanes[True].append(slot)

    def release(self) -> None:
        for urgent in (True, False):
            lane = self._lanes[urgent]
            while lane:
                slot = lane.popleft()
                if not slot.done():
                    slot.set_result(None)
                    return
        self._free += 1
