"""The router's state from the API server: pools, engine pods, keys, quotas, its own replicas.

Informers (list + watch, see `kvfleet.kube.informer`) keep ServingPools, Ready engine pods,
Secrets labelled `kvfleet.io/tenant` (API keys) and `kvfleet.io/router-token-for` (each pool's
engine token, made by the operator), TenantQuotas, and the router's own pods. Any change
rebuilds the whole `RouterState` (`state_from_objects`, pure) within `DEBOUNCE_SECONDS`, so a
traffic-table edit by the Rollout controller reaches requests well within a second.

Each TenantQuota's `status` gets this router's report under `routers.<its pod name>` (usage
and what its buckets have left), the fleet's `usage` (the sum over the live routers) and the
`Ready` condition, every `STATUS_INTERVAL_SECONDS` when its usage changed (never once per
request). A router that starts takes its buckets from those reports (`seeds`), so a restart
loses at most one interval of admissions, not a minute's allowance.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import ssl
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from kvfleet.api.labels import (
    ENGINE_CERT_KEY,
    ENGINE_COMPONENT,
    ENGINE_PORT,
    ENGINE_PREVIOUS_CERT_KEY,
    POOL_LABEL,
    REVISION_LABEL,
    ROUTER_APP,
    ROUTER_TOKEN_KEY,
    ROUTER_TOKEN_LABEL,
    TENANT_LABEL,
    engine_server_name,
    label_value,
)
from kvfleet.api.servingpool import SHARED_WITH_ANNOTATION, WAKE_ANNOTATION, ServingPoolStatus
from kvfleet.api.tenantquota import TenantQuotaSpec, reserved_tenant
from kvfleet.kube.api import JsonObj, KubeApi, KubeError
from kvfleet.kube.informer import Informer
from kvfleet.kube.tasks import exit_process, fatal_if_it_ends
from kvfleet.router.fleet_ledger import UNREACHABLE
from kvfleet.router.keys import KeyRing
from kvfleet.router.picker import EndpointLoad
from kvfleet.router.quota import QuotaLedger
from kvfleet.router.state import (
    ConfigError,
    PoolRoute,
    RouterState,
    engine_tls,
    slo_thresholds,
)
from kvfleet.router.traffic import TrafficTable

log = logging.getLogger("kvfleet.router")

ENGINE_SELECTOR = f"app.kubernetes.io/component={ENGINE_COMPONENT},{POOL_LABEL}"
ROUTER_SELECTOR = f"app.kubernetes.io/name={ROUTER_APP}"
DEBOUNCE_SECONDS = 0.05
STATUS_INTERVAL_SECONDS = 10.0
REPORT_TTL_SECONDS = 60.0  # a bucket refills fully in a minute: older reports say nothing
REPORT_IDLE_TTL_SECONDS = 3600.0


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


def _controller(obj: Mapping[str, Any]) -> str | None:
    """The UID of the object's controlling owner."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def pool_pods(pools: Iterable[JsonObj], deployments: Iterable[JsonObj],
              replicasets: Iterable[JsonObj], pods: Iterable[JsonObj]
              ) -> tuple[list[JsonObj], list[JsonObj]]:
    """(the pods a ServingPool owns through its Deployments and their ReplicaSets, by UID as
    the garbage collector sees ownership; the Ready ones that only wear an engine's labels).
    A pod anyone who can create pods made gets no prompts and no router token."""
    pool_uids = {str(p["metadata"].get("uid")) for p in pools}
    owned_deployments = {str(d["metadata"].get("uid")) for d in deployments
                         if _controller(d) in pool_uids}
    owned_sets = {str(r["metadata"].get("uid")) for r in replicasets
                  if _controller(r) in owned_deployments}
    kept, strays = [], []
    for pod in pods:
        if _controller(pod) in owned_sets:
            kept.append(pod)
        elif _ready(pod):
            strays.append(pod)
    return kept, strays


def state_from_objects(pools: Iterable[JsonObj], pods: Iterable[JsonObj],
                       key_secrets: Iterable[JsonObj], token_secrets: Iterable[JsonObj],
                       quotas: Iterable[JsonObj], *, cluster_wide: bool) -> RouterState:
    """Clients name a pool by its name; a cluster-wide router also by `namespace/name`, and by
    its bare name only where that is unique. `pods`: the pools' own (`pool_pods`)."""
    tokens: dict[tuple[str, str | None], str | None] = {}
    certs: dict[tuple[str, str | None], str] = {}  # the engines' certificate(s), PEM
    for s in token_secrets:
        key = (_where(s)[0], (s["metadata"].get("labels") or {}).get(ROUTER_TOKEN_LABEL))
        tokens[key] = _secret_text(s, ROUTER_TOKEN_KEY)
        pem = "\n".join(filter(None, (_secret_text(s, ENGINE_CERT_KEY),
                                      _secret_text(s, ENGINE_PREVIOUS_CERT_KEY))))
        if pem:
            certs[key] = pem
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
        try:
            slos = slo_thresholds((raw.get("spec") or {}).get("slos"), "spec.slos")
        except ConfigError:
            slos = (None, None)  # the webhook admits none such; the ladder alone then
        ours = (namespace, label_value(name))
        autoscaling = (raw.get("spec") or {}).get("autoscaling") or {}
        annotations = raw["metadata"].get("annotations") or {}
        route = PoolRoute(name, TrafficTable.from_status(status), endpoints.get(ours, {}),
                          tokens.get(ours), namespace, slos,
                          wakes=autoscaling.get("minReplicas") == 0 or annotations.get(
                              WAKE_ANNOTATION) == "true",
                          shared_with=frozenset(filter(None, (n.strip() for n in str(
                              annotations.get(SHARED_WITH_ANNOTATION, "")).split(",")))))
        if (cert := certs.get(ours)) is not None:
            _serve_https(route, cert)
        if cluster_wide:
            state.pools[f"{namespace}/{name}"] = route
            names.setdefault(name, []).append(f"{namespace}/{name}")
        else:
            state.pools[name] = route
    for name, qualified in names.items():
        if len(qualified) == 1:
            state.pools[name] = state.pools[qualified[0]]
    owners: dict[str, str] = {}  # tenant -> the namespace of its oldest TenantQuota
    for raw in sorted(quotas, key=lambda q: str(q["metadata"].get("creationTimestamp", ""))):
        namespace, name = _where(raw)
        if isinstance(tenant := (raw.get("spec") or {}).get("tenant"), str):
            owners.setdefault(tenant, namespace)
        try:
            spec = TenantQuotaSpec.model_validate(raw.get("spec") or {})
        except ValidationError as exc:
            _refuse_unreadable(state, raw, exc)
            continue
        if reserved_tenant(spec.tenant):
            # (Past the webhook and the CRD's rule, e.g. created before they refused it.)
            why = (f"TenantQuota {namespace}/{name} claims tenant {spec.tenant!r}, a name "
                   "kvfleet keeps for itself; it is refused")
            state.refused[spec.tenant] = state.unreadable[f"{namespace}/{name}"] = why
            log.warning("%s", why)
            continue
        if spec.tenant in state.quotas:
            log.warning("TenantQuota %s/%s: tenant %r already has TenantQuota %s (the older "
                        "one is enforced)", namespace, name, spec.tenant,
                        state.quotas[spec.tenant][0])
            continue
        state.quotas[spec.tenant] = (f"{namespace}/{name}", spec)
    state.keys = KeyRing.from_secrets(_keys_of_their_namespace(key_secrets, owners))
    state.homes = owners
    state.place_pools()
    return state


def _serve_https(route: PoolRoute, pem: str) -> None:
    """The pool's engines serve HTTPS with the certificate in its router-token Secret: the
    router trusts exactly that one (and the one it renewed, while engines switch)."""
    try:
        tls = engine_tls(pem, engine_server_name(route.name, route.namespace))
    except ssl.SSLError as exc:
        # Refusing to send prompts in the clear is the safe side: no endpoint, a 503.
        log.warning("ServingPool %s/%s: its engine certificate does not load (%s); not routed",
                    route.namespace, route.name, exc)
        route.endpoints = {}
        return
    for endpoints in route.endpoints.values():
        for endpoint in endpoints:
            endpoint.tls = tls


def _keys_of_their_namespace(secrets: Iterable[JsonObj], owners: dict[str, str]
                             ) -> list[JsonObj]:
    """The key Secrets that may speak for their tenant: a tenant belongs to the namespace of
    its (oldest) TenantQuota, and a key for it minted in any other namespace is ignored
    (logged, never its key) — else whoever can write a Secret anywhere a router watches could
    spend another namespace's budget. The webhook refuses the second TenantQuota itself. A
    tenant with no TenantQuota (held to the router's default quota) belongs to the namespace of
    its oldest key Secret: else two namespaces' keys for one name would share its buckets,
    its engine fair share and prefix-cache scope."""
    # (ties of the 1 s timestamps broken the same way by every router replica)
    secrets = sorted(secrets, key=lambda s: (str(s["metadata"].get("creationTimestamp", "")),
                                             *_where(s)))
    for secret in secrets:  # (`owners` gains the homes of tenants without a TenantQuota)
        tenant = (secret["metadata"].get("labels") or {}).get(TENANT_LABEL)
        owners.setdefault(str(tenant), _where(secret)[0])
    kept = []
    for secret in secrets:
        namespace, name = _where(secret)
        tenant = (secret["metadata"].get("labels") or {}).get(TENANT_LABEL)
        home = owners.get(str(tenant))
        if home is not None and home != namespace:
            log.warning("Secret %s/%s: ignored, its tenant %r belongs to namespace %s (where "
                        "its TenantQuota is, or without one its oldest key)", namespace, name,
                        tenant, home)
            continue
        kept.append(secret)
    return kept


def _refuse_unreadable(state: RouterState, raw: JsonObj, exc: ValidationError) -> None:
    """A TenantQuota this router cannot read (a field from a newer version, a hand edit past
    the webhook) refuses its tenant: never unlimited, never the default quota."""
    namespace, name = _where(raw)
    err = exc.errors()[0]
    where = ".".join(["spec", *map(str, err["loc"])])
    why = (f"TenantQuota {namespace}/{name} cannot be read by this router ({where}: "
           f"{err['msg']}); its tenant is refused until it is fixed")
    state.unreadable[f"{namespace}/{name}"] = why
    tenant = (raw.get("spec") or {}).get("tenant")
    if isinstance(tenant, str) and tenant:
        state.refused[tenant] = why
    log.warning("%s", why)


def _parse_time(text: object) -> datetime | None:
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None


def _reports(raw: Mapping[str, Any], now: datetime) -> dict[str, tuple[JsonObj, float]]:
    """The TenantQuota's router reports that parse: name -> (report, age in seconds)."""
    found: dict[str, tuple[JsonObj, float]] = {}
    for name, report in ((raw.get("status") or {}).get("routers") or {}).items():
        if isinstance(report, dict) and (at := _parse_time(report.get("at"))) is not None:
            found[str(name)] = (report, (now - at).total_seconds())
    return found


def _gone(name: str, me: str, router_pods: set[str]) -> bool:
    """A report by a router pod that no longer exists (only known where routers are pods)."""
    return name != me and bool(router_pods) and name not in router_pods


def seeds(raw: Mapping[str, Any], me: str, router_pods: set[str], now: datetime
          ) -> list[tuple[dict[str, float], float]]:
    """What a starting router's buckets for this TenantQuota start from, as (remaining, age)
    pairs (the ledger takes the lowest): its own last report (a restarted container keeps its
    pod's name), else those of router pods that are gone (a replaced pod); reports over a
    minute old are ignored, their buckets have refilled since."""
    reports = {n: r for n, r in _reports(raw, now).items() if r[1] < REPORT_TTL_SECONDS}
    chosen = [reports[me]] if me in reports else [
        r for n, r in reports.items() if _gone(n, me, router_pods)]
    return [({k: float(v) for k, v in (report.get("remaining") or {}).items()
              if isinstance(v, (int, float))}, age) for report, age in chosen]


def usage_status(ledger: QuotaLedger, tenant: str, previous: tuple[int, int, int] | None,
                 elapsed: float, raw: Mapping[str, Any], me: str, router_pods: set[str],
                 now: datetime, mono: float, remaining: dict[str, float] | None = None
                 ) -> dict[str, Any] | None:
    """This router's report into the TenantQuota's status, the fleet's usage (the sum of the
    live routers' recent reports), and the reports to prune (gone routers, over a minute
    old); None when the tenant has no quota here. `remaining`: the buckets' levels when they
    are not this router's own (the shared ledger's)."""
    usage = ledger.usage(tenant)
    if usage is None:
        return None
    requests, tokens, in_flight = usage
    before = previous or (0, 0, 0)  # the first report: everything since the router started
    per_minute = 60.0 / max(elapsed, 1e-9)
    mine: dict[str, Any] = {"at": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "requestsPerMinute": round((requests - before[0]) * per_minute),
            "tokensPerMinute": round((tokens - before[1]) * per_minute),
            "concurrentRequests": in_flight,
            "remaining": ledger.remaining(tenant, mono) if remaining is None else remaining}
    routers: dict[str, Any] = {me: mine}
    total = {"requestsPerMinute": 0, "tokensPerMinute": 0, "concurrentRequests": 0}
    for name, (report, age) in _reports(raw, now).items():
        if name == me:
            continue
        idle = not any(report.get(k) for k in total)
        gone = _gone(name, me, router_pods)
        # Prune: a gone pod's report or a busy one no one renewed (a live busy router rewrites
        # every interval) after the minute its buckets take to refill, not before: the pod
        # that replaces a gone one starts from its report. An idle live router's report goes
        # after an hour (it writes it again when it next serves).
        if age >= (REPORT_IDLE_TTL_SECONDS if idle and not gone else REPORT_TTL_SECONDS):
            routers[name] = None  # merge patch: removed
            continue
        if gone or age >= REPORT_TTL_SECONDS:
            continue  # not part of the fleet's usage
        for key in total:
            value = report.get(key)
            total[key] += value if isinstance(value, int) else 0
    for key in total:
        total[key] += mine[key]
    return {"usage": total, "routers": routers,
            "observedGeneration": (raw.get("metadata") or {}).get("generation")}


class ClusterSource:
    """Keeps a router's state in step with the cluster (one namespace, or all with None)."""

    def __init__(self, api: KubeApi, router: Any, namespace: str | None,
                 name: str = "router", own_namespace: str | None = None) -> None:
        """`own_namespace`: where this router's pods run (default `namespace`). Only router
        pods there count as its replicas: with `-A`, a pod that wears the router's labels in a
        tenant's namespace would otherwise shrink every replica's share of each limit."""
        self.api, self.router, self.namespace = api, router, namespace
        self.name = name  # this replica's name in the TenantQuotas' reports: its pod's
        self.on_fatal = exit_process  # what a background loop's end does (tests record it)
        self._seeded: set[str] = set()  # TenantQuotas whose reports this router started from
        self._strays_logged: set[tuple[str, str]] = set()
        self._dirty = asyncio.Event()
        self.informers = {
            "pools": Informer(api, "ServingPool", "", self._changed, namespace=namespace),
            "pods": Informer(api, "Pod", ENGINE_SELECTOR, self._changed, namespace=namespace),
            "deployments": Informer(api, "Deployment", ENGINE_SELECTOR, self._changed,
                                    namespace=namespace),
            "replicasets": Informer(api, "ReplicaSet", ENGINE_SELECTOR, self._changed,
                                    namespace=namespace),
            "keys": Informer(api, "Secret", TENANT_LABEL, self._changed, namespace=namespace),
            "tokens": Informer(api, "Secret", ROUTER_TOKEN_LABEL, self._changed,
                               namespace=namespace),
            "quotas": Informer(api, "TenantQuota", "", self._changed, namespace=namespace),
            "routers": Informer(api, "Pod", ROUTER_SELECTOR, self._changed,
                                namespace=own_namespace or namespace),
        }
        # TenantQuota -> (requests, tokens, in flight) at this router's last report
        self._reported: dict[str, tuple[int, int, int]] = {}

    def _changed(self, _: str | None, __: JsonObj) -> None:
        self._dirty.set()

    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self.informers.values())

    def _objects(self, name: str) -> list[JsonObj]:
        return [o for objs in self.informers[name].store.values() for o in objs]

    def rebuild(self) -> None:
        pods, strays = pool_pods(self._objects("pools"), self._objects("deployments"),
                                 self._objects("replicasets"), self._objects("pods"))
        for pod in strays:
            where = _where(pod)
            if where not in self._strays_logged:  # (once per pod, not every rebuild)
                self._strays_logged.add(where)
                log.warning("pod %s/%s wears a pool's engine labels but no ServingPool's "
                            "Deployment owns it: not routed to", *where)
        state = state_from_objects(
            self._objects("pools"), pods, self._objects("keys"),
            self._objects("tokens"), self._objects("quotas"),
            cluster_wide=self.namespace is None)
        self.router.update(state)
        # This router counts itself from its start, before its own pod is Ready: a replacing
        # pod seeds its buckets at its final share, not at the survivors' larger one.
        routers = {str(p["metadata"]["name"]) for p in self._objects("routers") if _ready(p)}
        routers.add(self.name)
        now = time.monotonic()
        # Every router ranks the same names the same way: their shares sum to each limit.
        self.router.ledger.set_replicas(len(routers), now, sorted(routers).index(self.name))
        wall = datetime.now(UTC)
        for raw in self._objects("quotas"):
            namespace, name = _where(raw)
            tenant = (raw.get("spec") or {}).get("tenant")
            key = f"{namespace}/{name}"
            if key in self._seeded or not isinstance(tenant, str) or \
                    tenant not in state.quotas or state.quotas[tenant][0] != key:
                continue
            self._seeded.add(key)
            for remaining, age in seeds(raw, self.name, self._router_pods(), wall):
                self.router.ledger.seed(tenant, remaining, age, now)
                log.info("TenantQuota %s: buckets taken from a router report %.0f s old",
                         key, age)

    def _router_pods(self) -> set[str]:
        return {str(p["metadata"]["name"]) for p in self._objects("routers")
                if not p["metadata"].get("deletionTimestamp")}

    def start(self) -> asyncio.Task[None]:
        """`run` as a background task whose end is fatal too: a rebuild that raised ended the
        watch loop, and the router went on serving the state of that moment, /ready still
        200, while pools, keys and quotas changed."""
        return fatal_if_it_ends(asyncio.create_task(self.run(), name="cluster state"),
                                self.on_fatal)

    async def run(self) -> None:
        tasks = [fatal_if_it_ends(asyncio.create_task(i.run(), name=f"informer {name}"),
                                  self.on_fatal) for name, i in self.informers.items()]
        tasks.append(fatal_if_it_ends(asyncio.create_task(
            self._write_statuses(), name="TenantQuota status writer"), self.on_fatal))
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
        current = raw.get("status") or {}
        if (why := self.router.state.unreadable.get(key)) is not None:
            condition = _ready_condition(raw, False, "Unreadable", why)
            if current.get("conditions") != [condition]:
                await self._patch_status(key, {"conditions": [condition]})
            return
        tenant = (raw.get("spec") or {}).get("tenant")
        if not isinstance(tenant, str) or (usage := self.router.ledger.usage(tenant)) is None:
            return
        previous = self._reported.get(key)
        shared = self.router.shared
        remaining = None
        if shared is not None and shared.up:
            with contextlib.suppress(*UNREACHABLE):  # (then this router's own, as below)
                remaining = await shared.levels(tenant)
        status = usage_status(self.router.ledger, tenant, previous, elapsed, raw, self.name,
                              self._router_pods(), datetime.now(UTC), time.monotonic(),
                              remaining)
        self._reported[key] = (usage[0], usage[1], usage[2])
        if status is None:
            return
        # Unchanged since the last report (no admission, nothing ended): the buckets only
        # refilled, which the last report plus its time already says.
        stored = ((raw.get("status") or {}).get("routers") or {}).get(self.name) or {}
        mine = status["routers"][self.name]
        unchanged = previous == self._reported[key] and all(
            stored.get(k) == mine[k] for k in status["usage"]) and all(
            v is not None for v in status["routers"].values())
        enforced = self.router.state.quotas.get(tenant, ("", None))[0] == key
        status["conditions"] = [
            _ready_condition(raw, True, "Enforced", "enforced by the kvfleet router")
            if enforced else _ready_condition(
                raw, False, "Superseded", "another TenantQuota for the same tenant is enforced")]
        if shared is not None:
            status["conditions"].append(_condition(raw, "FleetWide", *shared.condition()))
        if unchanged and all(current.get(k) == v for k, v in status.items()
                             if k not in ("routers", "usage")):
            return
        await self._patch_status(key, status)

    async def _patch_status(self, key: str, status: JsonObj) -> None:
        namespace, name = key.split("/", 1)
        try:
            await self.api.patch_status("TenantQuota", namespace, name, status)
        except KubeError as exc:
            log.warning("TenantQuota %s: status not written (%s)", key, exc)


def _ready_condition(raw: JsonObj, ready: bool, reason: str, message: str) -> JsonObj:
    return _condition(raw, "Ready", ready, reason, message)


def _condition(raw: JsonObj, kind: str, ok: bool, reason: str, message: str) -> JsonObj:
    before: JsonObj = next((c for c in (raw.get("status") or {}).get("conditions") or []
                            if c.get("type") == kind), {})
    value = "True" if ok else "False"
    return {
        "type": kind, "status": value, "reason": reason, "message": message,
        "observedGeneration": raw["metadata"].get("generation"),
        # Changes only when the condition's status does.
        "lastTransitionTime": before.get("lastTransitionTime")
        if before.get("status") == value else datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
