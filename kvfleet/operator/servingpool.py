"""The ServingPool reconciler: `reconcile(pool, artifact, observed) -> Plan`, pure.

Level-based: from what exists now (Observed) it computes the objects that should exist, which
of them must be (re)applied because they are missing or drifted, which old-revision
Deployments to delete, and the status to write. It never changes the pool's spec.

Revisions: each artifact manifest hash is served by its own Deployment. When the artifact
reference changes and no Rollout governs the pool, the new revision is created beside the old
one and the old one is deleted once the new one is fully ready (the Service spans both). When
a Rollout governs the pool, its decision (`kvfleet.operator.rollout`) says how many canary
replicas exist, the traffic table the routers follow and when the canary is promoted; the
serving revision's Deployment is then never re-applied, scaled or restarted.

Blocking problems (artifact missing, incompatible, does not fit the GPU) stop the creation of
a new revision but never delete what is already serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kvfleet.api import ModelArtifact, ServingPool, manifest_hash
from kvfleet.capacity import MemoryPlan, plan_for_pool
from kvfleet.compat import Matrix, check
from kvfleet.operator import builders, naming
from kvfleet.operator.conditions import Cond, merge_conditions
from kvfleet.operator.drift import has_drifted
from kvfleet.operator.placement import diagnose
from kvfleet.operator.rollout import ACTIVE
from kvfleet.operator.rollout import Decision as RolloutDecision


@dataclass(frozen=True)
class Observed:
    """What exists in the pool's namespace that belongs to the pool."""

    deployments: tuple[dict[str, Any], ...] = ()
    config_map: dict[str, Any] | None = None
    service: dict[str, Any] | None = None
    pdb: dict[str, Any] | None = None
    router_secret: dict[str, Any] | None = None
    network_policy: dict[str, Any] | None = None
    pods: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Plan:
    """What the handler does: apply, delete, write status, post events."""

    apply: tuple[dict[str, Any], ...] = ()
    delete: tuple[dict[str, Any], ...] = ()  # observed objects to delete
    status: dict[str, Any] = field(default_factory=dict)
    events: tuple[Event, ...] = ()


@dataclass(frozen=True)
class _Blocker:
    reason: str
    message: str


def _revision_of(deployment: dict[str, Any]) -> str | None:
    annotations = deployment.get("metadata", {}).get("annotations") or {}
    value = annotations.get(naming.MANIFEST_HASH_ANNOTATION)
    return value if isinstance(value, str) else None


def revision_deployment(observed: Observed, revision: str | None) -> dict[str, Any] | None:
    return next((d for d in observed.deployments
                 if revision is not None and _revision_of(d) == revision), None)


def revision_pods(observed: Observed, revision: str | None) -> list[dict[str, Any]]:
    return [
        p for p in observed.pods
        if revision is not None
        and (p.get("metadata", {}).get("labels") or {}).get(naming.REVISION_LABEL)
        == naming.short_revision(revision)
    ]


def ready_replicas(deployment: dict[str, Any] | None) -> int:
    return int(((deployment or {}).get("status") or {}).get("readyReplicas", 0))


def deployment_ready(deployment: dict[str, Any]) -> bool:
    """Rolled out and every desired replica ready (the Deployment controller caught up)."""
    spec, status = deployment.get("spec", {}), deployment.get("status") or {}
    want = int(spec.get("replicas", 1))
    generation = deployment.get("metadata", {}).get("generation", 0)
    return bool(
        status.get("observedGeneration", 0) >= generation
        and status.get("updatedReplicas", 0) >= want
        and status.get("readyReplicas", 0) >= want
        and status.get("replicas", 0) == want
    )


def _capacity(
    pool: ServingPool, artifact: ModelArtifact, matrix: Matrix
) -> tuple[MemoryPlan, Cond]:
    product = matrix.gpu_products.get(pool.spec.gpu.product)
    plan = plan_for_pool(artifact.spec, pool.spec, product.memory_bytes if product else None)
    seq = pool.spec.engine.max_model_length or artifact.spec.architecture.max_context_length
    if plan.fits is None:
        return plan, Cond(
            "CapacityOK", None, "MissingInputs", f"cannot plan: unknown {', '.join(plan.unknowns)}"
        )
    if not plan.fits:
        return plan, Cond(
            "CapacityOK",
            False,
            "DoesNotFit",
            f"{artifact.metadata.name} on {pool.spec.gpu.count}× {pool.spec.gpu.product}: weights "
            f"and workspace leave no room for one {seq}-token sequence of KV cache",
        )
    return plan, Cond(
        "CapacityOK",
        True,
        "Fits",
        f"{plan.kv_tokens_per_replica} KV tokens per replica: {plan.candidate_concurrency} "
        f"concurrent {seq}-token sequences",
    )


def _blocker(
    pool: ServingPool, artifact: ModelArtifact | None, matrix: Matrix, capacity: Cond | None
) -> _Blocker | None:
    ref = pool.spec.artifact_ref.name
    if artifact is None:
        return _Blocker("ArtifactNotFound", f"ModelArtifact {ref} does not exist in the namespace")
    problems = check(artifact.spec, pool.spec, matrix=matrix)
    if problems:
        return _Blocker("Incompatible", "; ".join(str(p) for p in problems))
    if capacity is not None and capacity.status is False:
        return _Blocker("InsufficientCapacity", capacity.message)
    return None


def target_problem(pool: ServingPool, artifact: ModelArtifact | None, matrix: Matrix) -> str | None:
    """Why the pool's artifactRef cannot be deployed (missing, incompatible, does not fit)."""
    capacity = None if artifact is None else _capacity(pool, artifact, matrix)[1]
    found = _blocker(pool, artifact, matrix, capacity)
    return None if found is None else f"{found.reason}: {found.message}"


def _desired(
    pool: ServingPool,
    artifact: ModelArtifact,
    revision: str,
    plan: MemoryPlan,
    options: builders.EngineOptions,
    router_token: str,
) -> list[dict[str, Any]]:
    return [
        builders.build_config_map(pool),
        builders.build_router_secret(pool, router_token),
        builders.build_deployment(pool, artifact, revision, plan, options),
        builders.build_service(pool),
        builders.build_pdb(pool),
        builders.build_network_policy(pool),
    ]


def _observed_for(obj: dict[str, Any], observed: Observed) -> dict[str, Any] | None:
    kind, name = obj["kind"], obj["metadata"]["name"]
    if kind == "Deployment":
        return next((d for d in observed.deployments if d["metadata"]["name"] == name), None)
    return {
        "ConfigMap": observed.config_map,
        "Service": observed.service,
        "PodDisruptionBudget": observed.pdb,
        "Secret": observed.router_secret,
        "NetworkPolicy": observed.network_policy,
    }[kind]


def reconcile(
    pool: ServingPool,
    artifact: ModelArtifact | None,
    observed: Observed,
    *,
    matrix: Matrix,
    now: datetime,
    options: builders.EngineOptions = builders.EngineOptions(),  # noqa: B008 (frozen)
    new_router_token: str = "",
    rollout: RolloutDecision | None = None,
) -> Plan:
    """`new_router_token`: the pool's router token if it has none yet (random, from the
    caller: this function stays pure); an existing token is kept. `rollout`: the decision of
    the Rollout that governs the pool, if one does."""
    previous = pool.status.to_wire() if pool.status is not None else {}
    generation = pool.metadata.generation
    plan, capacity = (None, None) if artifact is None else _capacity(pool, artifact, matrix)
    blocker = _blocker(pool, artifact, matrix, capacity)
    revision = manifest_hash(artifact.spec) if artifact is not None else None
    serving = previous.get("servingRevision")
    if rollout is not None and rollout.promote and rollout.status.canary_revision == revision:
        serving = revision  # promoted: from now on the canary is the revision that serves
    governed = rollout is not None and serving is not None and revision != serving

    apply: list[dict[str, Any]] = []
    events: list[Event] = []
    target: dict[str, Any] | None = None
    # (artifact is None implies a blocker; the explicit checks narrow the types.)
    if (
        blocker is None
        and artifact is not None
        and revision is not None
        and plan is not None
    ):
        created: list[str] = []
        token = builders.router_token_of(observed.router_secret) or new_router_token
        for desired in _desired(pool, artifact, revision, plan, options, token):
            if desired["kind"] == "Deployment" and governed:
                assert rollout is not None
                if rollout.canary_replicas is None:
                    continue
                desired["spec"]["replicas"] = rollout.canary_replicas
            current = _observed_for(desired, observed)
            name = f"{desired['kind']} {desired['metadata']['name']}"
            if current is None:
                apply.append(desired)
                created.append(name)
            elif (where := has_drifted(desired, current)) is not None:
                apply.append(desired)
                events.append(Event("Normal", "Restored", f"{name} drifted at {where}; restored"))
            if desired["kind"] == "Deployment" and not governed:
                target = current
        if created:
            # One event for the lot: events are apiserver writes too.
            events.insert(
                0,
                Event(
                    "Normal",
                    "Created",
                    f"{', '.join(created)} for revision {naming.short_revision(revision)}",
                ),
            )

    # Old revisions go only once the new one serves every replica.
    delete: list[dict[str, Any]] = []
    if governed:
        assert rollout is not None
        keep = {serving, revision if rollout.canary_replicas is not None else None}
        for old in observed.deployments:
            if _revision_of(old) not in keep:
                delete.append(old)
                events.append(Event("Normal", "CanaryRemoved",
                                    f"Deployment {old['metadata']['name']} deleted: the rollout "
                                    "no longer runs its revision"))
    elif target is not None and deployment_ready(target) and not apply:
        for old in observed.deployments:
            if _revision_of(old) != revision:
                delete.append(old)
                events.append(
                    Event(
                        "Normal",
                        "RevisionRetired",
                        f"Deployment {old['metadata']['name']} (revision "
                        f"{naming.short_revision(_revision_of(old) or '?')}) deleted: "
                        f"revision {naming.short_revision(revision or '')} is ready",
                    )
                )

    # Available follows the Deployment that serves: the target revision's, or while a new
    # revision is blocked or left to a Rollout, the one already serving.
    # (A governed canary being applied says nothing about the revision that serves.)
    target_drifted = not governed and any(a["kind"] == "Deployment" for a in apply)
    serving_deployment = (
        target
        if target is not None
        else next(
            (d for d in observed.deployments if serving is not None and _revision_of(d) == serving),
            None,
        )
    )
    ready = (
        serving_deployment is not None
        and deployment_ready(serving_deployment)
        and not target_drifted
    )
    if ready and target is not None:
        serving = revision
    elif serving is not None and not any(_revision_of(d) == serving for d in observed.deployments):
        serving = None

    num_replicas = sum(
        int((d.get("status") or {}).get("replicas", 0)) for d in observed.deployments
    )
    num_ready = sum(
        int((d.get("status") or {}).get("readyReplicas", 0)) for d in observed.deployments
    )
    # A governed canary's pods are the Rollout's to report; the pool keeps serving meanwhile.
    diagnosis = None if governed else diagnose(pool.spec, revision_pods(observed, revision))
    want = pool.spec.replicas

    decided: list[Cond] = []
    if blocker is not None:
        degraded = Cond("Degraded", True, blocker.reason, blocker.message)
    elif diagnosis is not None:
        degraded = Cond("Degraded", True, diagnosis.reason, diagnosis.message)
    else:
        degraded = Cond("Degraded", False, "AsExpected", "")
    if ready:
        available = Cond(
            "Available",
            True,
            "ScaledToZero" if want == 0 else "ReplicasReady",
            f"{num_ready}/{want} replicas ready, revision {naming.short_revision(serving or '')}",
        )
    else:
        available = Cond(
            "Available",
            False,
            degraded.reason if degraded.status else "ReplicasNotReady",
            f"{num_ready}/{want} replicas ready"
            + (f": {degraded.message}" if degraded.status else ""),
        )
    if blocker is not None:
        progressing = Cond("Progressing", False, "Blocked", blocker.message)
    elif governed:
        assert rollout is not None
        phase = rollout.status.phase
        progressing = Cond("Progressing", phase in ACTIVE and phase.value != "Paused",
                           f"Rollout{phase.value}", rollout.status.message)
    elif ready:
        progressing = Cond("Progressing", False, "Complete", "")
    else:
        progressing = Cond(
            "Progressing",
            True,
            "RollingOut",
            f"revision {naming.short_revision(revision or '')}: {num_ready}/{want} replicas ready",
        )
    decided += [available, progressing]
    if capacity is not None:
        decided.append(capacity)
    decided += [degraded, Cond("Ready", available.status, available.reason, available.message)]

    for cond in (degraded,):
        old = next((c for c in previous.get("conditions", []) if c.get("type") == "Degraded"), {})
        if cond.status and (old.get("reason") != cond.reason or old.get("status") != "True"):
            events.append(Event("Warning", cond.reason, cond.message))

    status: dict[str, Any] = {
        "replicas": num_replicas,
        "readyReplicas": num_ready,
        "conditions": merge_conditions(previous.get("conditions", []), decided, generation, now),
    }
    if plan is not None:
        status["capacity"] = plan.to_status().to_wire()
    if serving is not None:
        status["servingRevision"] = serving
    if governed and rollout is not None and rollout.traffic:
        status["traffic"] = [t.to_wire() for t in rollout.traffic]
    if generation is not None:
        status["observedGeneration"] = generation
    return Plan(apply=tuple(apply), delete=tuple(delete), status=status, events=tuple(events))


def with_apply_failure(status: dict[str, Any], message: str, *, now: datetime) -> dict[str, Any]:
    """`status` with Degraded=True, reason ApplyFailed: the apiserver refused an owned object."""
    conditions = merge_conditions(
        status.get("conditions", []),
        [Cond("Degraded", True, "ApplyFailed", message)],
        status.get("observedGeneration"),
        now,
    )
    order = {c["type"]: i for i, c in enumerate(status.get("conditions", []))}
    conditions.sort(key=lambda c: order.get(c["type"], len(order)))
    return {**status, "conditions": conditions}
