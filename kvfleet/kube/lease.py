"""Leader election on a coordination.k8s.io Lease: operator replicas run one at a time.

The protocol is client-go's. The holder renews `renewTime` every `renew_seconds`. A candidate
takes the Lease when nobody holds it or the holder's `renewTime + leaseDurationSeconds` has
passed, by a write that carries the resourceVersion it read, so of two candidates the apiserver
lets one win and refuses the other (409). A leader that has not renewed within its lease
duration may already have been replaced: it must stop at once (`on_lost`), as
controller-runtime's managers exit, rather than reconcile beside the new leader. On a clean
shut-down the leader releases the Lease, so a standby takes over without waiting it out.

    elector = LeaderElector(api, "kvfleet-system", "kvfleet-operator", identity="pod-a")
    await elector.acquire()          # returns once this process leads
    await elector.hold(on_lost)      # renews until cancelled; on_lost() when it cannot
    await elector.release()
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from kvfleet.kube.api import JsonObj, KubeApi, KubeError, path_of

log = logging.getLogger(__name__)


def _micro(when: datetime) -> str:
    """MicroTime, as Lease fields carry it."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@dataclass(frozen=True)
class LeaseView:
    """What a candidate needs of a Lease's spec."""

    holder: str | None
    renewed: datetime | None
    duration: timedelta
    transitions: int

    @classmethod
    def of(cls, spec: dict[str, Any]) -> LeaseView:
        return cls(holder=spec.get("holderIdentity") or None,
                   renewed=_parse(spec.get("renewTime") or spec.get("acquireTime")),
                   duration=timedelta(seconds=int(spec.get("leaseDurationSeconds") or 0)),
                   transitions=int(spec.get("leaseTransitions") or 0))

    def free_for(self, identity: str, now: datetime) -> bool:
        """May `identity` write itself in as holder now?"""
        if self.holder is None or self.holder == identity:
            return True
        return self.renewed is None or self.renewed + self.duration < now


def claimed(spec: dict[str, Any], identity: str, now: datetime,
            duration_seconds: int) -> dict[str, Any]:
    """The spec with `identity` holding the Lease as of `now` (a renewal keeps acquireTime)."""
    view = LeaseView.of(spec)
    new_holder = view.holder != identity
    return {
        **spec,
        "holderIdentity": identity,
        "leaseDurationSeconds": duration_seconds,
        "acquireTime": _micro(now) if new_holder else spec.get("acquireTime", _micro(now)),
        "renewTime": _micro(now),
        "leaseTransitions": view.transitions + (1 if new_holder and view.holder else 0),
    }


class LeaderElector:
    def __init__(self, api: KubeApi, namespace: str, name: str, identity: str, *,
                 duration_seconds: int = 15, renew_seconds: float = 5,
                 retry_seconds: float = 2, clock: Callable[[], datetime] | None = None) -> None:
        if not 0 < renew_seconds < duration_seconds:
            raise ValueError(f"renew every {renew_seconds}s must be shorter than the "
                             f"{duration_seconds}s lease")
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.duration_seconds, self.renew_seconds = duration_seconds, renew_seconds
        self.retry_seconds = retry_seconds
        self.clock = clock or (lambda: datetime.now(UTC))
        self.where = f"Lease {namespace}/{name}"
        self.holder: str | None = None  # who held the Lease at the last attempt

    async def try_acquire(self) -> bool:
        """One attempt to hold (or renew) the Lease; False when another holds it or won."""
        now = self.clock()
        lease = await self.api.get("Lease", self.namespace, self.name)
        self.holder = ((lease or {}).get("spec") or {}).get("holderIdentity")
        try:
            if lease is None:
                await self.api.create({
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": claimed({}, self.identity, now, self.duration_seconds)})
                return True
            spec = lease.get("spec") or {}
            if not LeaseView.of(spec).free_for(self.identity, now):
                return False
            await self._replace(lease, claimed(spec, self.identity, now,
                                               self.duration_seconds))
            return True
        except KubeError as exc:
            if exc.status in (409, 422):  # another candidate wrote first
                return False
            raise

    async def _replace(self, lease: JsonObj, spec: dict[str, Any]) -> None:
        body = {**lease, "spec": spec}  # metadata keeps the resourceVersion read
        await self.api.replace(path_of("Lease", self.namespace, self.name), body)

    async def acquire(self) -> None:
        waiting_on: str | None = None
        while True:
            try:
                if await self.try_acquire():
                    log.info("%s: %s leads", self.where, self.identity)
                    return
                if self.holder != waiting_on:
                    log.info("%s: held by %s; %s stands by", self.where, self.holder,
                             self.identity)
                    waiting_on = self.holder
            except (KubeError, OSError) as exc:
                log.warning("%s: cannot read or write it (%s); retrying", self.where, exc)
            await asyncio.sleep(self.retry_seconds)

    async def hold(self, on_lost: Callable[[str], None]) -> None:
        """Renew until cancelled; `on_lost(reason)` once leadership cannot be vouched for."""
        last = self.clock()
        while True:
            await asyncio.sleep(self.renew_seconds)
            try:
                if await self.try_acquire():
                    last = self.clock()
                    continue
                on_lost(f"{self.where} was taken over by another candidate")
                return
            except (KubeError, OSError) as exc:
                log.warning("%s: renewal failed (%s)", self.where, exc)
            if self.clock() - last >= timedelta(seconds=self.duration_seconds):
                on_lost(f"{self.where} not renewed for {self.duration_seconds}s")
                return

    async def release(self) -> None:
        """Give the Lease up (best effort), so a standby need not wait for it to expire."""
        try:
            lease = await self.api.get("Lease", self.namespace, self.name)
            spec = (lease or {}).get("spec") or {}
            if lease is not None and spec.get("holderIdentity") == self.identity:
                await self._replace(lease, {**spec, "holderIdentity": None,
                                            "leaseDurationSeconds": 1})
                log.info("%s: released by %s", self.where, self.identity)
        except (KubeError, OSError) as exc:
            log.warning("%s: not released (%s); it expires in %ss", self.where, exc,
                        self.duration_seconds)
