"""Requests held for a pool that scales to zero while it has no Ready replica.

A pool with `spec.autoscaling.minReplicas` 0 stays listed in /v1/models at zero replicas. A
request for it that finds no Ready replica of its revision waits here (after authentication
and quota: a held request holds its tenant's concurrency slot, so no tenant can hold more
than it could run) until the router's state shows one, then goes on as any other. The
routers' count of held requests is exported (`kvfleet_router_held_requests`) and is the
demand signal the operator's autoscaler wakes the pool on.

Bounded, never a 404: at most `per_pool` requests wait per pool and `per_tenant` per tenant
(one tenant cannot fill a pool's hold); one that finds the hold full, or whose wait (the
router's limit, or less if the client says so in `x-kvfleet-max-wait-seconds`) ends before a
replica is Ready, gets 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable

from kvfleet.router.errors import PoolWaking

WAIT_HEADER = "x-kvfleet-max-wait-seconds"
# A client told to come back: about when a replica that was not Ready in time may be.
RETRY_AFTER_SECONDS = 10.0

PoolKey = tuple[str, str]  # (namespace, pool)


class Holds:
    def __init__(self, per_pool: int = 64, per_tenant: int = 16, max_wait: float = 300.0,
                 on_count: Callable[[PoolKey, int], None] = lambda key, n: None) -> None:
        self.per_pool, self.per_tenant, self.max_wait = per_pool, per_tenant, max_wait
        self.on_count = on_count
        self._pools: Counter[PoolKey] = Counter()
        self._tenants: Counter[str] = Counter()
        self._changed: asyncio.Event | None = None

    def held(self, pool: PoolKey) -> int:
        return self._pools[pool]

    def notify(self) -> None:
        """The router's state changed: every waiter looks again."""
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def wait_for(self, asked: str | None) -> float:
        """How long a request may wait: the router's limit, or less if its client asks."""
        try:
            wanted = float(asked) if asked is not None else self.max_wait
        except ValueError:
            wanted = self.max_wait
        return max(0.0, min(self.max_wait, wanted))

    async def wait(self, pool: PoolKey, tenant: str, ready: Callable[[], bool],
                   seconds: float) -> float:
        """Return once `ready()` (re-checked at every state change), after how many seconds;
        PoolWaking when the hold is full or `seconds` pass first."""
        name = f"{pool[0]}/{pool[1]}"
        if self._pools[pool] >= self.per_pool:
            raise PoolWaking(f"pool {name} has no Ready replica yet and already holds "
                             f"{self.per_pool} requests while it wakes; retry later",
                             RETRY_AFTER_SECONDS)
        if self._tenants[tenant] >= self.per_tenant:
            raise PoolWaking(f"pool {name} has no Ready replica yet and tenant {tenant!r} "
                             f"already has {self.per_tenant} requests held; retry later",
                             RETRY_AFTER_SECONDS)
        self._count(pool, tenant, 1)
        started = time.monotonic()
        try:
            while not ready():
                left = started + seconds - time.monotonic()
                if left <= 0:
                    raise PoolWaking(f"pool {name} is waking from zero replicas and none was "
                                     f"Ready within {seconds:g} s; retry later",
                                     RETRY_AFTER_SECONDS)
                if self._changed is None:
                    self._changed = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)
            return time.monotonic() - started
        finally:
            self._count(pool, tenant, -1)

    def _count(self, pool: PoolKey, tenant: str, step: int) -> None:
        self._pools[pool] += step
        self._tenants[tenant] += step
        if self._pools[pool] <= 0:
            del self._pools[pool]
        if self._tenants[tenant] <= 0:
            del self._tenants[tenant]
        self.on_count(pool, self._pools[pool])
