"""The I/O edge of the reconcilers: read what exists, call the pure reconciler, carry out its
plan. kopf handlers (kvfleet.operator.handlers) only decide *when* these run.

Reads come from `cache.Cache` (what kopf's watches delivered), not from the apiserver: the
pool, its artifact, its Rollout, its Deployments, Service, PDB and engine pods.
Writes go out together, in one round trip of latency: the applies of what is missing or
drifted, deletes of retired revisions, the status if it changed, and the events. A reconcile
where nothing drifted and nothing changed sends no request at all.

A pool with a Rollout reconciles in two stages: the Rollout's decision first (after querying
Prometheus for the analysis window that is due), written to the Rollout's status before
anything else, then the pool's reconcile, which carries it out. So the Rollout's status is the
truth a restarted operator resumes from, and what the pool shows follows from it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
from pydantic import ValidationError

from kvfleet.api import ModelArtifact, Rollout, ServingPool, manifest_hash
from kvfleet.api.analysis import overall
from kvfleet.api.rollout import REQUEST_ANNOTATION, Phase, RolloutRequest, RolloutStatus
from kvfleet.compat import Matrix
from kvfleet.kube.api import JsonObj, KubeApi, KubeError
from kvfleet.operator import metrics, naming, refusals, revisions, waves
from kvfleet.operator.autoscaler import (
    DEFAULT_INTERVAL_SECONDS,
    Autoscaler,
    FleetSignals,
    PoolView,
    signals_query,
)
from kvfleet.operator.builders import EngineOptions
from kvfleet.operator.cache import Cache
from kvfleet.operator.coalesce import Coalescer
from kvfleet.operator.events import Event
from kvfleet.operator.modelartifact import reconcile_artifact
from kvfleet.operator.placement import diagnose, restarts, unschedulable_since
from kvfleet.operator.promquery import PromQuery, Target
from kvfleet.operator.rollout import (
    SHADOW_STEP,
    View,
    baseline_window,
    decide,
    due_window,
    metric_plans,
)
from kvfleet.operator.rollout import Decision as RolloutDecision
from kvfleet.operator.servingpool import (
    Observed,
    deployment_ready,
    ready_replicas,
    reconcile,
    revision_deployment,
    revision_of,
    revision_pods,
    target_problem,
    with_apply_failure,
)
from kvfleet.operator.slots import Slots

log = logging.getLogger("kvfleet.operator")
Key = tuple[str, str]  # (namespace, name)


# What the engines allocated, per pool revision (see Runtime.kv_blocks).
KV_BLOCKS_QUERY = ("min by (namespace, kvfleet_io_pool, kvfleet_io_revision) "
                   "(kvfleet_engine_kv_cache_blocks)")
KV_BLOCKS_TTL_SECONDS = 30.0
# A pool whose reconcile failed is tried again after these many seconds (the n-th failure in
# a row waits the n-th, then the last): controller-runtime's rate-limited requeue.
RETRY_SECONDS = (5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0)


class InvalidObjectError(ValueError):
    """An object the apiserver accepted but the API models reject (e.g. no webhook installed)."""


@dataclass
class Runtime:
    """Everything a reconcile needs besides the object: client, cache, matrix, engine options."""

    api: KubeApi
    cache: Cache
    matrix: Matrix
    options: EngineOptions = field(default_factory=EngineOptions)
    prometheus: PromQuery = field(default_factory=lambda: PromQuery(None))
    pools: Coalescer[Key] = field(init=False)
    artifacts: Coalescer[Key] = field(init=False)

    max_concurrent: int = 10
    max_concurrent_rollouts: int = waves.DEFAULT_MAX_CONCURRENT
    autoscale_interval: float = DEFAULT_INTERVAL_SECONDS
    autoscaler: Autoscaler = field(init=False)
    _slots: Slots = field(init=False)

    def __post_init__(self) -> None:
        # Like controller-runtime's MaxConcurrentReconciles: a burst of new pools queues here
        # instead of all crowding the apiserver at once, so each reconcile finishes quickly;
        # a pool with a decision to carry out (`urgent`) goes ahead of the burst.
        self._slots = Slots(self.max_concurrent)
        self._urgent: dict[Key, float] = {}  # pools with a decision to carry out: since when
        self._autoscaled: dict[Key, tuple[str | None, PoolView]] = {}
        self._wakeups: dict[Key, asyncio.TimerHandle] = {}
        self._woken: set[asyncio.Task[None]] = set()
        self._failures: dict[Key, int] = {}  # pools failing: how many times in a row
        self._enqueued: set[Key] = set()  # runs asked for whose task has not started yet
        self._invalid: dict[Key, str] = {}  # pools the models reject: what was announced
        self._wave_admitted: dict[Key, str] = {}  # pool -> the wave it was let into
        self.pools = Coalescer(self._timed("ServingPool", self.reconcile_pool))
        self.artifacts = Coalescer(self._timed("ModelArtifact", self.reconcile_artifact))
        self._kv_blocks: tuple[float, dict[Key, dict[str, int]] | None] = (-1e18, None)
        self._kv_lock = asyncio.Lock()
        self.autoscaler = Autoscaler(
            self.fleet_signals, self._set_replicas,
            lambda key, scaled: self.wake(key, 0, urgent=scaled), self._post_event_of,
            self.autoscale_interval, unplaced=lambda key: unschedulable_since(
                self.cache.pods(key[0], naming.label_value(key[1]))))

    def _timed(self, kind: str, fn: Any) -> Any:
        async def run(key: Key) -> None:
            queued = time.perf_counter()
            pool = kind == "ServingPool"  # (only a pool's decisions are urgent)
            urgent = await self._slots.acquire(pool and key in self._urgent,
                                               key if pool else None)
            marked = self._urgent.pop(key, queued) if pool else queued
            try:
                started = time.perf_counter()
                lane = "urgent" if urgent else "bulk"
                # (an urgent run waited from when the decision was taken, if it came later)
                waited = started - (max(queued, marked) if urgent else queued)
                metrics.QUEUE_SECONDS.labels(kind=kind, lane=lane).observe(waited)
                metrics.RECONCILES.labels(kind=kind).inc()
                try:
                    await fn(key)
                except Exception:
                    metrics.RECONCILE_ERRORS.labels(kind=kind).inc()
                    raise
                finally:
                    metrics.RECONCILE_SECONDS.labels(kind=kind).observe(
                        time.perf_counter() - started
                    )
            finally:
                self._slots.release()

        return run

    # -- ServingPool ----------------------------------------------------------------------

    def rollout_of(self, namespace: str, pool: str) -> JsonObj | None:
        """The Rollout governing the pool: the oldest whose poolRef names it."""
        found = [r for r in self.cache.objects("Rollout", namespace)
                 if (r.get("spec", {}).get("poolRef") or {}).get("name") == pool
                 and not r["metadata"].get("deletionTimestamp")]
        found.sort(key=lambda r: (str(r["metadata"].get("creationTimestamp", "")),
                                  str(r["metadata"]["name"])))
        return found[0] if found else None

    def pool_of_rollout(self, namespace: str, rollout: str) -> Key | None:
        raw = self.cache.get("Rollout", namespace, rollout)
        name = ((raw or {}).get("spec", {}).get("poolRef") or {}).get("name")
        return (namespace, name) if isinstance(name, str) else None

    def wake(self, key: Key, seconds: float, urgent: bool = True) -> None:
        """Reconcile the pool again in `seconds` (the earliest request wins), by default in
        the urgent lane: a decision (the autoscaler's, a Rollout's) waits to be carried
        out."""
        loop = asyncio.get_running_loop()
        when = loop.time() + seconds
        handle = self._wakeups.get(key)
        if handle is not None and not handle.cancelled() and handle.when() <= when:
            if urgent:  # (the earlier run is the one that carries the decision out)
                self._urgent.setdefault(key, time.perf_counter())
            return
        if handle is not None:
            handle.cancel()

        def fire() -> None:
            self._wakeups.pop(key, None)
            if urgent:
                self._urgent.setdefault(key, time.perf_counter())
                self._slots.promote(key)
            self.enqueue(key)

        self._wakeups[key] = loop.call_at(when, fire)

    def enqueue(self, key: Key) -> None:
        """Reconcile the pool in the background, and again after a back-off while it fails
        (`RETRY_SECONDS`): controller-runtime's workqueue. The pools' watch events come here
        (handlers.py), so kopf never retries, and never writes, a pool.

        A run that has not started yet covers the request: every request comes here (or
        from kopf, which retries its own), so that run retries as this one would, and a pool
        queued behind a burst gathers no task per watch event (at 5,000 pools, 30,000 waiting
        tasks of ~4 KB each after three minutes)."""
        if key in self._enqueued or self.pools.pending(key):
            return
        self._enqueued.add(key)
        task = asyncio.get_running_loop().create_task(self._reconcile_retried(key))
        self._woken.add(task)
        task.add_done_callback(self._woken.discard)

    async def _reconcile_retried(self, key: Key) -> None:
        self._enqueued.discard(key)  # (from here the Coalescer says it is pending)
        try:
            await self.pools.trigger(key)
        except InvalidObjectError as exc:
            # Nothing to try again until the object changes (which enqueues it again). Said
            # once: the drift loop finds it invalid again every interval.
            self._failures.pop(key, None)
            if self._invalid.get(key) == str(exc):
                return
            self._invalid[key] = str(exc)
            log.warning("%s", exc)
            try:
                await self._post_event_of(key, Event("Warning", "InvalidSpec", str(exc)))
            except (KubeError, aiohttp.ClientError, TimeoutError) as error:
                log.warning("event for %s/%s not posted: %s", key[0], key[1], error)
        except Exception as exc:
            tries = self._failures[key] = self._failures.get(key, 0) + 1
            delay = RETRY_SECONDS[min(tries, len(RETRY_SECONDS)) - 1]
            log.warning("reconcile of %s/%s failed (%s); trying again in %.0f s",
                        key[0], key[1], exc, delay)
            self.wake(key, delay, urgent=False)
        else:
            self._failures.pop(key, None)
            self._invalid.pop(key, None)

    async def _rollout(self, raw_rollout: JsonObj, pool: ServingPool,
                       artifact: ModelArtifact | None, observed: Observed) -> RolloutDecision:
        """The Rollout's decision, its analysis queried first; its status is written here."""
        rollout = _parse(Rollout, raw_rollout)
        ns, name = pool.metadata.namespace or "default", pool.metadata.name
        request, request_error = None, None
        text = (rollout.metadata.annotations or {}).get(REQUEST_ANNOTATION)
        if text:
            try:
                request = RolloutRequest.parse(text)
            except ValueError as exc:
                request_error = str(exc)
        problem = target_problem(pool, artifact, self.matrix)
        parts = None if artifact is None else revisions.parts_of(
            pool, manifest_hash(artifact.spec), self.options.image)
        wanted = parts.revision if parts is not None else None
        if problem is None and wanted is not None:
            refused = refusals.refused_for_rollout(pool, wanted,
                                                   rollout.status or RolloutStatus(), request)
            if refused is not None:
                problem = f"RevisionRefused: {refusals.describe(refused)}"
        target = wanted if problem is None else None
        serving = revision_deployment(observed, pool.status.serving_revision if pool.status
                                      else None)
        serving_parts = revisions.parts_of_deployment(serving) if serving is not None else None
        wave, held = self._wave(pool, serving, serving_parts,
                                parts if target is not None else None)
        pods = revision_pods(observed, target)
        diagnosis = diagnose(pool.spec, pods) if pods else None
        restart_count, restarted = restarts(pods)
        view = View(
            spec=rollout.spec, status=rollout.status or RolloutStatus(),
            generation=rollout.metadata.generation, request=request,
            pool_replicas=pool.spec.replicas, slos=pool.spec.slos,
            stable=pool.status.serving_revision if pool.status else None,
            target=target, target_artifact=pool.spec.artifact_ref.name, blocked=problem,
            target_change="" if parts is None else _OLDER if serving is not None and
            serving_parts is None else revisions.describe_change(
                serving_parts, parts, pool.spec.artifact_ref.name),
            wave=wave, held=held,
            canary_ready=ready_replicas(revision_deployment(observed, target)),
            canary_problem=diagnosis.message if diagnosis is not None else None,
            surge_limit=None if (scaling := pool.spec.autoscaling) is None else
            scaling.max_replicas + scaling.rollout_surge,
            canary_restarts=restart_count, canary_restarted=restarted,
            stable_artifact=pool.status.serving_artifact or "" if pool.status else "",
            previous_ready=ready_replicas(revision_deployment(
                observed, (rollout.status or RolloutStatus()).previous_revision)),
            deployed=frozenset(r for d in observed.deployments
                               if (r := revision_of(d)) is not None))
        now = _now()
        window = due_window(view, now)
        results = None
        if window is not None and view.status.canary_revision and view.status.stable_revision:
            target_ = Target(pool=name, namespace=ns, canary=view.status.canary_revision,
                             stable=view.status.stable_revision,
                             traffic="shadow" if window.step == SHADOW_STEP else "live")
            results = await self.prometheus.evaluate(
                metric_plans(rollout.spec, pool.spec.slos, window.step), window, target_,
                baseline_window(view.status, window))
        decision = decide(view, window, results, now)
        events = list(decision.events)
        if request_error is not None:
            events.append(Event("Warning", "BadRequest", request_error))
        # The status first, its events (and the analysis count) only once it landed: an
        # operator killed, or a write refused, in between decides again from the old status
        # and posts them then, so no transition ("Promoted") is announced or counted twice.
        await self._write_status("Rollout", raw_rollout, decision.status.to_wire())
        if results is not None:
            metrics.ANALYSES.labels(outcome=overall(results).value).inc()
        await asyncio.gather(*(self._post_event(raw_rollout, e) for e in events))
        for phase in Phase:
            metrics.ROLLOUT_PHASE.labels(namespace=ns, rollout=rollout.metadata.name,
                                         phase=phase.value).set(phase == decision.status.phase)
        metrics.ROLLOUT_STEP.labels(namespace=ns, rollout=rollout.metadata.name).set(
            decision.status.current_step if decision.status.current_step is not None else -2)
        metrics.ROLLOUT_WEIGHT.labels(namespace=ns, rollout=rollout.metadata.name).set(
            decision.status.current_weight)
        if decision.requeue_seconds is not None:
            self.wake((ns, name), decision.requeue_seconds)
        return decision

    def _wave(self, pool: ServingPool, serving: JsonObj | None,
              serving_parts: revisions.RevisionParts | None,
              target: revisions.RevisionParts | None) -> tuple[str | None, str | None]:
        """The fleet wave a pool's target belongs to, and why it waits (kvfleet.operator.waves).
        An admission counts at once, before its Rollout's status says so: reconciles run
        side by side, and each must see the places the others took."""
        key = (pool.metadata.namespace or "default", pool.metadata.name)
        wave = None if target is None or serving is None else waves.wave_of(
            pool.spec.pod.image, revisions.image_of_deployment(serving), target.image,
            self.options.image, serving_has_parts=serving_parts is not None)
        if wave is None:
            self._wave_admitted.pop(key, None)
            return None, None
        members: list[tuple[Key, RolloutStatus]] = []
        for ns, name in self.cache.keys("Rollout"):
            raw = self.cache.get("Rollout", ns, name)
            try:
                rollout = Rollout.model_validate(raw)
            except ValueError:
                continue  # (the Rollout's own reconcile reports it)
            members.append(((ns, rollout.spec.pool_ref.name), rollout.status or RolloutStatus()))
        governed = {k for k, _ in members}
        shown = {k for k, status in members if status.wave == wave}
        members += [(k, RolloutStatus(phase=Phase.PROGRESSING, wave=wave))
                    for k, w in self._wave_admitted.items()
                    if w == wave and k in governed and k not in shown]
        held = waves.hold(key, wave, members, self.max_concurrent_rollouts)
        if held is None:
            self._wave_admitted[key] = wave
        return wave, held

    async def _observe(self, pool: ServingPool, artifact: ModelArtifact | None) -> Observed:
        ns, name = pool.metadata.namespace or "default", pool.metadata.name
        uid = pool.metadata.uid or ""
        deployments = sorted(
            self.cache.owned("Deployment", ns, uid), key=lambda d: str(d["metadata"]["name"])
        )
        pods: list[JsonObj] = []
        if not deployments or not all(deployment_ready(d) for d in deployments):
            pods = self.cache.pods(ns, naming.label_value(name))
        allocated = await self.kv_blocks()
        return Observed(
            kv_blocks=None if allocated is None else allocated.get(
                (ns, naming.label_value(name)), {}),
            deployments=tuple(deployments),
            service=self._owned_named("Service", ns, uid, naming.service_name(name)),
            pdb=self._owned_named("PodDisruptionBudget", ns, uid, naming.pdb_name(name)),
            router_secret=self._owned_named("Secret", ns, uid, naming.router_secret_name(name)),
            network_policy=self._owned_named("NetworkPolicy", ns, uid,
                                             naming.network_policy_name(name)),
            pods=tuple(pods),
        )

    async def kv_blocks(self) -> dict[Key, dict[str, int]] | None:
        """(namespace, pool label) -> short revision -> the fewest KV blocks an engine of it
        allocated, from Prometheus (`kvfleet_engine_kv_cache_blocks`, labelled by the pods'
        pool and revision labels); one query for every pool, at most every
        KV_BLOCKS_TTL_SECONDS. None without Prometheus or when the query fails (logged)."""
        if self.prometheus.url is None:
            return None
        async with self._kv_lock:
            at, found = self._kv_blocks
            if time.monotonic() - at < KV_BLOCKS_TTL_SECONDS:
                return found
            try:
                found = {}
                for m, value in await self.prometheus.vector(KV_BLOCKS_QUERY):
                    pool = (m.get("namespace", ""), m.get("kvfleet_io_pool", ""))
                    found.setdefault(pool, {})[m.get("kvfleet_io_revision", "")] = int(value)
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as error:
                log.warning("KV allocations not read from Prometheus: %s", error)
                found = None
            self._kv_blocks = (time.monotonic(), found)
            return found

    # -- autoscaling ----------------------------------------------------------------------

    async def fleet_signals(self) -> FleetSignals:
        """Every pool's autoscaling signals: one query (`autoscaler.signals_query`)."""
        now = time.time()
        if self.prometheus.url is None:
            return FleetSignals(now, error="the operator has no Prometheus to read load from "
                                "(start it with --prometheus-url)")
        try:
            rows = await self.prometheus.vector(signals_query())
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as error:
            log.warning("autoscaling signals not read from Prometheus: %s", error)
            return FleetSignals(now, error=f"Prometheus did not answer the signals query "
                                f"({type(error).__name__}: {error})")
        return FleetSignals.parse(rows, now)

    def autoscaled_pools(self) -> list[PoolView]:
        """The cached pools with spec.autoscaling, as the autoscaler reads them (each read
        again only when its resourceVersion changed)."""
        pools, views = [], {}
        for key in self.cache.keys("ServingPool"):
            raw = self.cache.get("ServingPool", *key)
            if raw is None or raw["metadata"].get("deletionTimestamp"):
                continue
            version = raw["metadata"].get("resourceVersion")
            view = self._autoscaled.get(key)
            if view is None or view[0] != version:
                try:
                    found = PoolView.of(raw)  # (None: not autoscaled)
                except ValidationError as exc:
                    log.debug("%s/%s not autoscaled: %s", *key, exc)
                    continue
                if found is None:
                    continue
                view = (version, found)
            views[key] = view
            pools.append(view[1])
        self._autoscaled = views
        return pools

    async def _set_replicas(self, key: Key, replicas: int) -> None:
        """The pool's spec.replicas (a merge patch of that field only, like a /scale write)."""
        self.cache.wrote(await self.api.patch("ServingPool", key[0], key[1],
                                              {"spec": {"replicas": replicas}}))

    async def _post_event_of(self, key: Key, event: Event) -> None:
        raw = self.cache.get("ServingPool", *key)
        if raw is not None:
            await self._post_event(raw, event)

    def _owned_named(self, kind: str, ns: str, uid: str, name: str) -> JsonObj | None:
        return next(
            (o for o in self.cache.owned(kind, ns, uid) if o["metadata"]["name"] == name), None
        )

    async def reconcile_pool(self, key: Key) -> None:
        try:
            await self._reconcile_pool(key)
        except KubeError as exc:
            if not exc.gone:
                raise
            log.debug("ServingPool %s/%s is going away: %s", key[0], key[1], exc)

    async def _reconcile_pool(self, key: Key) -> None:
        ns, name = key
        raw = self.cache.get("ServingPool", ns, name)
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            return
        pool = _parse(ServingPool, raw)
        raw_artifact = self.cache.get("ModelArtifact", ns, pool.spec.artifact_ref.name)
        artifact = _parse(ModelArtifact, raw_artifact) if raw_artifact else None
        observed = await self._observe(pool, artifact)
        raw_rollout = self.rollout_of(ns, name)
        serving_artifact = None
        serving_name = pool.status.serving_artifact if pool.status is not None else None
        if raw_rollout is not None and serving_name:
            raw_serving = self.cache.get("ModelArtifact", ns, serving_name)
            serving_artifact = _parse(ModelArtifact, raw_serving) if raw_serving else None
        decision = None
        if raw_rollout is not None:
            decision = await self._rollout(raw_rollout, pool, artifact, observed)
        plan = reconcile(
            pool, artifact, observed, matrix=self.matrix, now=_now(), options=self.options,
            new_router_token=secrets.token_hex(24), rollout=decision,
            rollout_name=raw_rollout["metadata"]["name"] if raw_rollout is not None else "",
            serving_artifact=serving_artifact,
            autoscaling=self.autoscaler.report(key),
        )
        # Every write is independent of the others (a pod waits for its Secret by itself;
        # the status describes what was decided, and is corrected below if an apply fails),
        # so they go out together: one round trip of latency instead of one per object.
        applies = [self._apply(obj) for obj in plan.apply]
        outcomes = await asyncio.gather(
            *applies,
            *(self._delete(obj) for obj in plan.delete),
            *(self._scale(obj, replicas) for obj, replicas in plan.scale),
            self._write_status("ServingPool", raw, plan.status),
            *(self._post_event(raw, event) for event in plan.events),
            return_exceptions=True,
        )
        failures: list[tuple[str, KubeError]] = []
        errors: list[BaseException] = []
        for index, outcome in enumerate(outcomes):
            if not isinstance(outcome, BaseException):
                continue
            if index < len(applies) and isinstance(outcome, KubeError):
                if not outcome.gone:  # gone: the namespace is being deleted, nothing to do
                    obj = plan.apply[index]
                    failures.append((f"{obj['kind']} {obj['metadata']['name']}", outcome))
                continue
            errors.append(outcome)
        if errors:
            raise errors[0]
        if failures:
            # The pool says what the apiserver refused (e.g. a full Service IP range) instead
            # of keeping a status that hides it; the error also makes kopf retry.
            message = "; ".join(f"{what}: {exc}" for what, exc in failures)
            current = self.cache.get("ServingPool", ns, name) or raw
            await asyncio.gather(
                self._write_status(
                    "ServingPool", current, with_apply_failure(plan.status, message, now=_now())
                ),
                self._post_event(raw, Event("Warning", "ApplyFailed", message)),
            )
            raise failures[0][1]

    async def _apply(self, obj: JsonObj) -> None:
        self.cache.wrote(await self.api.apply(obj))
        metrics.OBJECTS_APPLIED.labels(kind=obj["kind"]).inc()

    async def _scale(self, obj: JsonObj, replicas: int) -> None:
        """An old revision's Deployment to `replicas` (a merge patch of spec.replicas only: the
        operator never re-applies an old revision's whole object)."""
        meta = obj["metadata"]
        self.cache.wrote(await self.api.patch("Deployment", meta["namespace"], meta["name"],
                                              {"spec": {"replicas": replicas}}))

    async def _delete(self, obj: JsonObj) -> None:
        meta = obj["metadata"]
        await self.api.delete(obj["kind"], meta["namespace"], meta["name"], meta.get("uid"))
        self.cache.deleted(obj)

    # -- ModelArtifact --------------------------------------------------------------------

    async def reconcile_artifact(self, key: Key) -> None:
        try:
            await self._reconcile_artifact(key)
        except KubeError as exc:
            if not exc.gone:
                raise
            log.debug("ModelArtifact %s/%s is going away: %s", key[0], key[1], exc)

    async def _reconcile_artifact(self, key: Key) -> None:
        ns, name = key
        raw = self.cache.get("ModelArtifact", ns, name)
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            return
        artifact = _parse(ModelArtifact, raw)
        status = reconcile_artifact(artifact, matrix=self.matrix, now=_now())
        previous = raw.get("status") or {}
        events: list[Event] = []
        if previous.get("manifestHash") != status["manifestHash"]:
            events.append(Event("Normal", "Hashed", f"manifest hash {status['manifestHash']}"))
        for cond in status["conditions"]:
            old: JsonObj = next(
                (c for c in previous.get("conditions", []) if c["type"] == cond["type"]), {}
            )
            warning = Event("Warning", cond["reason"], cond["message"])
            # Ready repeats the failing condition's reason and message: one event, not two.
            if cond["status"] == "False" and old.get("reason") != cond["reason"] and \
                    warning not in events:
                events.append(warning)
        await asyncio.gather(
            self._write_status("ModelArtifact", raw, status),
            *(self._post_event(raw, event) for event in events),
        )

    def pools_using(self, namespace: str, artifact: str) -> list[Key]:
        return [
            (namespace, p["metadata"]["name"])
            for p in self.cache.objects("ServingPool", namespace)
            if (p.get("spec", {}).get("artifactRef") or {}).get("name") == artifact
        ]

    # -- writes ---------------------------------------------------------------------------

    async def _write_status(self, kind: str, raw: JsonObj, status: JsonObj) -> None:
        previous = raw.get("status") or {}
        if previous == status:
            return
        # A merge patch keeps keys it does not mention: clear the ones that went away.
        patch: JsonObj = {**{k: None for k in previous if k not in status}, **status}
        meta = raw["metadata"]
        try:
            written = await self.api.patch_status(kind, meta["namespace"], meta["name"], patch)
        except KubeError as exc:
            if exc.status == 404:  # deleted while the watch was away: stop serving it
                self.cache.gone(raw)
            raise
        self.cache.wrote(written)

    async def _post_event(self, raw: JsonObj, event: Event) -> None:
        meta = raw["metadata"]
        stamp = _now().strftime("%Y-%m-%dT%H:%M:%SZ")
        await self.api.create(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": {
                    "apiVersion": raw["apiVersion"],
                    "kind": raw["kind"],
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "uid": meta.get("uid"),
                    "resourceVersion": meta.get("resourceVersion"),
                },
                "reason": event.reason,
                "message": event.message[:1024],
                "type": event.type,
                "source": {"component": naming.MANAGED_BY},
                "reportingComponent": naming.MANAGED_BY,
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
                "count": 1,
            }
        )


# What a canary changes when the stable Deployment is an older operator's, which did not record
# its image and settings as parts of its revision (its revision was the manifest hash alone).
_OLDER = "stable was built by an older operator: rebuilt with image and settings in its revision"


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def _owned_by(obj: JsonObj, pool: ServingPool) -> bool:
    """Only children whose controller reference is this very pool (by uid) count as observed."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == pool.metadata.uid and r.get("controller") for r in refs)


def _parse(cls: type[ServingPool] | type[ModelArtifact] | type[Rollout], raw: JsonObj) -> Any:
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        meta = raw.get("metadata", {})
        raise InvalidObjectError(
            f"{raw.get('kind')} {meta.get('namespace')}/{meta.get('name')} does not match the "
            f"kvfleet.io/v1alpha1 schema (is the validating webhook installed?): {exc}"
        ) from exc
