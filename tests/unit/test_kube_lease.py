"""Leader election on a Lease (kvfleet.kube.lease) against a fake apiserver that, like the
real one, refuses a write carrying a stale resourceVersion. The real part: the operator
failover test in e2e/test_operator_e2e.py."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kvfleet.kube.api import KubeError
from kvfleet.kube.lease import LeaderElector, LeaseView, claimed

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


class FakeLeases:
    """One namespace's Leases; `down` makes every request fail as an unreachable apiserver."""

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise OSError("connection refused")

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self._check()
        found = self.leases.get(name)
        return copy.deepcopy(found) if found else None

    async def create(self, obj: dict[str, Any]) -> None:
        self._check()
        name = obj["metadata"]["name"]
        if name in self.leases:
            raise KubeError("POST", "leases", 409, "already exists")
        self.version += 1
        self.leases[name] = {**copy.deepcopy(obj), "metadata": {
            **obj["metadata"], "resourceVersion": str(self.version)}}

    async def replace(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        self._check()
        name = path.rsplit("/", 1)[1]
        current = self.leases[name]
        if obj["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"]:
            raise KubeError("PUT", path, 409, "the object has been modified")
        self.version += 1
        self.leases[name] = {**copy.deepcopy(obj), "metadata": {
            **obj["metadata"], "resourceVersion": str(self.version)}}
        return copy.deepcopy(self.leases[name])


def _elector(api: FakeLeases, who: str, clock: Clock) -> LeaderElector:
    return LeaderElector(api, "ops", "kvfleet-operator", who,  # type: ignore[arg-type]
                         duration_seconds=15, renew_seconds=0.01, retry_seconds=0.01,
                         clock=clock)


def test_a_lease_is_free_when_unheld_mine_or_expired() -> None:
    held = claimed({}, "a", T0, 15)
    view = LeaseView.of(held)
    assert view.holder == "a" and view.transitions == 0
    assert view.free_for("a", T0) and not view.free_for("b", T0 + timedelta(seconds=15))
    assert view.free_for("b", T0 + timedelta(seconds=16))
    assert LeaseView.of({**held, "holderIdentity": None}).free_for("b", T0)
    taken = LeaseView.of(claimed(held, "b", T0 + timedelta(seconds=16), 15))
    assert (taken.holder, taken.transitions) == ("b", 1)
    renewed = claimed(held, "a", T0 + timedelta(seconds=5), 15)
    assert renewed["acquireTime"] == held["acquireTime"] != renewed["renewTime"]


@pytest.mark.asyncio
async def test_of_two_candidates_one_leads_until_its_lease_expires() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = _elector(api, "a", clock), _elector(api, "b", clock)
    assert await a.try_acquire() is True
    assert await b.try_acquire() is False
    assert await a.try_acquire() is True  # a renewal
    clock.now += timedelta(seconds=16)  # a stopped renewing
    assert await b.try_acquire() is True
    assert api.leases["kvfleet-operator"]["spec"]["holderIdentity"] == "b"
    assert api.leases["kvfleet-operator"]["spec"]["leaseTransitions"] == 1


@pytest.mark.asyncio
async def test_a_candidate_that_read_a_stale_lease_loses_the_race() -> None:
    api, clock = FakeLeases(), Clock()
    await _elector(api, "a", clock).try_acquire()
    clock.now += timedelta(seconds=16)
    stale = await api.get("Lease", "ops", "kvfleet-operator")
    assert await _elector(api, "b", clock).try_acquire() is True
    real_get = api.get

    async def get_stale(*_: Any) -> dict[str, Any] | None:
        return copy.deepcopy(stale)

    api.get = get_stale  # type: ignore[method-assign]
    assert await _elector(api, "c", clock).try_acquire() is False  # 409: b wrote first
    api.get = real_get  # type: ignore[method-assign]
    assert api.leases["kvfleet-operator"]["spec"]["holderIdentity"] == "b"


@pytest.mark.asyncio
async def test_a_leader_that_cannot_renew_for_its_lease_duration_gives_up() -> None:
    api, clock = FakeLeases(), Clock()
    leader = _elector(api, "a", clock)
    await leader.acquire()
    lost: list[str] = []
    holding = asyncio.create_task(leader.hold(lost.append))
    await asyncio.sleep(0.05)
    assert not lost and not holding.done()
    api.down = True
    await asyncio.sleep(0.05)
    assert not lost  # failed renewals, but still within the lease
    clock.now += timedelta(seconds=15)
    await asyncio.wait_for(holding, 1)
    assert lost == ["Lease ops/kvfleet-operator not renewed for 15s"]


@pytest.mark.asyncio
async def test_a_released_lease_is_taken_at_once() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = _elector(api, "a", clock), _elector(api, "b", clock)
    await a.acquire()
    await a.release()
    assert await b.try_acquire() is True


def test_renewing_must_be_more_frequent_than_the_lease_lasts() -> None:
    with pytest.raises(ValueError, match="shorter than the 15s lease"):
        LeaderElector(FakeLeases(), "ops", "l", "a", duration_seconds=15,  # type: ignore[arg-type]
                      renew_seconds=15)
