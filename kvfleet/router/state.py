"""What the router routes by: pools (traffic table, endpoints per revision, the engines' router
token), tenants' keys and quotas. Filled from a config file (`load_config`) or, in a cluster,
from the API server; replaced whole on each change, read per request without locks (one event
loop).

The config file (YAML; keys are what `kubectl get -o yaml` shows for the same facts):

    namespace: llm                         # the pools' and tenants' (default "default")
    pools:
      - name: smollm                       # what clients send as `model`
        namespace: llm                     # this pool's, if not the file's
        status:                            # a ServingPool's status: servingRevision, traffic
          servingRevision: <64 hex>
          traffic: [{revision: <64 hex>, role: stable, weight: 90}, ...]
        endpoints:                         # per revision (full or 12-digit short hash)
          <hash>: ["127.0.0.1:8101", "127.0.0.1:8102"]
        routerTokenFile: /path/to/token    # the token the pool's engines want (or routerToken)
        tls: {caFile: engines.crt, serverName: smol.llm.engines.kvfleet.io}  # HTTPS to them
        slos: {ttftP95Seconds: 2}          # a ServingPool's spec.slos: latency buckets at them
        scalesToZero: true                 # hold requests while no endpoint (it may be waking)
        sharedWith: [research]             # other namespaces' tenants that may use it, if
                                           # their allowedPools lists llm/smollm ("*": all)
    tenants:
      - tenant: team-a
        namespace: llm                     # its own: it uses this namespace's pools
        keys: ["sk-..."]                   # plain keys (local use), or keysFile: one per line
        quota:                             # a TenantQuota's spec (tenant taken from above)
          limits: {requestsPerMinute: 600, maxConcurrentRequests: 16}
    defaultQuota:                          # for tenants without `quota` (without it: refused)
      limits: {requestsPerMinute: 60}
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvfleet.api.labels import short_revision
from kvfleet.api.servingpool import ServingPoolStatus, SLOs
from kvfleet.api.tenantquota import TenantQuotaSpec
from kvfleet.router.keys import KeyRing
from kvfleet.router.picker import EndpointLoad, EngineTLS
from kvfleet.router.traffic import TrafficTable

# How long a replaced router token is still sent to engines that refuse the new one; the
# engines accept a replaced one as long (kvfleet.engine.router_token.GRACE_SECONDS).
TOKEN_GRACE_SECONDS = 600.0


class ConfigError(ValueError):
    """The router's config file is unusable; the message names the field."""


@dataclass(slots=True)
class PoolRoute:
    name: str
    table: TrafficTable | None
    # short revision -> endpoints; EndpointLoad objects are kept across updates (their load).
    endpoints: dict[str, list[EndpointLoad]] = field(default_factory=dict)
    router_token: str | None = None
    # The ServingPool's namespace: a label on every router series, so two pools of one name
    # (a cluster-wide router) are two series and the analysis selects the Rollout's own.
    namespace: str = "default"
    # The pool's (TTFT, TPOT) p95 SLOs in seconds: edges of its latency histograms' buckets.
    slos: tuple[float | None, float | None] = (None, None)
    # The token it replaced and until when (monotonic) it is still sent to an engine that
    # refuses the current one: engines see a re-minted Secret a kubelet sync later than the
    # router does (kvfleet.engine.router_token).
    previous_token: tuple[str, float] | None = None
    # The pool may be at zero replicas (autoscaling.minReplicas 0): a request finding no
    # Ready replica is held while it wakes (kvfleet.router.hold), not refused.
    wakes: bool = False
    # Namespaces whose tenants may use the pool besides its own, when their TenantQuota also
    # lists it (kvfleet.router.access); "*": every namespace.
    shared_with: frozenset[str] = frozenset()

    def ready(self, revision: str) -> list[EndpointLoad]:
        return self.endpoints.get(short_revision(revision), [])

    def previous(self, now: float) -> str | None:
        """The router token this pool's one replaced, while its grace lasts."""
        if self.previous_token is not None and now < self.previous_token[1]:
            return self.previous_token[0]
        return None


@dataclass(slots=True)
class RouterState:
    pools: dict[str, PoolRoute] = field(default_factory=dict)
    keys: KeyRing = field(default_factory=KeyRing)
    quotas: dict[str, tuple[str, TenantQuotaSpec]] = field(default_factory=dict)
    # Tenants refused whatever they send, and why: their TenantQuota cannot be read. Never
    # unlimited, never the default quota.
    refused: dict[str, str] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)  # TenantQuota ns/name -> why
    default_quota: TenantQuotaSpec | None = None
    # Each tenant's namespace, and each pool by (namespace, name): who reaches which pool
    # (kvfleet.router.access).
    homes: dict[str, str] = field(default_factory=dict)
    places: dict[tuple[str, str], PoolRoute] = field(default_factory=dict)

    def all_endpoints(self) -> list[EndpointLoad]:
        return [e for pool in self.pools.values() for eps in pool.endpoints.values() for e in eps]

    def place_pools(self) -> None:
        """Index the pools by (namespace, name), once `pools` is complete."""
        self.places = {(p.namespace, p.name): p for p in self.pools.values()}

    def routed_series(self) -> set[tuple[str, str, str, str]]:
        """(namespace, pool, short revision, traffic) of every revision a traffic table sends
        requests to: stable and canary get live traffic, the shadow revision shadow copies."""
        series = set()
        for pool in self.pools.values():  # a cluster-wide router's aliases: one series each
            table = pool.table
            if table is None:
                continue
            for revision in (table.stable, table.canary):
                if revision is not None:
                    series.add((pool.namespace, pool.name, short_revision(revision), "live"))
                    if table.synthetic is not None:
                        series.add((pool.namespace, pool.name, short_revision(revision),
                                    "synthetic"))
            if table.shadow is not None:
                series.add((pool.namespace, pool.name, short_revision(table.shadow), "shadow"))
        return series

    def probed_series(self) -> set[tuple[str, str, str]]:
        """(namespace, pool, short revision) of every revision probed against stable."""
        return {(pool.namespace, pool.name, short_revision(pool.table.probe))
                for pool in self.pools.values()
                if pool.table is not None and pool.table.probe is not None}


def slo_thresholds(raw: Any, where: str) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) p95 seconds of a ServingPool's `spec.slos` (absent: none)."""
    if raw is None:
        return None, None
    try:
        slos = SLOs.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {exc.errors()[0]['msg']} at "
                          f"{'.'.join(map(str, exc.errors()[0]['loc']))}") from None
    return slos.ttft_p95_seconds, slos.tpot_p95_seconds


def _carried(old: EndpointLoad | None, new: EndpointLoad) -> EndpointLoad:
    """The endpoint with what the router knew of its load, and how it is reached now."""
    if old is None:
        return new
    old.tls = new.tls
    return old


def carry_loads(new: RouterState, old: RouterState, now: float) -> None:
    """Endpoints that stay keep what the router knows of their load; a pool whose router
    token changed keeps the one it replaced for TOKEN_GRACE_SECONDS."""
    known = {e.address: e for e in old.all_endpoints()}
    # By the pool itself, not by the name clients use: a cluster-wide router's bare-name alias
    # may point to another namespace's pool after a change.
    previous = {(p.namespace, p.name): p for p in old.pools.values()}
    for pool in {id(p): p for p in new.pools.values()}.values():
        for revision, endpoints in pool.endpoints.items():
            pool.endpoints[revision] = [_carried(known.get(e.address), e) for e in endpoints]
        before = previous.get((pool.namespace, pool.name))
        if before is None:
            continue
        pool.previous_token = before.previous_token
        if before.router_token not in (None, pool.router_token):
            assert before.router_token is not None
            pool.previous_token = (before.router_token, now + TOKEN_GRACE_SECONDS)
        if pool.previous_token is not None and pool.previous_token[1] <= now:
            pool.previous_token = None


@functools.lru_cache(maxsize=256)
def engine_tls(pem: str, server_name: str) -> EngineTLS:
    """HTTPS to engines whose certificate is one of `pem` (the pool's own, self-issued:
    trusted as is, for `server_name`). Cached: state is rebuilt on every change."""
    context = ssl.create_default_context(cadata=pem)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # A leaf in `pem` is a trust anchor itself (pinned), not only a CA that signs one.
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return EngineTLS(context, server_name)


def _read_tls(entry: Mapping[str, Any], where: str, base: Path) -> EngineTLS | None:
    """A pool's `tls: {caFile, serverName}`: its engines serve HTTPS."""
    tls = entry.get("tls")
    if tls is None:
        return None
    if not isinstance(tls, dict) or not tls.get("caFile") or not tls.get("serverName"):
        raise ConfigError(f"{where}.tls: needs caFile (the engines' certificate or its CA, "
                          "PEM) and serverName (the name it is issued for)")
    path = base / str(tls["caFile"])
    try:
        return engine_tls(path.read_text(), str(tls["serverName"]))
    except OSError as exc:
        raise ConfigError(f"{where}.tls.caFile: cannot read {path}: {exc.strerror}") from None
    except ssl.SSLError as exc:
        raise ConfigError(f"{where}.tls.caFile: {path} holds no PEM certificate ({exc})") \
            from None


def _read_token(entry: Mapping[str, Any], where: str, base: Path) -> str | None:
    if "routerToken" in entry:
        return str(entry["routerToken"])
    if "routerTokenFile" in entry:
        path = base / str(entry["routerTokenFile"])
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{where}.routerTokenFile: cannot read {path}: {exc.strerror}") \
                from None
    return None


def parse_config(data: Any, base: Path = Path(".")) -> RouterState:
    if not isinstance(data, dict):
        raise ConfigError("the router config must be a mapping with `pools` and `tenants`")
    state = RouterState()
    namespace = str(data.get("namespace") or "default")
    for i, entry in enumerate(data.get("pools") or []):
        where = f"pools[{i}]"
        if not isinstance(entry, dict) or not entry.get("name"):
            raise ConfigError(f"{where}.name: every pool needs a name")
        try:
            status = ServingPoolStatus.model_validate(entry.get("status") or {})
        except ValidationError as exc:
            raise ConfigError(f"{where}.status: {exc.errors()[0]['msg']} at "
                              f"{'.'.join(map(str, exc.errors()[0]['loc']))}") from None
        tls = _read_tls(entry, where, base)
        endpoints = {short_revision(str(rev)): [EndpointLoad(str(a), tls=tls) for a in addresses]
                     for rev, addresses in (entry.get("endpoints") or {}).items()}
        state.pools[str(entry["name"])] = PoolRoute(
            str(entry["name"]), TrafficTable.from_status(status), endpoints,
            _read_token(entry, where, base), str(entry.get("namespace") or namespace),
            slo_thresholds(entry.get("slos"), f"{where}.slos"),
            wakes=entry.get("scalesToZero") is True,
            shared_with=frozenset(map(str, entry.get("sharedWith") or ())))
    keys: dict[str, str] = {}
    for i, entry in enumerate(data.get("tenants") or []):
        where = f"tenants[{i}]"
        tenant = entry.get("tenant") if isinstance(entry, dict) else None
        if not tenant:
            raise ConfigError(f"{where}.tenant: every tenant needs a name")
        plain = list(entry.get("keys") or [])
        if "keysFile" in entry:
            try:
                plain += (base / str(entry["keysFile"])).read_text().split()
            except OSError as exc:
                raise ConfigError(f"{where}.keysFile: {exc.strerror}") from None
        for key in plain:
            if len(str(key)) < 16:
                raise ConfigError(f"{where}.keys: an API key needs at least 16 characters")
            keys[str(key)] = str(tenant)
        state.homes[str(tenant)] = str(entry.get("namespace") or namespace)
        if "quota" in entry:
            try:
                spec = TenantQuotaSpec.model_validate({**(entry["quota"] or {}),
                                                       "tenant": tenant})
            except ValidationError as exc:
                err = exc.errors()[0]
                raise ConfigError(f"{where}.quota.{'.'.join(map(str, err['loc']))}: "
                                  f"{err['msg']}") from None
            state.quotas[str(tenant)] = (f"config/{tenant}", spec)
    state.keys = KeyRing.from_keys(keys)
    state.place_pools()
    if data.get("defaultQuota") is not None:
        state.default_quota = parse_default_quota(data["defaultQuota"], "defaultQuota")
    return state


def parse_default_quota(data: Any, where: str) -> TenantQuotaSpec:
    """A TenantQuota's spec without its tenant: the quota of tenants that have none."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a TenantQuota's spec (limits, allowedPools, ...)")
    try:
        return TenantQuotaSpec.model_validate({**data, "tenant": "default"})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ConfigError(f"{where}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def load_config(path: Path) -> RouterState:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not YAML ({exc})") from None
    return parse_config(data, path.parent)


def config_files(path: Path) -> list[Path]:
    """The config file and the router token files it names: a change to any is a reload (a
    token file rewritten by a rotation, as a mounted Secret is)."""
    files = [path]
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return files
    pools = data.get("pools") if isinstance(data, dict) else None
    for entry in pools if isinstance(pools, list) else []:
        if isinstance(entry, dict) and "routerTokenFile" in entry:
            files.append(path.parent / str(entry["routerTokenFile"]))
    return files
