"""The router's state from the API server: pools, engine pods, keys, quotas, its own replicas.

Informers (list + watch, see `kvfleet.kube.informer`) keep ServingPools, Ready engine pods,
Secrets labelled `kvfleet.io/tenant` (API keys) and `kvfleet.io/router-token-for` (each pool's
engine token, made by the operator), TenantQuotas, and the router's own pods. Any change
rebuilds the whole `RouterState` (`state_from_objects`, pure) within `DEBOUNCE_SECONDS`, so a
traffic-table edit by the Rollout controller reaches requests well within a second.

Each TenantQuota's `status.usage` and `Ready` condition are written back every
`STATUS_INTERVAL_SECONDS` when they changed (never once per request).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from kvfleet.api.labels import (
    ENGINE_COMPONENT,
    ENGINE_PORT,
    POOL_LABEL,
    REVISION_LABEL,
    ROUTER_APP,
    ROUTER_TOKEN_KEY,
    ROUTER_TOKEN_LABEL,
    TENANT_LABEL,
    label_value,
)
from kvfleet.api.servingpool import ServingPoolStatus
from kvfleet.api.tenantquota import TenantQuotaSpec
from kvfleet.kube.api import JsonObj, KubeApi, KubeError
from kvfleet.kube.informer import Informer
from kvfleet.router.keys import KeyRing
from kvfleet.router.picker import EndpointLoad
from kvfleet.router.quota import QuotaLedger
from kvfleet.router.state import PoolRoute, RouterState
from kvfleet.router.traffic import TrafficTable

log = logging.getLogger("kvfleet.router")

ENGINE_SELECTOR = f"app.kubernetes.io/component={ENGINE_COMPONENT},{POOL_LABEL}"
ROUTER_SELECTOR = f"app.kubernetes.io/name={ROUTER_APP}"
DEBOUNCE_SECONDS = 0.05
STATUS_INTERVAL_SECONDS = 10.0


def _ready(pod: Mapping[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    return bool(status.get("podIP")) and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or [])


def _port(pod: Mapping[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return int(port["containerPort"])
    return ENGINE_PORT


def _secret_text(secret: Mapping[str, Any], field: str) -> str | None:
    encoded = (secret.get("data") or {}).get(field)
    if not encoded:
        return None
    try:
        return base64.b64decode(encoded, validate=True).decode().strip()
    except (binascii.Error, UnicodeDecodeError):
        return None


def _where(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def state_from_objects(pools: Iterable[JsonObj], pods: Iterable[JsonObj],
                       key_secrets: Iterable[JsonObj], token_secrets: Iterable[JsonObj],
                       quotas: Iterable[JsonObj], *, cluster_wide: bool) -> RouterState:
    """Clients name a pool by its name; a cluster-wide router also by `namespace/name`, and by
    its bare name only where that is unique."""
    tokens = {(_where(s)[0], (s["metadata"].get("labels") or {}).get(ROUTER_TOKEN_LABEL)):
              _secret_text(s, ROUTER_TOKEN_KEY) for s in token_secrets}
    endpoints: dict[tuple[str, str], dict[str, list[EndpointLoad]]] = {}
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if not _ready(pod) or not labels.get(REVISION_LABEL):
            continue
        key = (_where(pod)[0], str(labels.get(POOL_LABEL)))
        address = f"{pod['status']['podIP']}:{_port(pod)}"
        endpoints.setdefault(key, {}).setdefault(labels[REVISION_LABEL], []).append(
            EndpointLoad(address))
    state = RouterState()
    names: dict[str, list[str]] = {}
    for raw in pools:
        namespace, name = _where(raw)
        try:
            status = ServingPoolStatus.model_validate(raw.get("status") or {})
        except ValidationError as exc:
            log.warning("ServingPool %s/%s: status not understood (%s); not routed", namespace,
                        name, exc.errors()[0]["msg"])
            continue
        route = PoolRoute(name, TrafficTable.from_status(status),
                          endpoints.get((namespace, label_value(name)), {}),
                          tokens.get((namespace, label_value(name))))
        if cluster_wide:
            state.pools[f"{namespace}/{name}"] = route
            names.setdefault(name, []).append(f"{namespace}/{name}")
        else:
            state.pools[name] = route
    for name, qualified in names.items():
        if len(qualified) == 1:
            state.pools[name] = state.pools[qualified[0]]
    state.keys = KeyRing.from_secrets(key_secrets)
    for raw in sorted(quotas, key=lambda q: str(q["metadata"].get("creationTimestamp", ""))):
        namespace, name = _where(raw)
        try:
            spec = TenantQuotaSpec.model_validate(raw.get("spec") or {})
        except ValidationError as exc:
            log.warning("TenantQuota %s/%s: spec not understood (%s); not enforced", namespace,
                        name, exc.errors()[0]["msg"])
            continue
        if spec.tenant in state.quotas:
            log.warning("TenantQuota %s/%s: tenant %r already has TenantQuota %s (the older "
                        "one is enforced)", namespace, name, spec.tenant,
                        state.quotas[spec.tenant][0])
            continue
        state.quotas[spec.tenant] = (f"{namespace}/{name}", spec)
    return state


def usage_status(ledger: QuotaLedger, tenant: str, previous: tuple[int, int] | None,
                 elapsed: float, generation: int | None) -> dict[str, Any] | None:
    usage = ledger.usage(tenant)
    if usage is None:
        return None
    requests, tokens, in_flight = usage
    before = previous or (0, 0)  # the first report: everything since the router started
    per_minute = 60.0 / max(elapsed, 1e-9)
    return {
        "usage": {"requestsPerMinute": round((requests - before[0]) * per_minute),
                  "tokensPerMinute": round((tokens - before[1]) * per_minute),
                  "concurrentRequests": in_flight},
        "observedGeneration": generation,
    }


class ClusterSource:
    """Keeps a router's state in step with the cluster (one namespace, or all with None)."""

    def __init__(self, api: KubeApi, router: Any, namespace: str | None) -> None:
        self.api, self.router, self.namespace = api, router, namespace
        self._dirty = asyncio.Event()
        self.informers = {
            "pools": Informer(api, "ServingPool", "", self._changed, namespace=namespace),
            "pods": Informer(api, "Pod", ENGINE_SELECTOR, self._changed, namespace=namespace),
            "keys": Informer(api, "Secret", TENANT_LABEL, self._changed, namespace=namespace),
            "tokens": Informer(api, "Secret", ROUTER_TOKEN_LABEL, self._changed,
                               namespace=namespace),
            "quotas": Informer(api, "TenantQuota", "", self._changed, namespace=namespace),
            "routers": Informer(api, "Pod", ROUTER_SELECTOR, self._changed,
                                namespace=namespace),
        }
        self._reported: dict[str, tuple[int, int]] = {}  # TenantQuota -> (requests, tokens)

    def _changed(self, _: str | None, __: JsonObj) -> None:
        self._dirty.set()

    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self.informers.values())

    def _objects(self, name: str) -> list[JsonObj]:
        return [o for objs in self.informers[name].store.values() for o in objs]

    def rebuild(self) -> None:
        state = state_from_objects(
            self._objects("pools"), self._objects("pods"), self._objects("keys"),
            self._objects("tokens"), self._objects("quotas"),
            cluster_wide=self.namespace is None)
        self.router.update(state)
        routers = sum(1 for pod in self._objects("routers") if _ready(pod))
        self.router.ledger.set_replicas(max(1, routers), time.monotonic())

    async def run(self) -> None:
        tasks = [asyncio.create_task(i.run()) for i in self.informers.values()]
        tasks.append(asyncio.create_task(self._write_statuses()))
        try:
            while True:
                await self._dirty.wait()
                await asyncio.sleep(DEBOUNCE_SECONDS)
                self._dirty.clear()
                if self.synced():
                    self.rebuild()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _write_statuses(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(STATUS_INTERVAL_SECONDS)
            now = time.monotonic()
            for raw in self._objects("quotas"):
                await self._write_status(raw, now - last)
            last = now

    async def _write_status(self, raw: JsonObj, elapsed: float) -> None:
        """One TenantQuota's usage and Ready condition, written only when they differ from
        what the object (as last watched) already says."""
        namespace, name = _where(raw)
        key = f"{namespace}/{name}"
        tenant = (raw.get("spec") or {}).get("tenant")
        if not isinstance(tenant, str) or (usage := self.router.ledger.usage(tenant)) is None:
            return
        status = usage_status(self.router.ledger, tenant, self._reported.get(key), elapsed,
                              raw["metadata"].get("generation"))
        self._reported[key] = (usage[0], usage[1])
        if status is None:
            return
        enforced = self.router.state.quotas.get(tenant, ("", None))[0] == key
        current = raw.get("status") or {}
        before: dict[str, Any] = next(
            (c for c in current.get("conditions") or [] if c.get("type") == "Ready"), {})
        ready = "True" if enforced else "False"
        status["conditions"] = [{
            "type": "Ready", "status": ready,
            "reason": "Enforced" if enforced else "Superseded",
            "message": "enforced by the kvfleet router" if enforced else
            "another TenantQuota for the same tenant is enforced",
            "observedGeneration": raw["metadata"].get("generation"),
            # Changes only when the condition's status does.
            "lastTransitionTime": before.get("lastTransitionTime")
            if before.get("status") == ready else
            datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}]
        if all(current.get(k) == v for k, v in status.items()):
            return
        try:
            await self.api.patch_status("TenantQuota", namespace, name, status)
        except KubeError as exc:
            log.warning("TenantQuota %s: status not written (%s)", key, exc)
