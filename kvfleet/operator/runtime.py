"""The I/O edge of the reconcilers: read what exists, call the pure reconciler, carry out its
plan. kopf handlers (kvfleet.operator.handlers) only decide *when* these run.

Reads per ServingPool reconcile: the pool, its artifact, its Deployments (by label), its
ConfigMap, Service and PDB; its pods only while the serving Deployment is not fully ready; the
namespace's Rollouts only while the artifact differs from the serving revision. Writes happen
only for what drifted and for a status that changed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from kvfleet.api import ModelArtifact, ServingPool, manifest_hash
from kvfleet.compat import Matrix
from kvfleet.operator import metrics, naming
from kvfleet.operator.builders import EngineOptions
from kvfleet.operator.coalesce import Coalescer
from kvfleet.operator.kube import JsonObj, KubeApi, KubeError
from kvfleet.operator.modelartifact import reconcile_artifact
from kvfleet.operator.servingpool import (
    Event,
    Observed,
    deployment_ready,
    reconcile,
    with_apply_failure,
)

log = logging.getLogger("kvfleet.operator")
Key = tuple[str, str]  # (namespace, name)


class InvalidObjectError(ValueError):
    """An object the apiserver accepted but the API models reject (e.g. no webhook installed)."""


@dataclass
class Runtime:
    """Everything a reconcile needs besides the object: client, matrix, engine options."""

    api: KubeApi
    matrix: Matrix
    options: EngineOptions = field(default_factory=EngineOptions)
    pools: Coalescer[Key] = field(init=False)
    artifacts: Coalescer[Key] = field(init=False)

    max_concurrent: int = 10
    _slots: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        # Like controller-runtime's MaxConcurrentReconciles: a burst of new pools queues here
        # instead of all crowding the apiserver at once, so each reconcile finishes quickly.
        self._slots = asyncio.Semaphore(self.max_concurrent)
        self.pools = Coalescer(self._timed("ServingPool", self.reconcile_pool))
        self.artifacts = Coalescer(self._timed("ModelArtifact", self.reconcile_artifact))

    def _timed(self, kind: str, fn: Any) -> Any:
        async def run(key: Key) -> None:
            queued = time.perf_counter()
            async with self._slots:
                started = time.perf_counter()
                metrics.QUEUE_SECONDS.labels(kind=kind).observe(started - queued)
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

        return run

    # -- ServingPool ----------------------------------------------------------------------

    async def _observe(self, pool: ServingPool, artifact: ModelArtifact | None) -> Observed:
        ns, name = pool.metadata.namespace or "default", pool.metadata.name
        deployments, config_map, service, pdb = await asyncio.gather(
            self.api.list("Deployment", ns, naming.selector_string(naming.pool_selector(name))),
            self.api.get("ConfigMap", ns, naming.config_map_name(name)),
            self.api.get("Service", ns, naming.service_name(name)),
            self.api.get("PodDisruptionBudget", ns, naming.pdb_name(name)),
        )
        owned = tuple(d for d in deployments if _owned_by(d, pool))
        pods: list[JsonObj] = []
        if not owned or not all(deployment_ready(d) for d in owned):
            pods = await self.api.list(
                "Pod", ns, naming.selector_string(naming.pool_selector(name))
            )
        serving = pool.status.serving_revision if pool.status else None
        rollouts: tuple[str, ...] = ()
        if artifact is not None and serving is not None and manifest_hash(artifact.spec) != serving:
            rollouts = tuple(
                r["metadata"]["name"]
                for r in await self.api.list("Rollout", ns)
                if (r.get("spec", {}).get("poolRef") or {}).get("name") == name
            )
        return Observed(
            deployments=owned,
            config_map=config_map if config_map and _owned_by(config_map, pool) else None,
            service=service if service and _owned_by(service, pool) else None,
            pdb=pdb if pdb and _owned_by(pdb, pool) else None,
            pods=tuple(pods),
            rollouts=rollouts,
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
        raw = await self.api.get("ServingPool", ns, name)
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            self.pools.forget(key)
            return
        pool = _parse(ServingPool, raw)
        raw_artifact = await self.api.get("ModelArtifact", ns, pool.spec.artifact_ref.name)
        artifact = _parse(ModelArtifact, raw_artifact) if raw_artifact else None
        observed = await self._observe(pool, artifact)
        plan = reconcile(
            pool, artifact, observed, matrix=self.matrix, now=_now(), options=self.options
        )
        # The objects are independent (a pod waits for its ConfigMap), so the writes go out
        # together: one round trip of latency instead of one per object.
        outcomes = await asyncio.gather(
            *(self.api.apply(obj) for obj in plan.apply), return_exceptions=True
        )
        failures: list[tuple[str, KubeError]] = []
        for obj, outcome in zip(plan.apply, outcomes, strict=True):
            if isinstance(outcome, KubeError) and not outcome.gone:
                failures.append((f"{obj['kind']} {obj['metadata']['name']}", outcome))
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                metrics.OBJECTS_APPLIED.labels(kind=obj["kind"]).inc()
        await asyncio.gather(
            *(
                self.api.delete(
                    obj["kind"], ns, obj["metadata"]["name"], obj["metadata"].get("uid")
                )
                for obj in plan.delete
            )
        )
        status, events = plan.status, list(plan.events)
        if failures:
            # The pool says what the apiserver refused (e.g. a full Service IP range) instead
            # of keeping a status that hides it; the error also makes kopf retry.
            message = "; ".join(f"{what}: {exc}" for what, exc in failures)
            status = with_apply_failure(status, message, now=_now())
            events.append(Event("Warning", "ApplyFailed", message))
        await asyncio.gather(
            self._write_status("ServingPool", raw, status),
            *(self._post_event(raw, event) for event in events),
        )
        if failures:
            raise failures[0][1]

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
        raw = await self.api.get("ModelArtifact", ns, name)
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            self.artifacts.forget(key)
            return
        artifact = _parse(ModelArtifact, raw)
        status = reconcile_artifact(artifact, matrix=self.matrix, now=_now())
        previous = raw.get("status") or {}
        await self._write_status("ModelArtifact", raw, status)
        if previous.get("manifestHash") != status["manifestHash"]:
            await self._post_event(
                raw, Event("Normal", "Hashed", f"manifest hash {status['manifestHash']}")
            )
        for cond in status["conditions"]:
            old: JsonObj = next(
                (c for c in previous.get("conditions", []) if c["type"] == cond["type"]), {}
            )
            if cond["status"] == "False" and old.get("reason") != cond["reason"]:
                await self._post_event(raw, Event("Warning", cond["reason"], cond["message"]))

    async def pools_using(self, namespace: str, artifact: str) -> list[Key]:
        return [
            (namespace, p["metadata"]["name"])
            for p in await self.api.list("ServingPool", namespace)
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
        await self.api.patch_status(kind, meta["namespace"], meta["name"], patch)

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


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def _owned_by(obj: JsonObj, pool: ServingPool) -> bool:
    """Only children whose controller reference is this very pool (by uid) count as observed."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == pool.metadata.uid and r.get("controller") for r in refs)


def _parse(cls: type[ServingPool] | type[ModelArtifact], raw: JsonObj) -> Any:
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        meta = raw.get("metadata", {})
        raise InvalidObjectError(
            f"{raw.get('kind')} {meta.get('namespace')}/{meta.get('name')} does not match the "
            f"kvfleet.io/v1alpha1 schema (is the validating webhook installed?): {exc}"
        ) from exc
