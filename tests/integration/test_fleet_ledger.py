"""The shared quota ledger on a real redis-server: it decides as the router's own ledger does
(the same random operations through both), its slot leases outlive no router, and while Redis
is away the declared fallback applies and says so."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_server import RedisServer, running_redis

from kvfleet.api.tenantquota import BorrowableResource, Borrowing, Limits, TenantQuotaSpec
from kvfleet.router.errors import QuotaExceeded
from kvfleet.router.fleet_ledger import LEASE_SECONDS, SPENT_SECONDS, SharedLedger
from kvfleet.router.quota import QuotaLedger, Reservation
from kvfleet.router.resp import Redis

ALL = list(BorrowableResource)[:4]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


QUOTAS = {
    "team-a": TenantQuotaSpec(
        tenant="team-a", limits=Limits(requests_per_minute=6, output_tokens_per_minute=300,
                                       max_concurrent_requests=2),
        borrowing=Borrowing(resources=ALL, max_percent=50)),
    "team-b": TenantQuotaSpec(
        tenant="team-b", limits=Limits(requests_per_minute=4, input_tokens_per_minute=200,
                                       output_tokens_per_minute=200, max_concurrent_requests=1)),
    "team-c": TenantQuotaSpec(
        tenant="team-c", limits=Limits(output_tokens_per_minute=120, max_concurrent_requests=3),
        borrowing=Borrowing(resources=[BorrowableResource.OUTPUT_TOKENS_PER_MINUTE,
                                       BorrowableResource.MAX_CONCURRENT_REQUESTS],
                            max_percent=100)),
    "team-d": TenantQuotaSpec(tenant="team-d", limits=Limits(requests_per_minute=6)),
}


def _ledger(now: float) -> QuotaLedger:
    ledger = QuotaLedger()
    ledger.set_quotas({t: (f"llm/{t}", spec) for t, spec in QUOTAS.items()}, now)
    return ledger


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _shared(url: str, clock: Clock, prefix: str | None = None) -> SharedLedger:
    client = Redis.from_url(url, timeout=0.5, connect_timeout=0.5)
    return SharedLedger(_ledger(clock.now), client, prefix or uuid.uuid4().hex,
                        where=url.removeprefix("redis://"), clock=clock)


@contextlib.asynccontextmanager
async def two_routers(url: str, clock: Clock) -> AsyncIterator[tuple[SharedLedger, SharedLedger,
                                                                    str]]:
    """Two routers' ledgers on the same keys (and that prefix), closed after."""
    prefix = uuid.uuid4().hex
    one, two = _shared(url, clock, prefix), _shared(url, clock, prefix)
    try:
        yield one, two, prefix
    finally:
        await one.client.aclose()
        await two.client.aclose()


async def _decide(admit: Any) -> tuple[str, Reservation | None]:
    """("admitted", its reservation) or (the limit that refused it, None)."""
    try:
        reservation = await admit if asyncio.iscoroutine(admit) else admit()
    except QuotaExceeded as exc:
        return exc.limit or "refused", None
    return "admitted", reservation


def _prechecked(ledger: QuotaLedger | SharedLedger, tenant: str, now: float) -> str:
    try:
        ledger.precheck(tenant, now)
    except QuotaExceeded as exc:
        return exc.limit
    return "admitted"


OPS = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.sampled_from(sorted(QUOTAS)), st.integers(0, 120),
              st.integers(1, 250), st.floats(0, 1.5)),
    st.tuples(st.just("settle"), st.integers(0, 20), st.integers(0, 250), st.integers(-20, 20),
              st.floats(0, 1.5))), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_the_shared_ledger_decides_as_the_routers_own_ledger(
    redis_server: RedisServer, ops: list[tuple[Any, ...]],
) -> None:
    """Admissions, refusals (and which limit), borrowing from which lender and the levels
    left, after every step of a random sequence, on one clock."""

    async def run() -> None:
        clock = Clock()
        reference, shared = _ledger(clock.now), _shared(redis_server.url, clock)
        open_: list[tuple[Reservation, Reservation]] = []
        try:
            for op in ops:
                clock.now += op[-1]
                if op[0] == "admit":
                    _, tenant, prompt, max_tokens, _ = op
                    args = (tenant, prompt, max_tokens, clock.now)
                    local, ours = await _decide(lambda: reference.admit(*args))  # noqa: B023
                    theirs, res = await _decide(shared.admit(*args))
                    assert shared.up
                    assert (local, op) == (theirs, op)
                    if ours is not None and res is not None:
                        assert ours.slot_lender == res.slot_lender
                        assert ours.borrowed.keys() == res.borrowed.keys()
                        open_.append((ours, res))
                elif open_:
                    _, index, generated, error, _ = op
                    ours, res = open_.pop(index % len(open_))
                    generated = min(generated, ours.output_reserved)
                    prompt = max(0, ours.input_tokens + error)
                    reference.settle(ours, generated, clock.now, prompt)
                    shared.settle(res, generated, clock.now, prompt)
                    await shared.drain()
                for tenant in QUOTAS:
                    want = reference.remaining(tenant, clock.now)
                    got = await shared.levels(tenant)
                    # (the reference rounds to 3 places)
                    assert got == pytest.approx(want, abs=1e-3), (tenant, op)
                    # The precheck (no Redis round trip) refuses only what the router's own
                    # ledger would refuse too: never a request that could be admitted.
                    if _prechecked(shared, tenant, clock.now) != "admitted":
                        assert _prechecked(reference, tenant, clock.now) != "admitted", \
                            (tenant, op)
        finally:
            await shared.client.aclose()

    asyncio.run(run())


def test_a_spent_tenant_is_refused_before_its_body_for_at_most_a_second(
    redis_server: RedisServer,
) -> None:
    """The router reads no body of a tenant Redis just refused with nothing left (a spent
    key's flood of 4 MiB bodies), and asks Redis again after SPENT_SECONDS."""
    async def run() -> None:
        clock = Clock()
        shared = _shared(redis_server.url, clock)
        try:
            for _ in range(6):  # team-d: 6 requests a minute
                await shared.admit("team-d", 1, 1, clock.now)
            shared.precheck("team-d", clock.now)  # (nothing refused yet: no memory)
            with pytest.raises(QuotaExceeded):
                await shared.admit("team-d", 1, 1, clock.now)
            with pytest.raises(QuotaExceeded, match="not enough for any request") as refused:
                shared.precheck("team-d", clock.now + 0.5)
            assert refused.value.limit == "requestsPerMinute"
            assert refused.value.retry_after == pytest.approx(0.5)
            shared.precheck("team-a", clock.now + 0.5)  # another tenant: untouched
            shared.precheck("team-d", clock.now + SPENT_SECONDS)  # Redis decides again
        finally:
            await shared.client.aclose()

    asyncio.run(run())


def test_a_slot_is_a_lease_a_dead_router_cannot_keep(redis_server: RedisServer) -> None:
    async def run() -> None:
        clock = Clock()
        async with two_routers(redis_server.url, clock) as (one, two, _):
            await one.admit("team-b", 1, 1, clock.now)  # team-b: 1 slot, fleet-wide
            with pytest.raises(QuotaExceeded, match="maxConcurrentRequests = 1 "):
                await two.admit("team-b", 1, 1, clock.now)
            clock.now += LEASE_SECONDS + 1  # router one died: its lease was never renewed
            await two.admit("team-b", 1, 1, clock.now)

    asyncio.run(run())


def test_a_running_request_keeps_its_slot_however_long_and_after_an_outage(
    redis_server: RedisServer,
) -> None:
    """Renewal extends the lease and the slot set's own expiry, and puts back a lease that ran
    out while Redis was away: a request that runs for minutes holds its slot throughout."""

    async def run() -> None:
        clock = Clock()
        async with two_routers(redis_server.url, clock) as (one, two, prefix):
            await one.admit("team-b", 1, 1, clock.now)  # team-b: 1 slot
            slots = f"{prefix}:s:team-b"
            await one.client.execute("EXPIRE", slots, 3)  # (the set's own expiry, near its end)
            clock.now += 10
            await one.renew()
            assert await one.client.execute("TTL", slots) >= 2 * LEASE_SECONDS - 1  # extended
            with pytest.raises(QuotaExceeded, match="maxConcurrentRequests"):
                await two.admit("team-b", 1, 1, clock.now)
            clock.now += LEASE_SECONDS + 1  # an outage outlived the lease...
            await one.renew()  # ...and the next renewal puts it back
            with pytest.raises(QuotaExceeded, match="maxConcurrentRequests"):
                await two.admit("team-b", 1, 1, clock.now)

    asyncio.run(run())


def test_with_redis_away_the_router_enforces_its_share_and_says_so(
    redis_server: RedisServer,
) -> None:
    async def run() -> None:
        clock = Clock()
        changes: list[bool] = []
        shared = _shared(redis_server.url, clock)
        shared._on_change = changes.append
        shared.local.set_replicas(2, clock.now)
        try:
            for _ in range(6):  # team-d: 6 requests a minute fleet-wide
                await shared.admit("team-d", 1, 1, clock.now)
            with pytest.raises(QuotaExceeded, match="requestsPerMinute = 6 of"):
                await shared.admit("team-d", 1, 1, clock.now)
            redis_server.stop()
            for _ in range(3):  # its 1/2 share, on this router's own buckets
                await shared.admit("team-d", 1, 1, clock.now)
            with pytest.raises(QuotaExceeded, match=r"= 3 \(this router's 1/2 share\)"):
                await shared.admit("team-d", 1, 1, clock.now)
            up, reason, message = shared.condition()
            assert (up, reason, changes) == (False, "SharedLedgerUnavailable", [False])
            assert "1/2 share" in message and "127.0.0.1" in message
            redis_server.start()  # an empty Redis: its buckets start full
            clock.now += 60
            await asyncio.sleep(0)
            # No request asks Redis while the breaker is open; the background PING (every
            # RETRY_SECONDS) closes it: then fleet-wide again.
            await shared.admit("team-d", 1, 1, clock.now)
            assert not shared.up and changes == [False]  # (admitted on the share)
            await shared.probe()
            await shared.admit("team-d", 1, 1, clock.now)
            assert shared.up and changes == [False, True]
        finally:
            await shared.client.aclose()

    asyncio.run(run())
