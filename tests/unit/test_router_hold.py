"""Requests held for a pool at zero: bounded per pool and per tenant, released on a state
change that makes a replica Ready, refused with Retry-After when the wait runs out."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.router.errors import PoolWaking
from kvfleet.router.hold import Holds

POOL = ("llm", "chat")


def test_held_requests_go_on_when_a_replica_is_ready_and_the_count_is_exported() -> None:
    counts: list[int] = []
    holds = Holds(per_pool=4, per_tenant=2, max_wait=5,
                  on_count=lambda pool, n: counts.append(n))
    ready = False

    async def scenario() -> list[float]:
        nonlocal ready
        waits = [asyncio.create_task(holds.wait(POOL, t, lambda: ready, 5)) for t in "ab"]
        await asyncio.sleep(0.05)
        assert holds.held(POOL) == 2
        holds.notify()  # a change that is not the replica: they wait on
        await asyncio.sleep(0.05)
        assert not any(w.done() for w in waits)
        ready = True
        holds.notify()
        return list(await asyncio.gather(*waits))

    waited = asyncio.run(scenario())
    assert all(0.05 <= w < 1 for w in waited)
    assert counts == [1, 2, 1, 0] and holds.held(POOL) == 0


def test_the_hold_is_bounded_per_tenant_and_per_pool_and_in_time() -> None:
    holds = Holds(per_pool=3, per_tenant=2, max_wait=0.2)

    async def scenario() -> list[str]:
        tasks = [asyncio.create_task(holds.wait(POOL, t, lambda: False, 0.2))
                 for t in ("a", "a", "a", "b", "c")]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return [str(r) for r in results]

    refused = asyncio.run(scenario())
    assert "tenant 'a' already has 2 requests held" in refused[2]
    assert "already holds 3 requests" in refused[4]
    assert all("none was Ready within 0.2 s" in r for r in refused[:2] + refused[3:4]), refused
    assert holds.held(POOL) == 0


def test_a_client_may_wait_less_never_more() -> None:
    holds = Holds(max_wait=60)
    assert (holds.wait_for(None), holds.wait_for("5"), holds.wait_for("600"),
            holds.wait_for("soon"), holds.wait_for("-3")) == (60, 5, 60, 60, 0)
    with pytest.raises(PoolWaking) as refused:
        asyncio.run(holds.wait(POOL, "a", lambda: False, 0))
    assert refused.value.headers() == {"retry-after": "10"}
