"""The pure ServingPool reconciler: objects to apply/delete and the status a user reads."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from typing import Any

from operator_fakes import NOW, artifact, as_observed, pod, pool, revision

from kvfleet.api import ModelArtifact, ServingPool
from kvfleet.api.builders import make_artifact
from kvfleet.api.rollout import Phase, RolloutStatus
from kvfleet.api.servingpool import TrafficRole, TrafficTarget
from kvfleet.compat import default_matrix
from kvfleet.operator import naming
from kvfleet.operator.rollout import Decision as RolloutDecision
from kvfleet.operator.servingpool import Observed, Plan, reconcile

MATRIX = default_matrix()


ROUTER_TOKEN = "t" * 48


def _run(p: ServingPool, a: ModelArtifact | None, observed: Observed, **kw: Any) -> Plan:
    kw.setdefault("new_router_token", ROUTER_TOKEN)
    return reconcile(p, a, observed, matrix=MATRIX, now=kw.pop("now", NOW), **kw)


def _cond(plan: Plan, cond_type: str) -> dict[str, Any]:
    return next(c for c in plan.status["conditions"] if c["type"] == cond_type)


def _with_status(p: ServingPool, plan: Plan) -> ServingPool:
    data = p.to_wire()
    data["status"] = plan.status
    return ServingPool.model_validate(data)


def _converged(p: ServingPool, a: ModelArtifact, ready: int | None = None) -> Observed:
    """Every object of the first plan, as the server would return them."""
    first = _run(p, a, Observed())
    objs = {o["kind"]: as_observed(o, ready=ready) for o in first.apply}
    return Observed(
        deployments=(objs["Deployment"],),
        service=objs["Service"],
        pdb=objs["PodDisruptionBudget"],
        router_secret=objs["Secret"],
        network_policy=objs["NetworkPolicy"],
    )


def test_new_pool_creates_its_objects_and_is_progressing() -> None:
    plan = _run(pool(), artifact(), Observed())
    assert sorted(o["kind"] for o in plan.apply) == [
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Secret",
        "Service",
    ]
    assert not plan.delete
    assert _cond(plan, "Available")["status"] == "False"
    assert _cond(plan, "Progressing")["reason"] == "RollingOut"
    capacity = _cond(plan, "CapacityOK")
    assert (capacity["status"], capacity["reason"]) == ("True", "Fits")
    # Qwen3-8B on a 24 GiB L4 with 3 GiB held back: 5 concurrent 8,192-token sequences.
    assert plan.status["capacity"] == {"kvTokensPerReplica": 44400, "candidateConcurrency": 5}
    assert [e.reason for e in plan.events] == ["Created"]
    assert "Deployment chat-" in plan.events[0].message
    ServingPool.model_validate({**pool().to_wire(), "status": plan.status})  # schema-valid


def test_converged_pool_is_available_and_applies_nothing() -> None:
    p, a = pool(), artifact()
    plan = _run(p, a, _converged(p, a))
    assert plan.apply == () and plan.delete == () and plan.events == ()
    assert _cond(plan, "Available")["status"] == "True"
    assert _cond(plan, "Ready")["status"] == "True"
    assert _cond(plan, "Progressing")["reason"] == "Complete"
    assert _cond(plan, "Degraded")["status"] == "False"
    assert plan.status["servingRevision"] == revision(a)
    assert (plan.status["replicas"], plan.status["readyReplicas"]) == (1, 1)
    assert all(c["observedGeneration"] == 1 for c in plan.status["conditions"])


def test_hand_scaling_is_restored() -> None:
    p, a = pool(), artifact()
    observed = _converged(p, a)
    observed.deployments[0]["spec"]["replicas"] = 5
    plan = _run(p, a, observed)
    assert [o["kind"] for o in plan.apply] == ["Deployment"]
    assert plan.apply[0]["spec"]["replicas"] == 1
    assert [e.reason for e in plan.events] == ["Restored"]
    assert ".spec.replicas" in plan.events[0].message


def test_deleted_service_is_recreated_and_availability_holds() -> None:
    p, a = pool(), artifact()
    observed = _converged(p, a)
    plan = _run(p, a, replace(observed, service=None))
    assert [o["kind"] for o in plan.apply] == ["Service"]
    assert _cond(plan, "Available")["status"] == "True"


def test_missing_artifact_blocks_without_creating_anything() -> None:
    plan = _run(pool(), None, Observed())
    assert plan.apply == ()
    degraded = _cond(plan, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ArtifactNotFound")
    assert "qwen3-8b" in degraded["message"]
    assert _cond(plan, "Available")["reason"] == "ArtifactNotFound"
    assert [e.type for e in plan.events] == ["Warning"]


def test_pool_that_does_not_fit_its_gpu_is_refused() -> None:
    plan = _run(pool(spec__gpu__memory="16Gi"), artifact(), Observed())
    assert plan.apply == ()
    capacity = _cond(plan, "CapacityOK")
    assert (capacity["status"], capacity["reason"]) == ("False", "DoesNotFit")
    assert _cond(plan, "Degraded")["reason"] == "InsufficientCapacity"


def test_incompatible_gpu_is_refused_with_the_matrix_reason() -> None:
    plan = _run(pool(spec__gpu__product="NVIDIA-Nonexistent"), artifact(), Observed())
    assert plan.apply == ()
    degraded = _cond(plan, "Degraded")
    assert degraded["reason"] == "Incompatible"
    assert "spec.gpu.product" in degraded["message"] and MATRIX.version in degraded["message"]


def test_unschedulable_pods_name_the_gpu_product_and_warn_once() -> None:
    p, a = pool(), artifact()
    observed = _converged(p, a, ready=0)
    labels = observed.deployments[0]["spec"]["template"]["metadata"]["labels"]
    scheduler = "0/6 nodes are available: 6 node(s) didn't match Pod's node affinity/selector."
    observed = replace(observed, pods=(pod(labels, unschedulable=scheduler),))
    plan = _run(p, a, observed)
    available = _cond(plan, "Available")
    assert (available["status"], available["reason"]) == ("False", "Unschedulable")
    assert "no node with 1 free nvidia.com/gpu of product NVIDIA-L4" in available["message"]
    assert scheduler in available["message"]
    assert [e.reason for e in plan.events] == ["Unschedulable"]
    again = _run(_with_status(p, plan), a, observed, now=NOW + timedelta(minutes=1))
    assert again.events == ()
    assert (
        _cond(again, "Degraded")["lastTransitionTime"]
        == _cond(plan, "Degraded")["lastTransitionTime"]
    )


def test_crash_looping_engine_is_degraded_with_its_last_words() -> None:
    p, a = pool(), artifact()
    observed = _converged(p, a, ready=0)
    labels = observed.deployments[0]["spec"]["template"]["metadata"]["labels"]
    bad = pod(labels, waiting=("CrashLoopBackOff", "sha256 mismatch for model-00001"))
    plan = _run(
        p,
        a,
        replace(observed, pods=(bad,)),
    )
    degraded = _cond(plan, "Degraded")
    assert degraded["reason"] == "CrashLoopBackOff"
    assert "sha256 mismatch for model-00001" in degraded["message"]


def test_crash_loop_reason_is_the_engines_last_log_line_not_the_whole_tail() -> None:
    """With FallbackToLogsOnError the termination message is the log's tail: the pool shows
    the line that says why, not the server's start-up chatter before it."""
    p, a = pool(), artifact()
    observed = _converged(p, a, ready=0)
    labels = observed.deployments[0]["spec"]["template"]["metadata"]["labels"]
    why = "engine failed to start: sha256 b179 does not match the manifest's aaaa"
    tail = "\n".join(
        json.dumps({"level": level, "logger": "kvfleet", "msg": msg})
        for level, msg in [("info", "Uvicorn running on http://127.64.0.2:8000"),
                           ("info", "Finished server process [7]"), ("error", why)]
    ) + "\n"  # fmt: skip
    bad = pod(labels, waiting=("CrashLoopBackOff", tail))
    plan = _run(p, a, replace(observed, pods=(bad,)))
    degraded = _cond(plan, "Degraded")
    assert degraded["message"] == (
        f"pod chat-abc-1: container engine CrashLoopBackOff (last exit code 1): {why}"
    )
    assert [(e.reason, e.message) for e in plan.events] == [
        ("CrashLoopBackOff", degraded["message"])
    ]


def _new_artifact() -> ModelArtifact:
    return (
        make_artifact("qwen3-8b")
        .set("metadata.uid", "uid-2")
        .set("spec.engineVersions.min", "0.1.0")
        .obj()
    )


def test_artifact_change_switches_revision_only_when_the_new_one_is_ready() -> None:
    p, old, new = pool(), artifact(), _new_artifact()
    assert revision(old) != revision(new)
    converged = _converged(p, old)
    p = _with_status(p, _run(p, old, converged))
    switching = _run(p, new, converged)
    assert [o["kind"] for o in switching.apply] == ["Deployment"]
    assert switching.delete == ()
    assert switching.status["servingRevision"] == revision(old)
    new_deployment = next(o for o in switching.apply if o["kind"] == "Deployment")
    both = replace(converged, deployments=(converged.deployments[0],
                                           as_observed(new_deployment)))
    done = _run(p, new, both)
    assert [d["metadata"]["name"] for d in done.delete] == [
        converged.deployments[0]["metadata"]["name"]
    ]
    assert done.status["servingRevision"] == revision(new)


def _decision(old: ModelArtifact, new: ModelArtifact, *, phase: Phase, weight: int,
              canary: int | None, promote: bool = False, stable: int | None = None
              ) -> RolloutDecision:
    status = RolloutStatus(phase=phase, stable_revision=revision(old),
                           canary_revision=revision(new), current_weight=weight,
                           message=f"step 1/3 weight {weight}%")
    traffic = [TrafficTarget(revision=revision(old), role=TrafficRole.STABLE,
                             weight=100 - weight)]
    if weight:
        traffic.append(TrafficTarget(revision=revision(new), role=TrafficRole.CANARY,
                                     weight=weight))
    return RolloutDecision(status=status, traffic=traffic if canary else [],
                           canary_replicas=canary, promote=promote, stable_replicas=stable)


def test_a_rollout_runs_the_canary_beside_an_untouched_stable() -> None:
    p, old, new = pool(), artifact(), _new_artifact()
    converged = _converged(p, old)
    p = _with_status(p, _run(p, old, converged))
    stable_name = converged.deployments[0]["metadata"]["name"]
    # Even a drifted stable Deployment is not re-applied mid-rollout: its pods must not restart.
    drifted = json.loads(json.dumps(converged.deployments[0]))
    drifted["spec"]["template"]["spec"]["containers"][0]["args"].append("--drifted")
    observed = replace(converged, deployments=(drifted,))
    decision = _decision(old, new, phase=Phase.PROGRESSING, weight=10, canary=1)
    plan = _run(p, new, observed, rollout=decision)
    [canary] = [o for o in plan.apply if o["kind"] == "Deployment"]
    assert canary["metadata"]["name"] != stable_name and canary["spec"]["replicas"] == 1
    assert plan.delete == ()
    assert plan.status["servingRevision"] == revision(old)
    assert plan.status["traffic"] == [t.to_wire() for t in decision.traffic]
    assert (_cond(plan, "Progressing")["status"], _cond(plan, "Progressing")["reason"]) == (
        "True", "RolloutProgressing")
    assert _cond(plan, "Available")["status"] == "True"

    # Rolled back: the canary goes, stable stays.
    with_canary = replace(converged, deployments=(converged.deployments[0],
                                                  as_observed(canary)))
    back = _run(p, new, with_canary, rollout=_decision(old, new, phase=Phase.ROLLED_BACK,
                                                       weight=0, canary=None))
    assert [d["metadata"]["name"] for d in back.delete] == [canary["metadata"]["name"]]
    assert not any(o["kind"] == "Deployment" for o in back.apply)
    assert "traffic" not in back.status
    assert _cond(back, "Progressing")["reason"] == "RolloutRolledBack"

    # Promoted: the canary serves and (at full size) the old revision retires.
    full = dict(canary, spec={**canary["spec"], "replicas": p.spec.replicas})
    both = replace(converged, deployments=(converged.deployments[0], as_observed(full)))
    done = _run(p, new, both, rollout=_decision(old, new, phase=Phase.PROMOTED, weight=100,
                                                 canary=None, promote=True))
    assert done.status["servingRevision"] == revision(new)
    assert [d["metadata"]["name"] for d in done.delete] == [stable_name]
    assert done.apply == ()


def test_a_promotion_keeps_the_previous_revision_and_an_undo_scales_it_back_up() -> None:
    """Promoted with a kept previous revision: its Deployment stays at 1 replica, without
    traffic and outside the pool's counts (an HPA reads them), until the Rollout releases it.
    An undo moves servingRevision back to it and gives it the pool's count; the promoted
    revision drains, then goes."""
    p, old, new = pool(spec__replicas=3), artifact(), _new_artifact()
    converged = _converged(p, old)
    p = _with_status(p, _run(p, old, converged))
    old_name = converged.deployments[0]["metadata"]["name"]
    canary = next(o for o in _run(p, new, converged, rollout=_decision(
        old, new, phase=Phase.PROGRESSING, weight=100, canary=3)).apply
        if o["kind"] == "Deployment")
    both = replace(converged, deployments=(converged.deployments[0], as_observed(canary)))
    promoted = _decision(old, new, phase=Phase.PROMOTED, weight=100, canary=None, promote=True)
    promoted.keep = (revision(old), 1)
    done = _run(p, new, both, rollout=promoted)
    assert done.status["servingRevision"] == revision(new) and done.delete == ()
    assert [(d["metadata"]["name"], size) for d, size in done.scale] == [(old_name, 1)]
    assert "KeptPrevious" in [e.reason for e in done.events]
    assert (done.status["replicas"], done.status["readyReplicas"]) == (3, 3)  # not the kept
    p = _with_status(p, done)
    # Released (its time is up): deleted as any retired revision.
    released = _run(p, new, both, rollout=_decision(old, new, phase=Phase.PROMOTED, weight=100,
                                                     canary=None, promote=True))
    assert [d["metadata"]["name"] for d in released.delete] == [old_name]
    # Undone instead: the kept revision serves again, scaled back to the pool's count.
    undo = _decision(old, new, phase=Phase.ROLLING_BACK, weight=0, canary=3)
    undo.demote = (revision(old), "qwen3-8b-v1")
    old_kept = json.loads(json.dumps(converged.deployments[0]))
    old_kept["spec"]["replicas"] = 1
    kept = replace(both, deployments=(as_observed(old_kept), both.deployments[1]))
    back = _run(p, new, kept, rollout=undo)
    assert back.status["servingRevision"] == revision(old)
    assert back.status["servingArtifact"] == "qwen3-8b-v1"
    assert back.status["traffic"] == [t.to_wire() for t in undo.traffic]
    assert [(d["metadata"]["name"], size) for d, size in back.scale] == [(old_name, 3)]
    assert back.delete == ()
    assert [r["revision"] for r in back.status["refusedRevisions"]] == [revision(new)]


def test_a_judged_step_tells_the_routers_a_quiet_pools_probe_prompts() -> None:
    from kvfleet.api.servingpool import SyntheticTraffic

    p, old, new = pool(), artifact(), _new_artifact()
    converged = _converged(p, old)
    p = _with_status(p, _run(p, old, converged))
    decision = _decision(old, new, phase=Phase.PROGRESSING, weight=10, canary=1)
    decision.synthetic = SyntheticTraffic(prompts=["Say hello."], rate_per_second=1.0,
                                          max_tokens=32)
    plan = _run(p, new, converged, rollout=decision)
    assert plan.status["syntheticTraffic"] == {"prompts": ["Say hello."], "ratePerSecond": 1.0,
                                               "maxTokens": 32}
    ServingPool.model_validate({**p.to_wire(), "status": plan.status})
    decision.synthetic = None
    assert "syntheticTraffic" not in _run(p, new, converged, rollout=decision).status


def test_stable_follows_the_pools_count_mid_rollout_or_its_share_of_an_autoscaled_one(
        ) -> None:
    """A load ramp mid-rollout raised spec.replicas and only the canary followed: stable kept
    its old count while the status said 2 -> 8."""
    p, old, new = pool(), artifact(), _new_artifact()
    converged = _converged(p, old)
    p = _with_status(p, _run(p, old, converged))
    stable_name = converged.deployments[0]["metadata"]["name"]
    ramped = _with_status(pool(spec__replicas=8), _run(p, old, converged))
    plan = _run(ramped, new, converged, rollout=_decision(old, new, phase=Phase.PROGRESSING,
                                                          weight=10, canary=1))
    assert [(d["metadata"]["name"], size) for d, size in plan.scale] == [(stable_name, 8)]
    assert "ScaledStable" in [e.reason for e in plan.events]
    # An autoscaled pool's stable has the share the Rollout decided; its pods keep running.
    shared = _run(ramped, new, converged, rollout=_decision(
        old, new, phase=Phase.PROGRESSING, weight=50, canary=4, stable=4))
    assert [size for _, size in shared.scale] == [4]
    assert not any(o["metadata"]["name"] == stable_name for o in shared.apply)
    # Rolled back: stable gets the whole count back at once.
    back = _run(ramped, new, converged, rollout=_decision(
        old, new, phase=Phase.ROLLING_BACK, weight=0, canary=1))
    assert [size for _, size in back.scale] == [8]


def test_revision_label_matches_the_manifest_hash() -> None:
    p, a = pool(), artifact()
    deployment = next(o for o in _run(p, a, Observed()).apply if o["kind"] == "Deployment")
    assert deployment["metadata"]["labels"][naming.REVISION_LABEL] == revision(a)[:12]


def test_a_refused_object_shows_as_degraded_apply_failed() -> None:
    from kvfleet.operator.servingpool import with_apply_failure

    plan = _run(pool(), artifact(), Observed())
    refused = "Service chat: HTTP 500: failed to allocate a serviceIP: range is full"
    status = with_apply_failure(plan.status, refused, now=NOW)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == (
        "True",
        "ApplyFailed",
        refused,
    )
    assert [c["type"] for c in status["conditions"]] == [
        c["type"] for c in plan.status["conditions"]
    ]
    ServingPool.model_validate({**pool().to_wire(), "status": status})


def test_artifact_deleted_while_serving_keeps_the_replicas() -> None:
    p, a = pool(), artifact()
    converged = _converged(p, a)
    p = _with_status(p, _run(p, a, converged))
    plan = _run(p, None, converged)
    assert plan.apply == () and plan.delete == ()
    assert _cond(plan, "Degraded")["reason"] == "ArtifactNotFound"
    assert _cond(plan, "Available")["status"] == "True"  # the running revision still serves
    assert plan.status["servingRevision"] == revision(a)


def test_the_router_token_is_made_once_and_given_to_every_engine_pod() -> None:
    p, a = pool(), artifact()
    converged = _converged(p, a)
    secret = converged.router_secret
    assert secret is not None and secret["metadata"]["labels"]["kvfleet.io/router-token-for"] \
        == "chat"
    # Another random candidate on every reconcile: the token in the Secret stays.
    again = _run(p, a, converged, new_router_token="u" * 48)
    assert again.apply == ()
    deployment = converged.deployments[0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    # A mounted file the engine follows, not an env var read once: a re-minted Secret
    # reaches running engines.
    token_env = next(e for e in container["env"] if e["name"] == "KVFLEET_ROUTER_TOKEN_FILE")
    mount = next(m for m in container["volumeMounts"] if m["name"] == "router-token")
    assert token_env["value"] == mount["mountPath"] + "/token" and mount["readOnly"]
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "router-token")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    policy = converged.network_policy
    assert policy is not None
    sources = policy["spec"]["ingress"][0]["from"]
    assert [s["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for s in sources] == [
        "kvfleet-router", "prometheus"]
    # A peer is a namespace by the name the API server sets, and a pod label in it: a pod
    # elsewhere that labels itself kvfleet-router is no router.
    assert sources[0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": p.metadata.namespace}}
    assert sources[1]["namespaceSelector"] == {}  # Prometheus' namespace not given
    from kvfleet.operator.builders import EngineOptions, build_network_policy
    placed = build_network_policy(p, EngineOptions(router_namespace="kvfleet-system",
                                                   prometheus_namespace="monitoring"))
    assert [s["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
            for s in placed["spec"]["ingress"][0]["from"]] == ["kvfleet-system", "monitoring"]


def _changing(replicas: int, **reserves: int) -> tuple[ServingPool, ModelArtifact, Observed,
                                                         dict[str, Any]]:
    """A pool of `replicas` serving `artifact()`, its artifactRef just changed: the new
    revision's Deployment as the first reconcile of the change applied it, not ready yet."""
    p = pool(spec__replicas=replicas, spec__reserves=reserves)
    old, new = artifact(), _new_artifact()
    converged = _converged(p, old)
    p = _with_status(p, _run(p, old, converged))
    first = _run(p, new, converged)
    [deployment] = [o for o in first.apply if o["kind"] == "Deployment"]
    return p, new, converged, deployment


def _unschedulable(observed: Observed, deployment: dict[str, Any], ready: int) -> Observed:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    scheduler = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    return replace(observed, deployments=(*observed.deployments,
                                          as_observed(deployment, ready=ready)),
                   pods=(pod(labels, unschedulable=scheduler),))


def test_without_a_free_gpu_or_reserve_old_replicas_make_room_step_by_step() -> None:
    p, new, converged, deployment = _changing(3)
    assert deployment["spec"]["replicas"] == 1  # one surge replica first
    stuck = _unschedulable(converged, deployment, ready=0)
    plan = _run(p, new, stuck)
    [(old, keep)] = plan.scale
    assert keep == 2 and old["metadata"]["name"] == converged.deployments[0]["metadata"]["name"]
    progressing = _cond(plan, "Progressing")
    assert progressing["reason"] == "ReplacingReplicas"
    assert "replacing replicas 1 at a time" in progressing["message"]
    # Still serving: 3 old replicas ready of 3 (minimum 2), and nothing to warn about.
    assert _cond(plan, "Available")["status"] == "True"
    assert _cond(plan, "Degraded")["status"] == "False"
    assert plan.delete == ()
    # One new replica ready: the next one comes as another old one goes (sticky mode).
    p2 = _with_status(p, plan)
    grown = replace(converged, deployments=(
        dict(converged.deployments[0], spec={**converged.deployments[0]["spec"], "replicas": 2}),
        as_observed(deployment, ready=1)))
    step = _run(p2, new, grown)
    [applied] = [o for o in step.apply if o["kind"] == "Deployment"]
    assert applied["spec"]["replicas"] == 2
    assert [size for _, size in step.scale] == [1]
    assert step.status["servingRevision"] == revision(artifact())


def test_a_deployment_reserve_surges_beside_the_old_revision() -> None:
    p, new, converged, deployment = _changing(3, deployment=2)
    assert deployment["spec"]["replicas"] == 2
    plan = _run(p, new, replace(converged, deployments=(
        *converged.deployments, as_observed(deployment, ready=0))))
    assert plan.scale == ()  # 3 old + 2 new: within the reserve, nothing gives way
    assert "surging 2 at a time (reserves.deployment)" in _cond(plan, "Progressing")["message"]
    full = _changing(3, deployment=3)[3]
    assert full["spec"]["replicas"] == 3  # the reserve covers a whole second revision


def test_an_engine_settings_change_is_a_new_revision_that_rolls_over() -> None:
    """Settings change what a pod answers or how fast: a new revision, its own Deployment
    beside the serving one (ungoverned: the rollover an artifact change makes)."""
    p, a = pool(spec__replicas=2), artifact()
    converged = _converged(p, a)
    p = _with_status(p, _run(p, a, converged))
    changed = _with_status(pool(spec__replicas=2, spec__engine__kvCacheDtype="float16"),
                           _run(p, a, converged))
    plan = _run(changed, a, converged)
    [new] = [o for o in plan.apply if o["kind"] == "Deployment"]
    assert new["metadata"]["name"] != converged.deployments[0]["metadata"]["name"]
    f16 = revision(a, pool(spec__replicas=2, spec__engine__kvCacheDtype="float16"))
    assert new["metadata"]["annotations"][naming.REVISION_ANNOTATION] == f16 != revision(a)
    assert plan.status["revision"] == f16
    assert plan.status["servingRevision"] == revision(a)  # until the new one is ready
    env = {e["name"]: e.get("value") for e in new["spec"]["template"]["spec"]["containers"][0][
        "env"]}
    assert env["KVFLEET_KV_CACHE_DTYPE"] == "float16"


def test_what_is_not_a_new_revision_rolls_in_place() -> None:
    """Replicas, memory, labels and the drain time change neither answers nor speed: the
    serving revision's own Deployment is updated."""
    a = artifact()
    base = revision(a)
    for path, value in [("spec__replicas", 3), ("spec__engine__drainSeconds", 90),
                        ("spec__pod__labels", {"team": "search"}),
                        ("spec__pod__resources", {"limits": {"memory": "8Gi"}})]:
        assert revision(a, pool(**{path: value})) == base, path
    for path, value in [("spec__pod__image", "registry.example/kvfleet@sha256:" + "1" * 64),
                        ("spec__engine__maxModelLength", 4096),
                        ("spec__pod__resources", {"requests": {"cpu": "4"}}),
                        ("spec__pod__env", [{"name": "OMP_WAIT_POLICY", "value": "PASSIVE"}]),
                        ("spec__pod__resources", {"limits": {"cpu": "2"}}),
                        ("spec__engine__workspace", "4Gi"), ("spec__gpu__count", 2)]:
        assert revision(a, pool(**{path: value})) != base, path


def test_a_change_that_is_no_new_revision_without_a_free_gpu_rolls_within_the_budget() -> None:
    p, a = pool(spec__replicas=2), artifact()
    converged = _converged(p, a)
    p = _with_status(p, _run(p, a, converged))
    changed = pool(spec__replicas=2, spec__engine__drainSeconds=90)
    changed = _with_status(changed, _run(p, a, converged))
    rolling = json.loads(json.dumps(converged.deployments[0]))
    rolling["status"].update(updatedReplicas=1, readyReplicas=2, replicas=3)
    labels = rolling["spec"]["template"]["metadata"]["labels"]
    stuck = replace(converged, deployments=(rolling,), pods=(pod(
        labels, unschedulable="0/3 nodes are available: 3 Insufficient nvidia.com/gpu."),))
    plan = _run(changed, a, stuck)
    [deployment] = [o for o in plan.apply if o["kind"] == "Deployment"]
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0,
                                                               "maxUnavailable": 1}
    assert _cond(plan, "Progressing")["reason"] == "ReplacingReplicas"
    assert _cond(plan, "Available")["status"] == "True"


def test_engines_with_fewer_kv_blocks_than_planned_are_reported() -> None:
    """What the serving revision's engines really allocated (from Prometheus) against the
    plan: below it, the pool says by how much; without Prometheus, no condition at all."""
    p, a = pool(), artifact()
    observed = _converged(p, a)
    short = naming.short_revision(revision(a))
    planned = 44400 // 16  # the plan's 44,400 KV tokens per replica in blocks of 16

    def allocation(blocks: dict[str, int] | None) -> dict[str, Any] | None:
        plan = _run(p, a, replace(observed, kv_blocks=blocks))
        return next((c for c in plan.status["conditions"] if c["type"] == "KVCacheAsPlanned"),
                    None)

    assert allocation(None) is None
    no_data = allocation({})
    assert no_data is not None and (no_data["status"], no_data["reason"]) == ("Unknown", "NoData")
    low = allocation({short: planned - 100})
    assert low is not None and (low["status"], low["reason"]) == ("False", "BelowPlan")
    assert f"allocated {planned - 100} KV blocks, the plan is {planned}" in low["message"]
    ok = allocation({short: planned, "0123456789ab": 1})  # another revision's: not ours
    assert ok is not None and (ok["status"], ok["reason"]) == ("True", "AsPlanned")


def test_the_autoscalers_decision_shows_in_status_and_goes_with_its_spec() -> None:
    from kvfleet.operator.autoscale import Decision
    from kvfleet.operator.autoscaler import Report

    p = pool(spec__autoscaling={"maxReplicas": 4})
    a = artifact()
    observed = _converged(p, a)
    scaled = Report(Decision(3, "load", "load 11.0 over 1 replicas, target 4 each"),
                    "2026-01-01T00:00:00Z")
    plan = _run(p, a, observed, autoscaling=scaled)
    assert plan.status["autoscaling"] == {
        "desiredReplicas": 3, "signal": "load", "lastScaleTime": "2026-01-01T00:00:00Z",
        "message": "load 11.0 over 1 replicas, target 4 each"}
    assert (_cond(plan, "AutoscalingActive")["status"], _cond(plan, "ScalingLimited")["status"]
            ) == ("True", "False")
    # Signals lost, replicas that never got Ready: both said; before the autoscaler's first
    # decision (a restarted operator) the last ones stay.
    stale = Report(Decision(3, "stale", active=False, why_inactive="no router: holding 3"),
                   None)
    plan = _run(_with_status(p, plan), a, observed, autoscaling=stale)
    active = _cond(plan, "AutoscalingActive")
    assert (active["status"], active["reason"], active["message"]) == (
        "False", "SignalsMissing", "no router: holding 3")
    stuck = Report(Decision(3, "load", limited=True, why_limited="1 replicas unschedulable"),
                   None)
    limited = _cond(_run(p, a, observed, autoscaling=stuck), "ScalingLimited")
    assert (limited["status"], limited["reason"]) == ("True", "Unschedulable")
    kept = _run(_with_status(p, plan), a, observed)
    assert _cond(kept, "AutoscalingActive")["status"] == "False"
    assert kept.status["autoscaling"]["signal"] == "stale"
    # spec.autoscaling removed: its status and conditions go too.
    fixed = _with_status(pool(), plan)
    gone = _run(fixed, a, observed)
    assert "autoscaling" not in gone.status
    assert not {c["type"] for c in gone.status["conditions"]} & {"AutoscalingActive",
                                                                 "ScalingLimited"}


def test_a_stable_deployment_deleted_mid_rollout_is_recreated_not_replaced_by_the_canary() -> None:
    p, old, new = pool(), artifact(), _new_artifact()
    converged = _converged(p, old)
    p = _with_status(p, _run(p, old, converged))
    stable = converged.deployments[0]
    decision = _decision(old, new, phase=Phase.PROGRESSING, weight=50, canary=1)
    [canary] = [o for o in _run(p, new, converged, rollout=decision).apply
                if o["kind"] == "Deployment"]
    # Someone deletes the stable Deployment while the canary runs at 50 %.
    gone = replace(converged, deployments=(as_observed(canary),))
    plan = _run(p, new, gone, rollout=decision, serving_artifact=old)
    assert [o["metadata"]["name"] for o in plan.apply if o["kind"] == "Deployment"] == [
        stable["metadata"]["name"]]
    assert plan.status["servingRevision"] == revision(old)
    assert plan.delete == () and "Restored" in [e.reason for e in plan.events]
    # Without the stable artifact it cannot be rebuilt, but the canary still does not take over.
    blind = _run(p, new, gone, rollout=decision)
    assert blind.status["servingRevision"] == revision(old) and blind.delete == ()
    assert not [o for o in blind.apply if o["kind"] == "Deployment"
                and o["metadata"]["name"] == stable["metadata"]["name"]]


def test_a_status_lost_mid_rollout_takes_the_stable_revision_from_the_rollout() -> None:
    p, old, new = pool(), artifact(), _new_artifact()
    converged = _converged(p, old)
    decision = _decision(old, new, phase=Phase.PROGRESSING, weight=50, canary=1)
    [canary] = [o for o in _run(_with_status(p, _run(p, old, converged)), new, converged,
                                rollout=decision).apply if o["kind"] == "Deployment"]
    both = replace(converged, deployments=(converged.deployments[0], as_observed(canary)))
    restored = _run(p, new, both, rollout=decision)  # `p` has no status at all
    assert restored.status["servingRevision"] == revision(old)
    assert restored.delete == () and restored.scale == ()
    assert restored.status["traffic"] == [t.to_wire() for t in decision.traffic]


def test_the_scale_subresource_has_a_selector_of_every_revisions_pods() -> None:
    """A HorizontalPodAutoscaler refuses a /scale without a selector."""
    from kvfleet.api.crdgen import build_crd

    scale = build_crd(ServingPool)["spec"]["versions"][0]["subresources"]["scale"]
    assert scale["labelSelectorPath"] == ".status.selector"
    p, old, new = pool(), artifact(), _new_artifact()
    plan = _run(p, old, _converged(p, old))
    wanted = dict(kv.split("=", 1) for kv in plan.status["selector"].split(","))
    for a in (old, new):
        [deployment] = [o for o in _run(p, a, Observed()).apply if o["kind"] == "Deployment"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert wanted.items() <= labels.items(), (wanted, labels)
