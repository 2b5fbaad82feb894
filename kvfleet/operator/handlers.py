"""kopf wiring: which events run which reconcile. Every handler is one line of dispatch; the
decisions live in the pure reconcilers and the I/O in kvfleet.operator.runtime.

Triggers of a ServingPool reconcile: the pool's create/update/resume (kopf progress and
diff-base kept in `kvfleet.io/` annotations, never in status), any event on a Deployment,
Service or PodDisruptionBudget the operator manages (so a deleted Service or a
Deployment that became ready is acted on at once), one of its engine pods showing, changing or
clearing a problem (unschedulable, crash-looping: see `podwatch`), its artifact appearing or
going away, and a drift loop that re-reads everything (level-based: it closes any gap left).

ServingPools and ModelArtifacts are watched by kopf (their create/update/resume handlers, and a
kopf index of each). The child kinds and engine pods are listed and watched by `informer`s
(server-side label selectors: only the operator's own objects), which feed the other indices
of `cache` and trigger the pools; pool handlers wait until every informer holds its first
listing, so a restarted operator creates nothing twice. The drift check is one loop over the
cached pools (controller-runtime's resync), not a kopf timer per pool.

The informers watch cluster-wide (the ClusterRole of `kvfleet operator --print-rbac` allows
it) also when the operator serves only some namespaces: children of pools it does not serve
are cached but never read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from kvfleet.compat import Matrix
from kvfleet.kube.api import JsonObj, KubeApi, KubeError
from kvfleet.kube.credentials import Credentials, CredentialsError
from kvfleet.kube.informer import Informer
from kvfleet.kube.tasks import exit_process, fatal_if_it_ends
from kvfleet.operator import cache, changes, metrics, naming, podwatch, waves
from kvfleet.operator.autoscaler import DEFAULT_INTERVAL_SECONDS
from kvfleet.operator.builders import EngineOptions
from kvfleet.operator.promquery import PromQuery
from kvfleet.operator.runtime import InvalidObjectError, Key, Runtime

log = logging.getLogger("kvfleet.operator")
GROUP, VERSION = "kvfleet.io", "v1alpha1"
RETRY_DELAY_SECONDS = 5.0
# Children kinds watched for changes: (group, version, plural) -> kind.
CHILD_KINDS = {
    ("apps", "v1", "deployments"): "Deployment",
    ("", "v1", "services"): "Service",
    ("policy", "v1", "poddisruptionbudgets"): "PodDisruptionBudget",
    ("", "v1", "secrets"): "Secret",
    ("networking.k8s.io", "v1", "networkpolicies"): "NetworkPolicy",
}
MANAGED = {"app.kubernetes.io/managed-by": naming.MANAGED_BY}
PODS = ("", "v1", "pods")
# The kinds kopf watches and caches in its own indices (see `cache`).
KOPF_INDEXED = {
    (GROUP, VERSION, "servingpools"): "ServingPool",
    (GROUP, VERSION, "modelartifacts"): "ModelArtifact",
    (GROUP, VERSION, "rollouts"): "Rollout",
}
# The kinds `informer`s list and watch, with their server-side label selectors.
INFORMED = {
    **{kind: naming.selector_string(MANAGED) for kind in CHILD_KINDS.values()},
    "Pod": podwatch.POD_SELECTOR,
}


@dataclass(frozen=True)
class OperatorConfig:
    matrix: Matrix
    options: EngineOptions = field(default_factory=EngineOptions)
    drift_interval_seconds: float = 30.0
    max_concurrent_reconciles: int = 4
    max_concurrent_rollouts: int = waves.DEFAULT_MAX_CONCURRENT  # pools in one fleet wave
    prometheus_url: str | None = None  # what Rollout analysis and autoscaling query
    autoscale_interval_seconds: float = DEFAULT_INTERVAL_SECONDS
    # What a background loop's end does (tests record it instead of exiting).
    on_fatal: Callable[[str], None] = exit_process


def connection_info(credentials: Credentials) -> kopf.ConnectionInfo:
    """kopf's view of the operator's credentials (PEM material inline, the current token)."""
    scheme, _, token = (credentials.authorization() or "").partition(" ")
    tls = credentials.tls
    return kopf.ConnectionInfo(
        server=credentials.server, ca_data=tls.ca, insecure=tls.insecure or None,
        certificate_data=tls.cert, private_key_data=tls.key,
        scheme=scheme or None, token=token or None)


class _State:
    """The runtime, created at the first login: kopf and the runtime's client share one
    `Credentials`."""

    def __init__(self) -> None:
        self.credentials: Credentials | None = None
        self.runtime: Runtime | None = None
        self.informers: list[Informer] = []
        self.background: set[asyncio.Task[None]] = set()
        self.loops: list[asyncio.Task[None]] = []  # informers and the drift loop

    def get(self) -> Runtime:
        if self.runtime is None:
            raise kopf.TemporaryError("not logged in yet", delay=RETRY_DELAY_SECONDS)
        return self.runtime

    async def synced(self) -> Runtime:
        """The runtime, once every informer holds its first listing."""
        runtime = self.get()
        for informer in self.informers:
            await informer.synced.wait()
        return runtime

    def reconcile_soon(self, key: Key) -> None:
        """Reconcile the pool in the background (`Runtime.enqueue`: retried with back-off,
        and nothing added when a run not started yet covers it)."""
        runtime = self.runtime
        if runtime is not None and all(i.synced.is_set() for i in self.informers):
            runtime.enqueue(key)
            return

        async def run() -> None:
            try:
                # An informer's first listing can trigger before the others have listed: a
                # reconcile then would see children missing that merely are not listed yet.
                (await self.synced()).enqueue(key)
            except Exception as exc:  # (not logged in yet) the drift loop asks again
                log.warning("reconcile of %s/%s not queued: %s", key[0], key[1], exc)

        task = asyncio.get_running_loop().create_task(run())
        self.background.add(task)
        task.add_done_callback(self.background.discard)


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


async def drift_forever(
    runtime: Runtime,
    interval: float,
    reconcile_soon: Callable[[Key], None],
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Re-check every cached pool once per `interval`, spread evenly over it (level-based: a
    reconcile closes any gap the events left). A converged pool's check sends no request."""
    while True:
        keys = runtime.cache.keys("ServingPool")
        if not keys:
            await sleep(interval)
            continue
        gap = interval / len(keys)
        for key in keys:
            await sleep(gap)
            reconcile_soon(key)


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    state = _State()
    reconcile_soon = state.reconcile_soon

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings)

    pod_problems = podwatch.PodProblems()

    def child_changed(type: str | None, body: JsonObj) -> None:
        if state.runtime is None:
            return
        if type == "DELETED":
            state.runtime.cache.seen_deleted(body)
        else:
            state.runtime.cache.seen(body)
        # Only changes matter: the first listing (None) is covered by the pools' own, and
        # ADDED is the operator's own create.
        if type not in ("MODIFIED", "DELETED"):
            return
        pool = _controller_pool(body)
        if pool is not None:
            namespace = str(body["metadata"].get("namespace") or "default")
            reconcile_soon((namespace, pool))

    def pod_changed(type: str | None, body: JsonObj) -> None:
        label, runtime = podwatch.pool_label(body), state.runtime
        if label is None or runtime is None or not pod_problems.changed(body, type):
            return
        namespace = str(body["metadata"].get("namespace") or "default")
        for name in podwatch.pools_of(label, lambda: runtime.cache.names("ServingPool",
                                                                           namespace)):
            reconcile_soon((namespace, name))

    def start(runtime: Runtime) -> None:
        loop = asyncio.get_running_loop()
        for informer in state.informers:
            state.loops.append(fatal_if_it_ends(loop.create_task(
                informer.run(), name=f"informer {informer.kind}"), config.on_fatal))

        async def drift() -> None:
            await state.synced()
            await drift_forever(runtime, config.drift_interval_seconds, reconcile_soon)

        state.loops.append(fatal_if_it_ends(loop.create_task(drift(), name="drift"),
                                            config.on_fatal))

        async def autoscale() -> None:
            await state.synced()
            await runtime.autoscaler.run_forever(runtime.autoscaled_pools)

        state.loops.append(fatal_if_it_ends(loop.create_task(autoscale(), name="autoscale"),
                                            config.on_fatal))
        state.loops.append(fatal_if_it_ends(
            loop.create_task(metrics.measure_loop_lag(), name="loop lag"), config.on_fatal))
        metrics.time_gc_pauses()

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.ConnectionInfo:
        try:
            if state.credentials is None:
                state.credentials = await asyncio.to_thread(Credentials)
            else:
                # kopf logs in again when the apiserver refused what it had: read the
                # credentials again (a rotated token file, a renewed certificate).
                await asyncio.to_thread(state.credentials.reload)
        except CredentialsError as error:
            raise kopf.LoginError(str(error)) from error
        credentials = state.credentials
        if state.runtime is None:
            api = KubeApi(credentials, metrics.count_request,
                          field_manager=naming.FIELD_MANAGER)
            state.informers = [
                Informer(api, kind, selector, pod_changed if kind == "Pod" else child_changed,
                         index=cache.index_entry, on_list=metrics.count_informer_list,
                         pack=True)
                for kind, selector in INFORMED.items()
            ]
            # kopf hands every handler its indices as keyword arguments named by index id.
            indices: dict[str, cache.IndexView] = {
                cache.INDEX_IDS[kind]: kwargs[cache.INDEX_IDS[kind]]
                for kind in KOPF_INDEXED.values()
            }
            indices.update({cache.INDEX_IDS[i.kind]: i.store for i in state.informers})
            state.runtime = Runtime(
                api=api,
                cache=cache.Cache(indices),
                matrix=config.matrix,
                options=config.options,
                max_concurrent=config.max_concurrent_reconciles,
                max_concurrent_rollouts=config.max_concurrent_rollouts,
                prometheus=PromQuery(config.prometheus_url),
                autoscale_interval=config.autoscale_interval_seconds,
            )
            start(state.runtime)
        return connection_info(credentials)

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        for task in state.loops:
            task.cancel()
        await asyncio.gather(*state.loops, return_exceptions=True)
        if state.runtime is not None:
            await state.runtime.prometheus.close()
            await state.runtime.api.close()

    _register_kinds(registry, state)
    return registry


def _register_kinds(registry: kopf.OperatorRegistry, state: _State) -> None:
    """kopf's indices of pools, artifacts and Rollouts, and what their events trigger."""
    # -- the cache: kopf indices of pools and artifacts (the rest: informers) --------------

    def indexer(kind: str) -> Callable[..., Awaitable[dict[Any, Any]]]:
        # async although it awaits nothing: kopf runs a sync handler in its thread pool, a
        # thread hop (and a per-thread malloc arena) for every watch event.
        async def index(body: Any, **_: Any) -> dict[Any, Any]:
            return cache.index_entry(kind, body)

        return index

    for resource, kind in KOPF_INDEXED.items():
        kopf.index(*resource, id=cache.INDEX_IDS[kind], registry=registry)(indexer(kind))

    # -- ServingPool ----------------------------------------------------------------------

    # Events, not kopf's create/update/resume handlers: those PATCH their bookkeeping onto
    # every pool (see changes.py); the runtime retries a failed reconcile itself.
    pool_changes = changes.Changes()

    @kopf.on.event(GROUP, VERSION, "servingpools", id="servingpool-event", registry=registry)
    async def pool_event(type: str | None, body: Any, namespace: str | None, name: str,
                         **_: Any) -> None:
        if pool_changes.calls_for_reconcile(type, body):
            runtime = await state.synced()
            runtime.enqueue((namespace or "default", name))

    # -- ModelArtifact --------------------------------------------------------------------

    @kopf.on.create(GROUP, VERSION, "modelartifacts", id="modelartifact-create", registry=registry)
    @kopf.on.update(GROUP, VERSION, "modelartifacts", id="modelartifact-update", registry=registry)
    @kopf.on.resume(GROUP, VERSION, "modelartifacts", id="modelartifact-resume", registry=registry)
    async def artifact_changed(namespace: str | None, name: str, reason: str, **_: Any) -> None:
        runtime = state.get()
        await _handled(runtime.artifacts.trigger, (namespace or "default", name))
        if reason != "resume":  # on resume, every pool resumes by itself
            for key in runtime.pools_using(namespace or "default", name):
                state.reconcile_soon(key)

    @kopf.on.delete(GROUP, VERSION, "modelartifacts", id="modelartifact-delete", optional=True,
                    registry=registry)
    async def artifact_deleted(namespace: str | None, name: str, **_: Any) -> None:
        runtime = state.get()
        for key in runtime.pools_using(namespace or "default", name):
            state.reconcile_soon(key)

    # -- Rollout: its pool reconciles it (one writer of the pool's traffic table) ---------

    @kopf.on.create(GROUP, VERSION, "rollouts", id="rollout-create", registry=registry)
    @kopf.on.update(GROUP, VERSION, "rollouts", id="rollout-update", registry=registry)
    @kopf.on.resume(GROUP, VERSION, "rollouts", id="rollout-resume", registry=registry)
    async def rollout_changed(namespace: str | None, spec: Any, **_: Any) -> None:
        runtime = await state.synced()
        pool = (spec.get("poolRef") or {}).get("name")
        if isinstance(pool, str):
            await _handled(runtime.pools.trigger, (namespace or "default", pool))

    @kopf.on.delete(GROUP, VERSION, "rollouts", id="rollout-delete", optional=True,
                    registry=registry)
    async def rollout_deleted(namespace: str | None, name: str | None, spec: Any,
                              **_: Any) -> None:
        state.get()  # (not logged in yet: kopf tries again)
        metrics.forget_rollout(namespace or "default", name or "")
        pool = (spec.get("poolRef") or {}).get("name")
        if isinstance(pool, str):
            state.reconcile_soon((namespace or "default", pool))
