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

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kvfleet.api import ModelArtifact, ServingPool, manifest_hash
from kvfleet.api.labels import engine_server_name
from kvfleet.capacity import MemoryPlan, plan_for_pool
from kvfleet.compat import Matrix, check
from kvfleet.operator import builders, naming, refusals, revisions
from kvfleet.operator.autoscaler import Report as AutoscaleReport
from kvfleet.operator.builders import EngineCertificate
from kvfleet.operator.conditions import Cond, merge_conditions
from kvfleet.operator.drift import has_drifted
from kvfleet.operator.engine_tls import issue_engine_certificate, wanted_certificate
from kvfleet.operator.events import Event
from kvfleet.operator.placement import Diagnosis, diagnose
from kvfleet.operator.rollout import ACTIVE
from kvfleet.operator.rollout import Decision as RolloutDecision


@dataclass(frozen=True)
class Observed:
    """What exists in the pool's namespace that belongs to the pool."""

    deployments: tuple[dict[str, Any], ...] = ()
    service: dict[str, Any] | None = None
    pdb: dict[str, Any] | None = None
    router_secret: dict[str, Any] | None = None
    network_policy: dict[str, Any] | None = None
    pods: tuple[dict[str, Any], ...] = ()
    # Short revision -> the fewest KV blocks its engines report having allocated; None when
    # not measured (no Prometheus).
    kv_blocks: dict[str, int] | None = None


@dataclass(frozen=True)
class Plan:
    """What the handler does: apply, delete, write status, post events."""

    apply: tuple[dict[str, Any], ...] = ()
    delete: tuple[dict[str, Any], ...] = ()  # observed objects to delete
    # Old-revision Deployments to scale down (replicas) while a new revision replaces them.
    scale: tuple[tuple[dict[str, Any], int], ...] = ()
    status: dict[str, Any] = field(default_factory=dict)
    events: tuple[Event, ...] = ()


@dataclass(frozen=True)
class _Blocker:
    reason: str
    message: str


def revision_of(deployment: dict[str, Any]) -> str | None:
    annotations = deployment.get("metadata", {}).get("annotations") or {}
    value = annotations.get(naming.REVISION_ANNOTATION,
                            annotations.get(naming.MANIFEST_HASH_ANNOTATION))
    return value if isinstance(value, str) else None


def revision_deployment(observed: Observed, revision: str | None) -> dict[str, Any] | None:
    return next((d for d in observed.deployments
                 if revision is not None and revision_of(d) == revision), None)


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
    plan: MemoryPlan,
    options: builders.EngineOptions,
    router_token: str,
    tls: EngineCertificate | None = None,
) -> list[dict[str, Any]]:
    return [
        builders.build_router_secret(pool, router_token, tls),
        builders.build_deployment(pool, artifact, plan, options),
        builders.build_service(pool),
        builders.build_pdb(pool),
        builders.build_network_policy(pool, options),
    ]


def _observed_for(obj: dict[str, Any], observed: Observed) -> dict[str, Any] | None:
    kind, name = obj["kind"], obj["metadata"]["name"]
    if kind == "Deployment":
        return next((d for d in observed.deployments if d["metadata"]["name"] == name), None)
    return {
        "Service": observed.service,
        "PodDisruptionBudget": observed.pdb,
        "Secret": observed.router_secret,
        "NetworkPolicy": observed.network_policy,
    }[kind]


@dataclass(frozen=True)
class _Rollover:
    """How a new revision replaces the old ones when no Rollout governs the pool."""

    new_replicas: int
    old_replicas: tuple[tuple[dict[str, Any], int], ...]  # (old Deployment, replicas it keeps)
    mode: str  # said in the Progressing condition
    replacing: bool  # old replicas go before new ones come (no GPU to spare)


REPLACING = "ReplacingReplicas"


def _rollover(pool: ServingPool, observed: Observed, revision: str, serving: str | None,
              kept: tuple[str, int] | None, new_ready: int, unschedulable: bool,
              previous: dict[str, Any]) -> _Rollover | None:
    """Sizes of the new and old revisions for this reconcile, or None (no old revision).

    With `reserves.deployment` (S) replicas to spare, the new revision grows S at a time
    beside the old (all at once when S covers the pool). Without, it tries one extra replica;
    if that pod finds no GPU, the old revision gives up `max(1, reserves.failover)` replicas
    (the PodDisruptionBudget's allowance) before each new one comes, so a change never waits
    for a GPU that does not exist. Old replicas only ever go down during a change."""
    old = [d for d in observed.deployments
           if revision_of(d) not in (revision, kept[0] if kept else None)]
    if not old:
        return None
    want, spare = pool.spec.replicas, pool.spec.reserves.deployment
    budget = max(1, pool.spec.reserves.failover)
    old.sort(key=lambda d: (revision_of(d) != serving, str(d["metadata"]["name"])))
    old_spec = sum(int(d.get("spec", {}).get("replicas", 0)) for d in old)
    was_replacing = any(c.get("type") == "Progressing" and c.get("reason") == REPLACING
                        for c in previous.get("conditions", []))
    replacing = spare == 0 and (unschedulable or was_replacing)
    if spare >= want:
        new, keep = want, old_spec
        mode = f"a full second revision (reserves.deployment {spare} >= {want} replicas)"
    elif replacing:
        new = min(want, new_ready + budget)
        keep = min(old_spec, max(0, want - new))
        mode = (f"replacing replicas {budget} at a time (no free GPU and no "
                "reserves.deployment)")
    else:
        surge = spare or 1
        new = min(want, new_ready + surge)
        keep = min(old_spec, want + surge - new)
        mode = (f"surging {surge} at a time (reserves.deployment)" if spare else
                "surging 1 at a time (no reserves.deployment: replicas are replaced instead "
                "if the new one finds no GPU)")
    sizes: list[tuple[dict[str, Any], int]] = []
    for deployment in old:
        current = int(deployment.get("spec", {}).get("replicas", 0))
        sizes.append((deployment, min(current, keep)))
        keep -= min(current, keep)
    return _Rollover(new, tuple(sizes), mode, replacing)


def _replace_in_place(pool: ServingPool, diagnosis: Any, previous: dict[str, Any],
                      current: dict[str, Any] | None) -> bool:
    """A rolling update of the revision's own Deployment that cannot surge: its new pod finds
    no GPU (or did, until this update finishes) and the pool keeps no deployment reserve."""
    if pool.spec.reserves.deployment > 0 or current is None or deployment_ready(current) \
            or ready_replicas(current) == 0:  # nothing serves yet: nothing to give up
        return False
    was = any(c.get("type") == "Progressing" and c.get("reason") == REPLACING
              for c in previous.get("conditions", []))
    return was or (diagnosis is not None and diagnosis.reason == "Unschedulable")


@dataclass(frozen=True)
class _Facts:
    """What a reconcile of one pool decides from: computed once, read by each step."""

    pool: ServingPool
    previous: dict[str, Any]  # the pool's status as last written
    revision: str | None  # the manifest hash of spec.artifactRef's artifact
    serving: str | None  # the revision that serves (servingRevision, or a promoted canary)
    governed: bool  # a Rollout moves a canary of `revision` in beside `serving`
    rollout: RolloutDecision | None
    blocker: _Blocker | None
    diagnosis: Diagnosis | None  # what is wrong with the revision's pods, if anything
    rollover: _Rollover | None
    memory: refusals.Memory
    autoscaling: AutoscaleReport | None = None
    # The revision that served before a promotion, kept without traffic for an undo, and the
    # replicas it keeps (kvfleet.operator.rollout: keepPreviousSeconds).
    kept: tuple[str, int] | None = None


@dataclass
class _Children:
    apply: list[dict[str, Any]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    target: dict[str, Any] | None = None  # the revision's Deployment as observed
    replacing_in_place: bool = False


def reconcile(
    pool: ServingPool,
    artifact: ModelArtifact | None,
    observed: Observed,
    *,
    matrix: Matrix,
    now: datetime,
    options: builders.EngineOptions = builders.EngineOptions(),  # noqa: B008 (frozen)
    new_router_token: str = "",
    new_engine_certificate: Callable[[str], EngineCertificate] = issue_engine_certificate,
    rollout: RolloutDecision | None = None,
    rollout_name: str = "",
    serving_artifact: ModelArtifact | None = None,
    autoscaling: AutoscaleReport | None = None,
) -> Plan:
    """`new_router_token`: the pool's router token if it has none yet (random, from the
    caller: this function stays pure); an existing token is kept. `new_engine_certificate`:
    issues one (engine TLS), called only when the pool has none or it is due for renewal.
    `rollout`: the decision of the Rollout (`rollout_name`) that governs the pool, if one does.
    `serving_artifact`: the artifact of status.servingArtifact, to recreate the stable
    Deployment of a governed pool if someone deleted it.
    `autoscaling`: the autoscaler's last decision for the pool, if it made one."""
    previous = pool.status.to_wire() if pool.status is not None else {}
    plan, capacity = (None, None) if artifact is None else _capacity(pool, artifact, matrix)
    blocker = _blocker(pool, artifact, matrix, capacity)
    revision = None if artifact is None else revisions.parts_of(
        pool, manifest_hash(artifact.spec), options.image).revision
    serving = previous.get("servingRevision")
    if serving is None and rollout is not None and revision_deployment(
            observed, rollout.status.stable_revision) is not None:
        # The pool's status was lost (a restore): the Rollout still knows what is stable, and
        # the canary must not roll over ungoverned.
        serving = rollout.status.stable_revision
    if rollout is not None and rollout.promote and rollout.status.canary_revision == revision:
        serving = revision  # promoted: from now on the canary is the revision that serves
    if rollout is not None and rollout.demote is not None and \
            revision_deployment(observed, rollout.demote[0]) is not None:
        serving = rollout.demote[0]  # undone after promotion: the kept revision serves again
    kept = rollout.keep if rollout is not None else None
    governed = rollout is not None and serving is not None and revision != serving
    memory = refusals.remember(pool, revision=revision, serving=serving, rollout=rollout,
                               rollout_name=rollout_name, now=now)
    refused = memory.of(revision)
    if blocker is None and refused is not None and revision != serving and not governed:
        # (Governed, the Rollout holds it back itself: its own RolledBack, or a target the
        # runtime showed it as blocked; the RevisionRefused condition says which.)
        blocker = _Blocker("RevisionRefused", refusals.describe(refused))
    # A governed canary's pods are the Rollout's to report; the pool keeps serving meanwhile.
    diagnosis = None if governed else diagnose(pool.spec, revision_pods(observed, revision))
    rollover = None
    if not governed and revision is not None and blocker is None:
        rollover = _rollover(
            pool, observed, revision, serving, kept,
            ready_replicas(revision_deployment(observed, revision)),
            diagnosis is not None and diagnosis.reason == "Unschedulable", previous)
    facts = _Facts(pool, previous, revision, serving, governed, rollout, blocker, diagnosis,
                   rollover, memory, autoscaling, kept)
    # (artifact is None implies a blocker; the explicit checks narrow the types.)
    children = _Children()
    if blocker is None and artifact is not None and revision is not None and plan is not None:
        token = builders.router_token_of(observed.router_secret) or new_router_token
        tls = None
        if options.tls:
            tls = wanted_certificate(
                builders.engine_certificate_of(observed.router_secret),
                engine_server_name(pool.metadata.name, pool.metadata.namespace or ""), now,
                new_engine_certificate)
        children = _children(
            facts, _desired(pool, artifact, plan, options, token, tls), observed)
    if governed:
        _restore_stable(facts, serving_artifact, observed, children, matrix, options)
    delete, scale, events = _retire(facts, observed, children)
    status, warnings = _status(facts, observed, children, plan, capacity, now)
    return Plan(apply=tuple(children.apply), delete=tuple(delete), status=status,
                events=(*memory.events, *children.events, *events, *warnings),
                scale=tuple(scale))


def _restore_stable(facts: _Facts, serving_artifact: ModelArtifact | None, observed: Observed,
                    children: _Children, matrix: Matrix, options: builders.EngineOptions) -> None:
    """A governed pool whose stable Deployment is gone (deleted by hand, lost in a restore)
    gets it back: a missing stable must never turn the canary into the pool's only revision,
    unanalysed. It is rebuilt from the spec with its artifact, so only when the rollout changes
    the artifact alone (the spec no longer holds the stable's image or settings otherwise);
    else, or without its artifact, it stays missing and servingRevision stays put."""
    serving = facts.serving
    if serving is None or revision_deployment(observed, serving) is not None or \
            serving_artifact is None or revisions.parts_of(
                facts.pool, manifest_hash(serving_artifact.spec), options.image).revision \
            != serving:
        return
    plan = _capacity(facts.pool, serving_artifact, matrix)[0]
    stable = builders.build_deployment(facts.pool, serving_artifact, plan, options)
    children.apply.append(stable)
    children.events.append(Event(
        "Normal", "Restored", f"Deployment {stable['metadata']['name']} of the stable revision "
        f"{naming.short_revision(serving)} was missing mid-rollout; recreated"))


def _children(facts: _Facts, desired_objects: list[dict[str, Any]],
              observed: Observed) -> _Children:
    """The owned objects to apply: missing ones, drifted ones; the revision's Deployment
    sized by the Rollout (governed), the rollover, or rolled in place."""
    pool, rollout, out = facts.pool, facts.rollout, _Children()
    created: list[str] = []
    for desired in desired_objects:
        if desired["kind"] == "Deployment" and facts.governed:
            assert rollout is not None
            if rollout.canary_replicas is None:
                continue
            desired["spec"]["replicas"] = rollout.canary_replicas
        elif desired["kind"] == "Deployment" and facts.rollover is not None:
            desired["spec"]["replicas"] = facts.rollover.new_replicas
        elif desired["kind"] == "Deployment" and _replace_in_place(
                pool, facts.diagnosis, facts.previous, _observed_for(desired, observed)):
            # A change that is no new revision (resources, drain time, pod labels) rolls within
            # the revision's Deployment: with no GPU for a surge pod and
            # no reserve, the Deployment gives up replicas within the disruption budget.
            desired["spec"]["strategy"]["rollingUpdate"] = {
                "maxSurge": 0, "maxUnavailable": max(1, pool.spec.reserves.failover)}
            out.replacing_in_place = True
        current = _observed_for(desired, observed)
        name = f"{desired['kind']} {desired['metadata']['name']}"
        if current is None:
            out.apply.append(desired)
            created.append(name)
        elif (where := has_drifted(desired, current)) is not None:
            out.apply.append(desired)
            out.events.append(Event("Normal", "Restored", f"{name} drifted at {where}; restored"))
        if desired["kind"] == "Deployment" and not facts.governed:
            out.target = current
    if created:
        # One event for the lot: events are apiserver writes too.
        out.events.insert(0, Event(
            "Normal", "Created",
            f"{', '.join(created)} for revision {naming.short_revision(facts.revision or '')}"))
    return out


def _retire(facts: _Facts, observed: Observed, children: _Children
            ) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], int]], list[Event]]:
    """Old revisions shrink as the new one grows (`_rollover`) and go once it serves every
    replica; a governed pool keeps only the serving revision and the Rollout's canary; a
    refused revision keeps nothing, whoever made its Deployment (a Rollout deleted mid-way)."""
    delete: list[dict[str, Any]] = []
    events: list[Event] = []
    target, revision, kept = children.target, facts.revision, facts.kept
    keep = {facts.serving, kept[0] if kept else None}
    if facts.governed:
        assert facts.rollout is not None
        keep.add(revision if facts.rollout.canary_replicas is not None else None)
    for old in observed.deployments:
        old_revision = revision_of(old)
        if old_revision in keep:
            continue
        if facts.memory.of(old_revision) is not None:
            delete.append(old)
            events.append(Event("Normal", "RefusedRemoved", f"Deployment "
                                f"{old['metadata']['name']} deleted: its revision is refused"))
        elif facts.governed:
            delete.append(old)
            events.append(Event("Normal", "CanaryRemoved",
                                f"Deployment {old['metadata']['name']} deleted: the rollout "
                                "no longer runs its revision"))
    if not facts.governed and target is not None and deployment_ready(target) and \
            not children.apply and \
            int(target.get("spec", {}).get("replicas", 0)) == facts.pool.spec.replicas:
        for old in observed.deployments:
            if revision_of(old) not in (revision, kept[0] if kept else None) and \
                    old not in delete:
                delete.append(old)
                events.append(Event(
                    "Normal", "RevisionRetired",
                    f"Deployment {old['metadata']['name']} (revision "
                    f"{naming.short_revision(revision_of(old) or '?')}) deleted: "
                    f"revision {naming.short_revision(revision or '')} is ready"))
    scale: list[tuple[dict[str, Any], int]] = []
    stable = revision_deployment(observed, facts.serving) if facts.governed else None
    if stable is not None and stable not in delete:
        assert facts.rollout is not None
        # Stable follows the pool's count while governed too (a load ramp mid-rollout grew
        # only the canary); an autoscaled pool's count is shared with the canary.
        size = facts.rollout.stable_replicas
        size = facts.pool.spec.replicas if size is None else size
        if int(stable.get("spec", {}).get("replicas", 0)) != size:
            scale.append((stable, size))
            events.append(Event("Normal", "ScaledStable", f"Deployment "
                                f"{stable['metadata']['name']} (stable) to {size} of the pool's "
                                f"{facts.pool.spec.replicas} replicas during the rollout"))
    previous = revision_deployment(observed, kept[0]) if kept else None
    current = int(previous.get("spec", {}).get("replicas", 0)) if previous is not None else 0
    if kept and previous is not None and current > kept[1]:
        # (Down only: an autoscaled pool's stable may have had fewer at the last step.)
        scale.append((previous, kept[1]))
        events.append(Event("Normal", "KeptPrevious", f"Deployment "
                            f"{previous['metadata']['name']} (the revision that served before "
                            f"the promotion) to {kept[1]}, without traffic: `kvfleet rollout "
                            "undo` goes back to it"))
    if facts.rollover is not None and not delete:
        for old, size in facts.rollover.old_replicas:
            if int(old.get("spec", {}).get("replicas", 0)) != size:
                scale.append((old, size))
                events.append(Event("Normal", "ScaledDown", f"Deployment "
                                    f"{old['metadata']['name']} to {size}: "
                                    f"{facts.rollover.mode}"))
    return delete, scale, events


def _status(facts: _Facts, observed: Observed, children: _Children, plan: MemoryPlan | None,
            capacity: Cond | None, now: datetime) -> tuple[dict[str, Any], list[Event]]:
    """The pool's status (replicas, servingRevision, conditions, traffic) and the Warning
    for a Degraded condition that is new."""
    pool, target, revision, serving = facts.pool, children.target, facts.revision, facts.serving
    # Available follows the Deployment that serves: the target revision's, or while a new
    # revision is blocked or left to a Rollout, the one already serving.
    # (A governed canary being applied says nothing about the revision that serves.)
    target_drifted = not facts.governed and any(a["kind"] == "Deployment"
                                                for a in children.apply)
    serving_deployment = target if target is not None else next(
        (d for d in observed.deployments if serving is not None and revision_of(d) == serving),
        None)
    ready = (
        serving_deployment is not None
        and deployment_ready(serving_deployment)
        and not target_drifted
        # A new revision serves once it has the whole pool, not a step of the way.
        and (target is None or int(target.get("spec", {}).get("replicas", 0)) == pool.spec.replicas)
    )
    if ready and target is not None:
        serving = revision
    elif serving is not None and not facts.governed and \
            not any(revision_of(d) == serving for d in observed.deployments):
        serving = None  # (governed, a missing stable is recreated: it stays the one serving)
    # (The kept previous revision serves nothing: an autoscaler reading /scale must not
    # count it.)
    counted = [d for d in observed.deployments
               if facts.kept is None or revision_of(d) != facts.kept[0]]
    num_replicas = sum(int((d.get("status") or {}).get("replicas", 0)) for d in counted)
    num_ready = sum(int((d.get("status") or {}).get("readyReplicas", 0)) for d in counted)
    want = pool.spec.replicas
    # Available: serving at least the minimum the disruption budget allows (whichever
    # revisions serve it); `ready` (the new revision serves the whole pool) moves
    # servingRevision.
    minimum = 0 if want == 0 else max(1, want - max(1, pool.spec.reserves.failover))
    serving_now = ready or (serving is not None and num_ready >= minimum)
    available, progressing, degraded = _conditions(facts, ready, serving_now, serving,
                                                   num_ready, children.replacing_in_place)
    allocation = _allocation(plan, observed, serving, num_ready)
    refused = refusals.condition(facts.memory, revision)
    decided = [available, progressing, *([capacity] if capacity is not None else []),
               *([allocation] if allocation is not None else []),
               *([refused] if refused is not None else []), degraded,
               Cond("Ready", available.status, available.reason, available.message),
               *_autoscaling_conditions(facts.autoscaling)]
    previous_conditions = [c for c in facts.previous.get("conditions", [])
                           if pool.spec.autoscaling is not None
                           or c.get("type") not in AUTOSCALING_CONDITIONS]
    old: dict[str, Any] = next((c for c in facts.previous.get("conditions", [])
                                if c.get("type") == "Degraded"), {})
    warnings = [Event("Warning", degraded.reason, degraded.message)] if degraded.status and (
        old.get("reason") != degraded.reason or old.get("status") != "True") else []
    generation = pool.metadata.generation
    status: dict[str, Any] = {
        "replicas": num_replicas,
        "readyReplicas": num_ready,
        "selector": ",".join(f"{k}={v}" for k, v in
                             sorted(naming.pool_selector(pool.metadata.name).items())),
        "conditions": merge_conditions(previous_conditions, decided, generation, now),
    }
    if pool.spec.autoscaling is not None:
        shown = _autoscaling_status(facts.autoscaling) or facts.previous.get("autoscaling")
        if shown:
            status["autoscaling"] = shown
    if plan is not None:
        status["capacity"] = plan.to_status().to_wire()
    if revision is not None:
        status["revision"] = revision
    if serving is not None:
        status["servingRevision"] = serving
        serving_artifact = pool.spec.artifact_ref.name if serving == revision else \
            facts.rollout.demote[1] if facts.rollout is not None and facts.rollout.demote \
            and facts.rollout.demote[0] == serving else facts.previous.get("servingArtifact")
        if serving_artifact:
            status["servingArtifact"] = serving_artifact
    if facts.governed and facts.rollout is not None and facts.rollout.traffic:
        status["traffic"] = [t.to_wire() for t in facts.rollout.traffic]
        if facts.rollout.synthetic is not None:
            status["syntheticTraffic"] = facts.rollout.synthetic.to_wire()
    status.update(facts.memory.to_wire())
    if generation is not None:
        status["observedGeneration"] = generation
    return status, warnings


AUTOSCALING_CONDITIONS = ("AutoscalingActive", "ScalingLimited")


def _autoscaling_conditions(report: AutoscaleReport | None) -> list[Cond]:
    """AutoscalingActive and ScalingLimited, from the autoscaler's last decision (none before
    its first: the previous ones stay)."""
    if report is None:
        return []
    decision = report.decision
    active = Cond("AutoscalingActive", True, "SignalsFresh",
                  f"{decision.desired} replicas: {decision.signal}"
                  + (f" ({decision.message})" if decision.message else "")) \
        if decision.active else Cond("AutoscalingActive", False, "SignalsMissing",
                                     decision.why_inactive)
    if decision.limited:
        limited = Cond("ScalingLimited", True, "Unschedulable", decision.why_limited)
    elif decision.scaling_limited:
        limited = Cond("ScalingLimited", True, f"{decision.signal.capitalize()}Replicas",
                       decision.message)
    else:
        limited = Cond("ScalingLimited", False, "WithinBounds", "")
    return [active, limited]


def _autoscaling_status(report: AutoscaleReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    decision = report.decision
    status: dict[str, Any] = {"desiredReplicas": decision.desired, "signal": decision.signal,
                              "message": (decision.message or decision.why_inactive)[:1024]}
    if report.last_scale_time is not None:
        status["lastScaleTime"] = report.last_scale_time
    return status


def _allocation(plan: MemoryPlan | None, observed: Observed, serving: str | None,
                num_ready: int) -> Cond | None:
    """KVCacheAsPlanned: whether the serving revision's engines allocated the KV blocks the
    plan gave them (a node with less memory than its product's, another process on the GPU,
    a pinned count lowered by hand all show here). None when there is nothing to compare."""
    planned = plan.kv_blocks_per_rank if plan is not None else None
    if planned is None or observed.kv_blocks is None or serving is None or not num_ready:
        return None
    revision = naming.short_revision(serving)
    allocated = observed.kv_blocks.get(revision)
    if allocated is None:
        return Cond("KVCacheAsPlanned", None, "NoData", f"no engine of revision {revision} "
                    "has reported kvfleet_engine_kv_cache_blocks to Prometheus yet")
    if allocated < planned:
        return Cond("KVCacheAsPlanned", False, "BelowPlan",
                    f"an engine of revision {revision} allocated {allocated} KV blocks, the "
                    f"plan is {planned}: fewer concurrent sequences than planned (its log's "
                    "memory ledger says where the memory went)")
    return Cond("KVCacheAsPlanned", True, "AsPlanned",
                f"every engine of revision {revision} allocated at least the planned "
                f"{planned} KV blocks")


def _conditions(facts: _Facts, ready: bool, serving_now: bool, serving: str | None,
                num_ready: int, replacing_in_place: bool) -> tuple[Cond, Cond, Cond]:
    """Available, Progressing and Degraded (`replacing_in_place`: the revision's Deployment
    rolls within its disruption budget, no surge)."""
    want, rollover, blocker = facts.pool.spec.replicas, facts.rollover, facts.blocker
    replacing = replacing_in_place or (rollover is not None and rollover.replacing)
    diagnosis = facts.diagnosis
    if diagnosis is not None and diagnosis.reason == "Unschedulable" and replacing:
        diagnosis = None  # being handled: old replicas make room for the new ones
    if blocker is not None:
        degraded = Cond("Degraded", True, blocker.reason, blocker.message)
    elif diagnosis is not None:
        degraded = Cond("Degraded", True, diagnosis.reason, diagnosis.message)
    else:
        degraded = Cond("Degraded", False, "AsExpected", "")
    if serving_now:
        available = Cond(
            "Available", True, "ScaledToZero" if want == 0 else "ReplicasReady",
            f"{num_ready}/{want} replicas ready, revision {naming.short_revision(serving or '')}")
    else:
        available = Cond(
            "Available", False, degraded.reason if degraded.status else "ReplicasNotReady",
            f"{num_ready}/{want} replicas ready"
            + (f": {degraded.message}" if degraded.status else ""))
    if blocker is not None:
        progressing = Cond("Progressing", False, "Blocked", blocker.message)
    elif facts.governed:
        assert facts.rollout is not None
        phase = facts.rollout.status.phase
        progressing = Cond("Progressing", phase in ACTIVE and phase.value != "Paused",
                           f"Rollout{phase.value}", facts.rollout.status.message)
    elif ready:
        progressing = Cond("Progressing", False, "Complete", "")
    else:
        progressing = Cond(
            "Progressing", True, REPLACING if replacing else "RollingOut",
            f"revision {naming.short_revision(facts.revision or '')}: {num_ready}/{want} "
            "replicas ready"
            + (f"; {rollover.mode}" if rollover is not None else
               "; replacing replicas within the disruption budget (no free GPU and no "
               "reserves.deployment)" if replacing_in_place else ""))
    return available, progressing, degraded


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
