"""kopf wiring: which events run which reconcile. Every handler is one line of dispatch; the
decisions live in the pure reconcilers and the I/O in kvfleet.operator.runtime.

Triggers of a ServingPool reconcile: the pool's create/update/resume (kopf progress and
diff-base kept in `kvfleet.io/` annotations, never in status), any event on a Deployment,
Service, ConfigMap or PodDisruptionBudget the operator manages (so a deleted Service or a
Deployment that became ready is acted on at once), one of its engine pods showing, changing or
clearing a problem (unschedulable, crash-looping: see `podwatch`), its artifact appearing or
going away, and a drift timer that re-reads everything (level-based: it closes any gap left).

Watches of core kinds use server-side label selectors, so the operator never receives the
cluster's other pods, Services or ConfigMaps. The same watches feed kopf indices (one per
kind, see `cache`) that the reconciles read instead of asking the apiserver; kopf starts the
other handlers only once every index holds its kind's initial listing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from kvfleet.compat import Matrix
from kvfleet.operator import cache, metrics, naming, podwatch
from kvfleet.operator.builders import EngineOptions
from kvfleet.operator.kube import KubeApi, KubeError, connection_from_kopf
from kvfleet.operator.runtime import InvalidObjectError, Key, Runtime

log = logging.getLogger("kvfleet.operator")
GROUP, VERSION = "kvfleet.io", "v1alpha1"
RETRY_DELAY_SECONDS = 5.0
# Children kinds watched for changes: (group, version, plural) -> kind.
CHILD_KINDS = {
    ("apps", "v1", "deployments"): "Deployment",
    ("", "v1", "services"): "Service",
    ("", "v1", "configmaps"): "ConfigMap",
    ("policy", "v1", "poddisruptionbudgets"): "PodDisruptionBudget",
}
CHILDREN = tuple(CHILD_KINDS)
MANAGED = {"app.kubernetes.io/managed-by": naming.MANAGED_BY}
PODS = ("", "v1", "pods")
# Client-side filters of the handlers on core kinds (the server-side ones are below).
WATCH_LABELS: dict[tuple[str, str, str], dict[str, Any]] = {
    **{child: MANAGED for child in CHILDREN},
    PODS: {naming.POOL_LABEL: kopf.PRESENT},
}
# Every kind the reconciles read, each cached in its own kopf index (see `cache`).
INDEXED = {
    (GROUP, VERSION, "servingpools"): "ServingPool",
    (GROUP, VERSION, "modelartifacts"): "ModelArtifact",
    **CHILD_KINDS,
    PODS: "Pod",
}
# Server-side filters of the watches, per (group, version, plural).
WATCH_SELECTORS = {
    **{child: naming.selector_string(MANAGED) for child in CHILDREN},
    PODS: podwatch.POD_SELECTOR,
}


@dataclass(frozen=True)
class OperatorConfig:
    matrix: Matrix
    options: EngineOptions = field(default_factory=EngineOptions)
    drift_interval_seconds: float = 30.0
    max_concurrent_reconciles: int = 4


class _State:
    """The runtime, created at login (it needs the credentials kopf logged in with)."""

    def __init__(self) -> None:
        self.runtime: Runtime | None = None
        self.background: set[asyncio.Task[None]] = set()

    def get(self) -> Runtime:
        if self.runtime is None:
            raise kopf.TemporaryError("not logged in yet", delay=RETRY_DELAY_SECONDS)
        return self.runtime


async def _handled(trigger: Callable[[Key], Awaitable[None]], key: Key) -> None:
    """Run a reconcile from a kopf handler, mapping failures to kopf's retry semantics."""
    try:
        await trigger(key)
    except InvalidObjectError as exc:
        raise kopf.PermanentError(str(exc)) from exc
    except KubeError as exc:
        if exc.retryable:
            raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY_SECONDS) from exc
        raise kopf.PermanentError(str(exc)) from exc
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise kopf.TemporaryError(
            f"apiserver unreachable: {exc}", delay=RETRY_DELAY_SECONDS
        ) from exc


def _controller_pool(body: Any) -> str | None:
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("kind") == "ServingPool" and ref.get("controller"):
            name: str = ref["name"]
            return name
    return None


def configure(settings: kopf.OperatorSettings) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    # The operator posts its own events for decisions; kopf's per-handler ones are noise.
    settings.posting.level = logging.ERROR
    # No cluster-wide CRD/namespace scans: the RBAC stays small.
    settings.scanning.disabled = True
    for resource, selector in WATCH_SELECTORS.items():
        settings.watching.label_selectors[resource] = selector


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    state = _State()

    def in_background(trigger: Callable[[Key], Awaitable[None]], key: Key) -> None:
        async def run() -> None:
            try:
                await trigger(key)
            except Exception as exc:  # the drift timer retries; say why meanwhile
                log.warning("reconcile of %s/%s failed: %s", key[0], key[1], exc)

        task = asyncio.get_running_loop().create_task(run())
        state.background.add(task)
        task.add_done_callback(state.background.discard)

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings)

    @kopf.on.login(registry=registry)
    async def login(settings: kopf.OperatorSettings, **kwargs: Any) -> kopf.ConnectionInfo:
        info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
            settings=settings
        )
        if info is None:
            raise kopf.LoginError(
                "no credentials: run in a pod with a service account, or set KUBECONFIG"
            )
        if state.runtime is None:
            api = KubeApi(connection_from_kopf(info), metrics.count_request)
            # kopf hands every handler its indices as keyword arguments named by index id.
            indices = {index_id: kwargs[index_id] for index_id in cache.INDEX_IDS.values()}
            state.runtime = Runtime(
                api=api,
                cache=cache.Cache(indices),
                matrix=config.matrix,
                options=config.options,
                max_concurrent=config.max_concurrent_reconciles,
            )
        return info

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        if state.runtime is not None:
            await state.runtime.api.close()

    # -- the cache: one kopf index per kind a reconcile reads ------------------------------

    def indexer(kind: str) -> Callable[..., Awaitable[dict[Any, Any]]]:
        # async although it awaits nothing: kopf runs a sync handler in its thread pool, a
        # thread hop (and a per-thread malloc arena) for every watch event of 6 objects per pool.
        async def index(body: Any, **_: Any) -> dict[Any, Any]:
            return cache.index_entry(kind, body)

        return index

    for resource, kind in INDEXED.items():
        kopf.index(
            *resource,
            labels=WATCH_LABELS.get(resource),
            id=cache.INDEX_IDS[kind],
            registry=registry,
        )(indexer(kind))

    # -- ServingPool ----------------------------------------------------------------------

    @kopf.on.create(GROUP, VERSION, "servingpools", registry=registry)
    @kopf.on.update(GROUP, VERSION, "servingpools", registry=registry)
    @kopf.on.resume(GROUP, VERSION, "servingpools", registry=registry)
    async def pool_changed(namespace: str | None, name: str, **_: Any) -> None:
        await _handled(state.get().pools.trigger, (namespace or "default", name))

    def spread(**kwargs: Any) -> float:
        # Pools created together would otherwise tick together forever: offset each pool's
        # first tick by a stable fraction (from its uid) of the interval.
        uid = str(kwargs["body"].get("metadata", {}).get("uid", ""))
        fraction = int(hashlib.sha256(uid.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        return config.drift_interval_seconds * (0.5 + fraction)

    @kopf.timer(
        GROUP,
        VERSION,
        "servingpools",
        interval=config.drift_interval_seconds,
        initial_delay=spread,
        registry=registry,
    )
    async def pool_drift(namespace: str | None, name: str, **_: Any) -> None:
        await _handled(state.get().pools.trigger, (namespace or "default", name))

    for child in CHILDREN:
        group, version, plural = child

        @kopf.on.event(group, version, plural, labels=WATCH_LABELS[child], registry=registry)
        async def child_changed(
            body: Any, namespace: str | None, type: str | None, **_: Any
        ) -> None:
            # Only changes matter: the initial listing (None) is covered by the pools' resume,
            # and ADDED is the operator's own create.
            if type not in ("MODIFIED", "DELETED"):
                return
            if type == "DELETED" and state.runtime is not None:
                state.runtime.cache.seen_deleted(body)
            pool = _controller_pool(body)
            if pool is not None and state.runtime is not None:
                in_background(state.runtime.pools.trigger, (namespace or "default", pool))

    pod_problems = podwatch.PodProblems()

    async def reconcile_pools_labelled(key: Key) -> None:
        namespace, label = key
        runtime = state.get()
        for name in podwatch.pools_of(label, lambda: runtime.cache.names("ServingPool", namespace)):
            await runtime.pools.trigger((namespace, name))

    @kopf.on.event(*PODS, labels=WATCH_LABELS[PODS], registry=registry)
    async def pod_changed(body: Any, namespace: str | None, type: str | None, **_: Any) -> None:
        label = podwatch.pool_label(body)
        if label is not None and state.runtime is not None and pod_problems.changed(body, type):
            in_background(reconcile_pools_labelled, (namespace or "default", label))

    # -- ModelArtifact --------------------------------------------------------------------

    @kopf.on.create(GROUP, VERSION, "modelartifacts", registry=registry)
    @kopf.on.update(GROUP, VERSION, "modelartifacts", registry=registry)
    @kopf.on.resume(GROUP, VERSION, "modelartifacts", registry=registry)
    async def artifact_changed(namespace: str | None, name: str, reason: str, **_: Any) -> None:
        runtime = state.get()
        await _handled(runtime.artifacts.trigger, (namespace or "default", name))
        if reason != "resume":  # on resume, every pool resumes by itself
            for key in runtime.pools_using(namespace or "default", name):
                in_background(runtime.pools.trigger, key)

    @kopf.on.delete(GROUP, VERSION, "modelartifacts", optional=True, registry=registry)
    async def artifact_deleted(namespace: str | None, name: str, **_: Any) -> None:
        runtime = state.get()
        for key in runtime.pools_using(namespace or "default", name):
            in_background(runtime.pools.trigger, key)

    return registry
