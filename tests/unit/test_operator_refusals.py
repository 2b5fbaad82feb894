"""The pool remembers the revisions it refused: a deleted Rollout, a revert or a new Rollout
does not send them traffic; a person's retry does (kvfleet.operator.refusals)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

from operator_fakes import NOW, artifact, as_observed, pool, revision

from kvfleet.api import ModelArtifact, ServingPool
from kvfleet.api.builders import make_artifact
from kvfleet.api.rollout import Phase, RequestAction, RolloutRequest, RolloutStatus
from kvfleet.api.servingpool import (
    MAX_REFUSED,
    RETRY_ANNOTATION,
    RefusalReason,
    RefusedRevision,
    TrafficRole,
    TrafficTarget,
)
from kvfleet.compat import default_matrix
from kvfleet.operator import refusals
from kvfleet.operator.rollout import Decision
from kvfleet.operator.servingpool import Observed, Plan, reconcile

MATRIX = default_matrix()
GOOD, BAD = artifact(), make_artifact("qwen3-8b").set("metadata.uid", "uid-2").set(
    "spec.engineVersions.min", "0.1.0").obj()
GOOD_REV, BAD_REV = revision(GOOD), revision(BAD)


def _run(p: ServingPool, a: ModelArtifact, observed: Observed, **kw: Any) -> Plan:
    return reconcile(p, a, observed, matrix=MATRIX, now=kw.pop("now", NOW),
                     new_router_token="t" * 48, **kw)


def _cond(plan: Plan, kind: str) -> dict[str, Any] | None:
    return next((c for c in plan.status["conditions"] if c["type"] == kind), None)


def _next(p: ServingPool, plan: Plan, **annotations: str) -> ServingPool:
    """The pool as the next reconcile reads it: this plan's status, the given annotations."""
    data = p.to_wire()
    data["status"] = plan.status
    if annotations:
        data["metadata"]["annotations"] = annotations
    return ServingPool.model_validate(data)


def _serving_good() -> tuple[ServingPool, Observed]:
    """A pool serving GOOD, converged."""
    p = pool()
    first = _run(p, GOOD, Observed())
    objs = {o["kind"]: as_observed(o) for o in first.apply}
    observed = Observed(deployments=(objs["Deployment"],),
                        service=objs["Service"], pdb=objs["PodDisruptionBudget"],
                        router_secret=objs["Secret"], network_policy=objs["NetworkPolicy"])
    return _next(p, _run(p, GOOD, observed)), observed


def _decision(phase: Phase, *, weight: int = 0, canary: int | None = None,
              retried: bool = False, message: str = "") -> Decision:
    status = RolloutStatus(phase=phase, stable_revision=GOOD_REV, canary_revision=BAD_REV,
                           canary_artifact=BAD.metadata.name, current_weight=weight,
                           message=message or f"{phase.value} at weight {weight}%")
    traffic = [TrafficTarget(revision=GOOD_REV, role=TrafficRole.STABLE, weight=100 - weight)]
    if weight:
        traffic.append(TrafficTarget(revision=BAD_REV, role=TrafficRole.CANARY, weight=weight))
    return Decision(status=status, traffic=traffic if canary else [], canary_replicas=canary,
                    retried=retried)


def _rolled_back() -> tuple[ServingPool, Observed, Plan]:
    """GOOD serving, BAD rolled back by Rollout `policy`: the plan of that reconcile."""
    p, observed = _serving_good()
    plan = _run(p, BAD, observed, rollout_name="policy",
                rollout=_decision(Phase.ROLLED_BACK, message="ttft canary/stable 4.1 > 1.5"))
    return _next(p, plan), observed, plan


def test_a_rolled_back_revision_stays_out_when_its_rollout_is_deleted() -> None:
    p, observed, plan = _rolled_back()
    [entry] = plan.status["refusedRevisions"]
    assert (entry["revision"], entry["reason"], entry["rollout"]) == (
        BAD_REV, "RolledBack", "policy")
    assert "ttft canary/stable 4.1 > 1.5" in entry["message"]
    assert [e.reason for e in plan.events if e.type == "Warning"] == ["RevisionRefused"]
    # The Rollout is deleted (a policy file removed from Git); the artifactRef still names BAD.
    warnings = []
    for _ in range(2):  # and stays so on every later reconcile
        after = _run(p, BAD, observed)
        assert not [o for o in after.apply if o["kind"] == "Deployment"], "a pod for BAD"
        assert after.status["servingRevision"] == GOOD_REV
        refused = _cond(after, "RevisionRefused")
        assert refused is not None and refused["status"] == "True"
        assert refused["reason"] == "RolledBack" and "kvfleet rollout retry" in refused["message"]
        degraded = _cond(after, "Degraded")
        assert degraded is not None and degraded["reason"] == "RevisionRefused"
        warnings += [e for e in after.events if e.type == "Warning"]
        p = _next(p, after)
    # The pool turning Degraded is said once, not on every reconcile.
    assert [e.reason for e in warnings] == ["RevisionRefused"]


def test_a_rollout_deleted_midway_freezes_the_pool_on_stable() -> None:
    p, observed = _serving_good()
    halfway = _run(p, BAD, observed, rollout_name="policy",
                   rollout=_decision(Phase.PROGRESSING, weight=50, canary=1))
    [canary] = [o for o in halfway.apply if o["kind"] == "Deployment"]
    assert "refusedRevisions" not in halfway.status
    with_canary = replace(observed, deployments=(*observed.deployments, as_observed(canary)))
    frozen = _run(_next(p, halfway), BAD, with_canary)
    assert [d["metadata"]["name"] for d in frozen.delete] == [canary["metadata"]["name"]]
    assert not [o for o in frozen.apply if o["kind"] == "Deployment"]
    assert "traffic" not in frozen.status and frozen.status["servingRevision"] == GOOD_REV
    [entry] = frozen.status["refusedRevisions"]
    assert entry["reason"] == "RolloutDeleted" and "weight 50%" in entry["message"]


def test_a_new_artifact_after_the_refusal_rolls_over_as_an_ungoverned_pool() -> None:
    p, observed, _ = _rolled_back()
    other = make_artifact("qwen3-8b").set("metadata.uid", "uid-3").set(
        "spec.engineVersions.min", "0.0.9").obj()
    plan = _run(p, other, observed)
    assert [o["kind"] for o in plan.apply] == ["Deployment"]
    refused = _cond(plan, "RevisionRefused")
    assert refused is not None and refused["status"] == "False"


def test_the_retry_annotation_clears_the_refusal_once() -> None:
    p, observed, _ = _rolled_back()
    value = f"{BAD_REV[:12]}@1"
    retried = _run(_next(p, _run(p, BAD, observed), **{RETRY_ANNOTATION: value}), BAD, observed)
    assert "refusedRevisions" not in retried.status
    assert retried.status["handledRetry"] == value
    assert [e.reason for e in retried.events if e.reason == "RevisionRetried"] == [
        "RevisionRetried"]
    assert [o["kind"] for o in retried.apply] == ["Deployment"]  # rolls over to it now
    # Refused again later: the same annotation, still there, does not clear it a second time.
    again = _next(p, _run(p, BAD, observed, rollout_name="policy",
                          rollout=_decision(Phase.ROLLED_BACK)), **{RETRY_ANNOTATION: value})
    data = again.to_wire()
    data["status"]["handledRetry"] = value
    again = ServingPool.model_validate(data)
    still = _run(again, BAD, observed)
    assert [r["revision"] for r in still.status["refusedRevisions"]] == [BAD_REV]
    # A prefix too short to name one revision clears nothing.
    short = _run(_next(again, still, **{RETRY_ANNOTATION: BAD_REV[:6]}), BAD, observed)
    assert [r["revision"] for r in short.status["refusedRevisions"]] == [BAD_REV]


def test_a_retry_through_the_rollout_clears_it_once_the_revision_runs() -> None:
    p, observed, _ = _rolled_back()
    running = _run(p, BAD, observed, rollout_name="policy",
                   rollout=_decision(Phase.SHADOW, canary=1, retried=True))
    assert "refusedRevisions" not in running.status
    assert [o["kind"] for o in running.apply] == ["Deployment"]  # the canary again


def test_an_abort_that_judges_nothing_refuses_nothing() -> None:
    p, observed = _serving_good()
    # The artifactRef went back to the serving revision mid-rollout: the Rollout aborts.
    plan = _run(p, GOOD, observed, rollout_name="policy", rollout=_decision(Phase.ABORTED))
    assert "refusedRevisions" not in plan.status
    # Aborted on request while the artifactRef names it: refused.
    plan = _run(p, BAD, observed, rollout_name="policy", rollout=_decision(Phase.ABORTED))
    assert plan.status["refusedRevisions"][0]["reason"] == "Aborted"


def test_the_memory_is_bounded() -> None:
    p, observed = _serving_good()
    entries = [RefusedRevision(revision=f"{i:064x}", reason=RefusalReason.ROLLED_BACK,
                               at=NOW + timedelta(minutes=i)).to_wire()
               for i in range(1, MAX_REFUSED + 1)]
    data = p.to_wire()
    data["status"]["refusedRevisions"] = entries
    full = ServingPool.model_validate(data)
    plan = _run(full, BAD, observed, rollout_name="policy", rollout=_decision(Phase.ROLLED_BACK))
    kept = [r["revision"] for r in plan.status["refusedRevisions"]]
    assert len(kept) == MAX_REFUSED and kept[-1] == BAD_REV and f"{1:064x}" not in kept


def test_a_rollout_sees_a_refused_target_as_blocked_until_a_retry_is_asked() -> None:
    p, _, _ = _rolled_back()
    # A revert to BAD after another revision was promoted by the same Rollout, or a new one.
    promoted = RolloutStatus(phase=Phase.PROMOTED, canary_revision="c" * 64)
    assert refusals.refused_for_rollout(p, BAD_REV, promoted, None) is not None
    assert refusals.refused_for_rollout(p, BAD_REV, RolloutStatus(), None) is not None
    retry = RolloutRequest(action=RequestAction.RETRY, id="r1")
    assert refusals.refused_for_rollout(p, BAD_REV, promoted, retry) is None
    handled = promoted.model_copy(update={"last_request_id": "r1"})
    assert refusals.refused_for_rollout(p, BAD_REV, handled, retry) is not None
    # The Rollout that rolled it back keeps it out itself (and must finish draining it).
    own = RolloutStatus(phase=Phase.ROLLING_BACK, canary_revision=BAD_REV)
    assert refusals.refused_for_rollout(p, BAD_REV, own, None) is None
    # Released by a revert (Idle, still naming it), then named again: refused.
    released = RolloutStatus(phase=Phase.IDLE, canary_revision=BAD_REV)
    assert refusals.refused_for_rollout(p, BAD_REV, released, None) is not None
    assert refusals.refused_for_rollout(p, GOOD_REV, promoted, None) is None
