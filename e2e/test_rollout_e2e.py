"""Rollouts against the real parts: the operator, real engine pods on the dev cluster's local
node, the router running as a pod, and the harness's Prometheus scraping the router.

The platform team's story, as a user types it: a pool and its Rollout policy exist; changing
the pool's artifactRef (one line) starts a rollout. A good artifact is promoted through shadow
traffic and the steps — with the operator SIGKILLed mid-analysis, mid-step and mid-promotion
on the way — and the old revision retires; a bad one (the engine's fault injection adds 1 s to
every token) is rolled back at its first analysed step while the stable pods keep their UIDs;
no client request fails in either. Argo CD's health checks (the chart's, run by the argocd
binary) judge the live objects in each state. The revisions, policy, router pod and traffic
are the demo's (`kvfleet.devcluster.demo`), so `make demo` shows what these tests check.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.argocd_health import ArgoHealth
from e2e.test_operator_e2e import (  # noqa: F401 (crds and operator are fixtures)
    ROOT,
    Kubectl,
    OperatorProcess,
    _available,
    _create,
    _get,
    _only_the_local_l4_node,
    _wait_pool,
    crds,
    operator,
)
from kvfleet.api.rollout import REQUEST_ANNOTATION
from kvfleet.devcluster.cluster import DevCluster
from kvfleet.devcluster.demo import (
    POOL,
    Traffic,
    local_pool,
    long_prompt_fault,
    rollout_policy,
    router_on_node,
    set_artifact,
    slow_fault,
    smollm2_revision,
    stream_error_fault,
    tenant,
)
from kvfleet.devcluster.grafana import queries
from kvfleet.devcluster.kube import JsonObj, KubeClient
from kvfleet.devcluster.prometheus import PrometheusClient
from kvfleet.engine.faults import FAULTS_ENV
from kvfleet.operator import naming
from kvfleet.operator.placement import tolerations
from kvfleet.operator.revisions import revision_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROLLOUTS = "/apis/kvfleet.io/v1alpha1/namespaces/{ns}/rollouts"


def _wait_rollout(kube: KubeClient, op: OperatorProcess, ns: str,
                  check: Callable[[JsonObj], bool], what: str, timeout: float) -> JsonObj:
    deadline = time.monotonic() + timeout
    rollout: JsonObj = {}
    while time.monotonic() < deadline:
        rollout = kube.request("GET", ROLLOUTS.format(ns=ns) + f"/{POOL}")
        if check(rollout):
            return rollout
        time.sleep(0.5)
    pytest.fail(f"Rollout {ns}/{POOL}: timed out waiting for {what}; status:\n"
                f"{yaml.safe_dump(rollout.get('status'))}\noperator log:\n{op.log_tail()}")


def _phase(*phases: str) -> Callable[[JsonObj], bool]:
    return lambda r: (r.get("status") or {}).get("phase") in phases


def _events(kube: KubeClient, ns: str, reason: str) -> list[JsonObj]:
    return [e for e in kube.list("Event", ns, field_selector="involvedObject.kind=Rollout")
            if e.get("reason") == reason]


def _posted(kube: KubeClient, ns: str, reason: str, count: int) -> list[JsonObj]:
    """The Rollout events of `reason` once there are `count` (waited for: they are posted after
    the status that records the decision, so a read right after it may see fewer)."""
    deadline = time.monotonic() + 15
    while len(events := _events(kube, ns, reason)) < count:
        assert time.monotonic() < deadline, f"{reason}: {len(events)} events, not {count}"
        time.sleep(0.5)
    return events


def _pods(kube: KubeClient, ns: str, revision: str) -> dict[str, str]:
    selector = f"{naming.POOL_LABEL}={POOL},{naming.REVISION_LABEL}={revision[:12]}"
    return {p["metadata"]["name"]: p["metadata"]["uid"]
            for p in kube.list("Pod", ns, label_selector=selector)
            if not p["metadata"].get("deletionTimestamp")}


@pytest.fixture
def faults() -> Iterator[dict[str, str]]:
    """$KVFLEET_ENGINE_FAULTS for the engine pods the local runner starts from now on."""
    saved = os.environ.get(FAULTS_ENV)
    table: dict[str, str] = {}
    yield table
    if saved is None:
        os.environ.pop(FAULTS_ENV, None)
    else:
        os.environ[FAULTS_ENV] = saved


@pytest.fixture
def shared_cores() -> Iterator[None]:
    """Engines that take turns on this host's cores, not spinning for them.

    Here the stable and the canary engine are processes on one 2-core machine; in a cluster
    each owns its node's CPUs. Two engines whose OpenMP threads spin-wait (libgomp's default)
    steal each other's cores at every parallel region: measured with two `LLM.generate` loops
    side by side, 21 tok/s each and requests up to 6.7 s, against 132 tok/s alone; with
    `OMP_WAIT_POLICY=PASSIVE`, 76 tok/s each and at most 0.5 s. A comparison of two revisions
    must measure the revisions, not that fight (it made a good canary's TPOT p95 3.2x
    stable's), so the engines started while this fixture holds sleep when they wait. (Alone,
    a passive engine is slower, 44 tok/s: hence not for every test.)"""
    saved = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    yield
    if saved is None:
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = saved


def _setup(kube: KubeClient, namespace: str, auto_promote: bool = True, shadow: bool = False,
           max_wait_seconds: int = 120, keep_previous_seconds: int = 0) -> dict[str, str]:
    """Three revisions of SmolLM2, the pool on the first, its Rollout policy, a tenant key."""
    revisions = [smollm2_revision(f"smol-v{i}", 40 + i, namespace) for i in (1, 2, 3)]
    for artifact in revisions:
        kube.create(artifact)
    tenant(kube, namespace)
    pool = local_pool(POOL, "smol-v1", namespace)
    kube.create(pool)
    kube.create(rollout_policy(POOL, namespace, auto_promote=auto_promote, shadow=shadow,
                               max_wait_seconds=max_wait_seconds,
                               keep_previous_seconds=keep_previous_seconds))
    return {a["metadata"]["name"]: revision_for(pool, a) for a in revisions}


@pytest.mark.usefixtures("shared_cores")
def test_a_good_artifact_is_promoted_and_a_slow_one_rolled_back(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,  # noqa: F811
    local_node: str, fake_nodes: list[str], prometheus: PrometheusClient,
    faults: dict[str, str], argo_health: ArgoHealth,
) -> None:
    with _only_the_local_l4_node(kube, kubectl):
        hashes = _setup(kube, namespace, shadow=True)
        pool = _wait_pool(kube, operator, namespace, POOL, _available,
                          "the first revision Ready", 300)
        argo_health.expect(pool, "Healthy", "available")
        idle = _wait_rollout(kube, operator, namespace, _phase("Idle"), "Idle", 30)
        assert idle["status"]["message"] == "serving smol-v1"
        argo_health.expect(idle, "Healthy", "idle")
        url = router_on_node(kube, namespace, local_node)
        traffic = Traffic(url)
        try:
            _promote(kube, kubectl, operator, namespace, hashes, traffic, argo_health)
            _roll_back(kube, operator, namespace, hashes, traffic, faults, argo_health)
        finally:
            traffic.close()
    assert traffic.failures == [], traffic.failures[:5]
    assert sum(traffic.codes.values()) > 50, traffic.codes
    # The series the analysis read are really in Prometheus, per revision.
    series = prometheus.query('sum by (revision) (kvfleet_router_requests_total{'
                              f'namespace="{namespace}",pool="{POOL}",outcome="completed"}})')
    served = {s["metric"]["revision"] for s in series if float(s["value"][1]) > 0}
    assert served >= {h[:12] for h in hashes.values()}  # (counters start at 0: not enough)
    _dashboard_shows_the_fleet(prometheus, namespace)


def _dashboard_shows_the_fleet(prometheus: PrometheusClient, namespace: str) -> None:
    """The chart's Grafana dashboard, queried on the real Prometheus after this traffic: every
    query runs, and the router's and engines' panels have data under the labels Prometheus
    really attaches (the operator runs outside the cluster here, so nothing scrapes it)."""
    empty = []
    for query in queries(pool=POOL, rate_interval="5m", namespace=namespace):
        if not prometheus.query(query.expr) and "kvfleet_operator_" not in query.expr:
            empty.append(query.panel)
    # Nothing was refused before an engine, and every request succeeded.
    assert set(empty) <= {"Refused before any engine", "Error ratio by revision"}, empty


def _promote(kube: KubeClient, kubectl: Kubectl, op: OperatorProcess, ns: str,
             hashes: dict[str, str], traffic: Traffic, argo: ArgoHealth) -> None:
    set_artifact(kube, ns, POOL, "smol-v2")
    # First the shadow phase: half the live requests are copied to the new revision, whose
    # answers nobody sees; live traffic stays on stable.
    shadow = _wait_rollout(kube, op, ns,
                           lambda r: (r.get("status") or {}).get("shadowPercent") == 50,
                           "the shadow phase", 240)
    argo.expect(shadow, "Progressing", "shadow")
    # The pool's status copies the Rollout's traffic at the pool's next reconcile: waited for,
    # not read at once (a read right after the Rollout moved saw the previous phase).
    pool = _wait_pool(kube, op, ns, POOL, lambda p: _traffic(p, "shadowPercent")
                      == {"stable": (100, 0), "shadow": (0, 50)}, "the pool's shadow traffic", 60)
    argo.expect(pool, "Progressing", "rollout-shadow")
    # Killed (SIGKILL: no clean shut-down) three times on the way, each time a new process
    # resumes from the Rollout's status alone: mid-analysis (the shadow phase judged once),
    # mid-step (the canary at 50 %) and mid-promotion (the final check at 100 %).
    _wait_rollout(kube, op, ns, lambda r: any(
        e["step"] == -1 for e in (r.get("status") or {}).get("evaluations", [])),
        "a first shadow evaluation", 240)
    op.restart(signal.SIGKILL)
    # Mid-step: the canary takes half the conversations and is being analysed; the operator
    # process dies and a new one resumes from the Rollout's status alone.
    canary = _wait_rollout(kube, op, ns,
                           lambda r: (r.get("status") or {}).get("currentWeight") == 50,
                           "weight 50%", 240)
    argo.expect(canary, "Progressing", "canary-step")
    _wait_pool(kube, op, ns, POOL, lambda p: _traffic(p) == {"stable": (50,), "canary": (50,)},
               "the pool's canary traffic at 50 %", 60)
    op.restart(signal.SIGKILL)
    _wait_rollout(kube, op, ns, lambda r: (r.get("status") or {}).get("currentWeight") == 100
                  or _phase("Promoted", "RolledBack", "Paused")(r), "weight 100%", 240)
    op.restart(signal.SIGKILL)
    done = _wait_rollout(kube, op, ns, _phase("Promoted", "RolledBack", "Paused"), "Promoted",
                         240)
    status = done["status"]
    assert status["phase"] == "Promoted", yaml.safe_dump(status)
    argo.expect(done, "Healthy", "promoted")
    assert status["stableRevision"] == hashes["smol-v2"]
    analysed = {(e["step"], e["outcome"]) for e in status["evaluations"]}
    assert {(-1, "Pass"), (0, "Pass"), (1, "Pass")} <= analysed, analysed
    # No evaluation lost or counted twice across the kills: each window slot appears once.
    slots = [(e["revision"], e["step"], e["index"]) for e in status["evaluations"]]
    assert len(slots) == len(set(slots)), slots
    assert len(_posted(kube, ns, "Promoted", 1)) == 1
    pool = _wait_pool(kube, op, ns, POOL, lambda p: not _pods(kube, ns, hashes["smol-v1"])
                      and _available(p), "the old revision retired", 120)
    assert pool["status"]["servingRevision"] == hashes["smol-v2"]
    assert not pool["status"].get("traffic")
    argo.expect(pool, "Healthy", "promoted")
    table = kubectl("get", "rollouts", "-n", ns).stdout.splitlines()
    assert table[0].split()[:5] == ["NAME", "POOL", "PHASE", "STEP", "WEIGHT"]
    assert table[1].split()[:3] == [POOL, POOL, "Promoted"]
    with traffic.lock:
        assert traffic.revisions[hashes["smol-v2"][:12]] > 0


def _traffic(pool: JsonObj, *fields: str) -> dict[str, tuple[Any, ...]]:
    """role -> (weight, *fields) of the pool's status.traffic."""
    return {t["role"]: (t["weight"], *(t[f] for f in fields))
            for t in (pool.get("status") or {}).get("traffic") or []}


def _roll_back(kube: KubeClient, op: OperatorProcess, ns: str, hashes: dict[str, str],
               traffic: Traffic, faults: dict[str, str], argo: ArgoHealth) -> None:
    os.environ[FAULTS_ENV] = slow_fault(hashes["smol-v3"])
    stable_pods = _pods(kube, ns, hashes["smol-v2"])
    assert stable_pods
    started = time.monotonic()
    set_artifact(kube, ns, POOL, "smol-v3")
    done = _wait_rollout(kube, op, ns, lambda r: _phase("RolledBack", "Promoted", "Paused")(r)
                         and r["status"].get("canaryRevision") == hashes["smol-v3"],
                         "RolledBack", 240)
    _decided_in(started, "1 s more per token, shadow on")
    status = done["status"]
    assert status["phase"] == "RolledBack", yaml.safe_dump(status)
    # Judged against stable: in the shadow phase (end-to-end latency per prompt class, no
    # live request ever served by it) or, if the shadow saw too few requests, at step 1.
    message = status["message"]
    in_shadow = message.startswith("shadow 50%:")
    assert "canary/stable" in message and (in_shadow or "step 1/2 weight 50%" in message), \
        message
    failed = [e for e in status["evaluations"] if e["revision"] == hashes["smol-v3"]]
    assert failed[-1]["outcome"] == "Fail" and failed[-1]["step"] == (-1 if in_shadow else 0)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "RolledBack")
    # Argo CD shows the rollout Degraded with the rollout's own reason.
    assert argo.expect(done, "Degraded", "rolled-back").message == status["message"]
    # Traffic moved back first; the stable pods were never restarted or replaced.
    pool = _wait_pool(kube, op, ns, POOL, lambda p: not _traffic(p),
                      "the pool's traffic back on stable", 60)
    assert pool["status"]["servingRevision"] == hashes["smol-v2"]
    argo.expect(pool, "Healthy", "stable-after-rollback")  # stable serves on
    assert _pods(kube, ns, hashes["smol-v2"]) == stable_pods
    _wait_pool(kube, op, ns, POOL, lambda p: not _pods(kube, ns, hashes["smol-v3"]),
               "the canary removed", 60)
    assert _events(kube, ns, "RolledBack")


def _gpu_hog(kube: KubeClient, namespace: str, node: str) -> str:
    """A pod holding every GPU of the local node that the pool's one replica leaves free (a
    sleeping process)."""
    free = int(kube.get("Node", node)["status"]["allocatable"]["nvidia.com/gpu"]) - 1
    _create(kube, {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": "gpu-hog", "namespace": namespace},
                   "spec": {"nodeName": node, "tolerations": tolerations(),
                            "containers": [{"name": "hog", "image": "python",
                                            "command": ["python", "-c",
                                                        "import time; time.sleep(3600)"],
                                            "resources": {"limits": {
                                                "nvidia.com/gpu": str(free)}}}]}})
    return "gpu-hog"


def test_capacity_outage_and_requests_each_say_what_they_do(
    kube: KubeClient, kubectl: Kubectl, kubectl_path: str, operator: OperatorProcess,  # noqa: F811
    namespace: str, local_node: str, fake_nodes: list[str], cluster: Any,
    argo_health: ArgoHealth,
) -> None:
    """No free GPU for the canary: the rollout says so and stable serves on. Prometheus down
    mid-step: the rollout pauses and holds its weight; back up: it goes on. Then a person's
    requests, each sent twice: pause (Argo CD's action), resume, abort, retry and
    promote --full (the kubectl plugin). Argo CD's health checks judge each state."""
    if not isinstance(cluster, DevCluster):
        pytest.skip("stops and restarts the harness's own Prometheus")
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
           "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '')}"}

    def plugin(*args: str) -> str:
        done = subprocess.run([kubectl_path, "kvfleet", "rollout", *args, POOL, "-n", namespace],
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    with _only_the_local_l4_node(kube, kubectl):
        # Each passed step waits for a person's promote: nothing moves unless asked.
        hashes = _setup(kube, namespace, auto_promote=False, keep_previous_seconds=600)
        _wait_pool(kube, operator, namespace, POOL, _available, "the first revision Ready", 300)
        url = router_on_node(kube, namespace, local_node)
        hog = _gpu_hog(kube, namespace, local_node)
        traffic = Traffic(url, workers=1)
        try:
            stable_pods = _pods(kube, namespace, hashes["smol-v1"])
            set_artifact(kube, namespace, POOL, "smol-v2")
            waiting = _wait_rollout(
                kube, operator, namespace,
                lambda r: any(c["type"] == "CapacityOK" and c["status"] == "False"
                              for c in (r.get("status") or {}).get("conditions", [])),
                "CapacityOK=False", 90)
            capacity = next(c for c in waiting["status"]["conditions"]
                            if c["type"] == "CapacityOK")
            assert capacity["reason"] == "InsufficientCapacity"
            assert "nvidia.com/gpu" in capacity["message"], capacity
            assert waiting["status"]["currentWeight"] == 0
            argo_health.expect(waiting, "Progressing", "insufficient-capacity")
            pool = _get(kube, "ServingPool", namespace, POOL)
            assert _available(pool) and pool["status"]["servingRevision"] == hashes["smol-v1"]
            assert _pods(kube, namespace, hashes["smol-v1"]) == stable_pods
            kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{hog}")

            _wait_rollout(kube, operator, namespace,
                          lambda r: (r.get("status") or {}).get("currentWeight") == 50,
                          "weight 50% once the GPU is free", 180)
            cluster.prometheus.stop()
            try:
                paused = _wait_rollout(
                    kube, operator, namespace,
                    lambda r: (r.get("status") or {}).get("pauseReason") == "AnalysisError",
                    "paused on the outage", 60)
                assert paused["status"]["currentWeight"] == 50
                # Waiting for Prometheus, not for a person: Suspended, not Degraded.
                argo_health.expect(paused, "Suspended", "paused-prometheus-down")
                time.sleep(8)  # it holds: neither forward nor back while Prometheus is away
                held = kube.request("GET", ROLLOUTS.format(ns=namespace) + f"/{POOL}")
                assert (held["status"]["phase"], held["status"]["currentWeight"]) == (
                    "Paused", 50)
            finally:
                cluster.restart_prometheus()
            _wait_rollout(kube, operator, namespace,
                          lambda r: "waiting for a promote request" in
                          (r.get("status") or {}).get("message", ""),
                          "step 1 passed once the analysis ran again", 90)

            running = kube.request("GET", ROLLOUTS.format(ns=namespace) + f"/{POOL}")
            offered = argo_health.settings.actions(running)
            assert (offered["pause"], offered["resume"], offered["promote"]) == (
                False, True, False), offered
            for _ in range(2):  # Argo CD's pause action, clicked twice
                request = argo_health.settings.run_action(running, "pause")
                kube.merge_patch("Rollout", POOL, {"metadata": {"annotations": {
                    REQUEST_ANNOTATION: json.dumps(request)}}}, namespace)
            manual = _wait_rollout(
                kube, operator, namespace,
                lambda r: (r.get("status") or {}).get("pauseReason") == "Manual",
                "paused on request", 30)
            argo_health.expect(manual, "Suspended", "paused-manual")
            offered = argo_health.settings.actions(manual)
            assert (offered["pause"], offered["resume"]) == (True, False), offered
            plugin("resume")
            _wait_rollout(kube, operator, namespace, _phase("Progressing"), "resumed", 30)
            for action in ("abort", "abort"):
                plugin(action)
            aborted = _wait_rollout(kube, operator, namespace, _phase("Aborted"), "aborted", 30)
            argo_health.expect(aborted, "Degraded", "aborted")
            pool = _get(kube, "ServingPool", namespace, POOL)
            table = {t["role"]: t["weight"] for t in pool["status"].get("traffic") or []}
            assert table in ({}, {"stable": 100})  # while the canary drains: stable's alone
            assert pool["status"]["servingRevision"] == hashes["smol-v1"]
            assert len(_posted(kube, namespace, "Aborted", 1)) == 1
            assert _pods(kube, namespace, hashes["smol-v1"]) == stable_pods  # never restarted
            for action in ("retry", "retry"):
                plugin(action)
            _wait_rollout(kube, operator, namespace, _phase("Progressing"), "retried", 30)
            started = _posted(kube, namespace, "RolloutStarted", 2)
            assert len(started) == 2, started
            plugin("promote", "--full")
            _undo_after_promotion(kube, operator, namespace, hashes, stable_pods, traffic,
                                  argo_health, plugin)
        finally:
            traffic.close()
    assert traffic.failures == [], traffic.failures[:5]


def _undo_after_promotion(kube: KubeClient, op: OperatorProcess, namespace: str,
                          hashes: dict[str, str], stable_pods: dict[str, str], traffic: Traffic,
                          argo_health: ArgoHealth, plugin: Callable[..., str]) -> None:
    """Promoted with the old revision kept (its one replica, no traffic): an undo is a
    scale-up of pods that never stopped, not a cold start, and the promoted revision is
    rolled back, removed and refused."""
    promoted = _wait_rollout(kube, op, namespace, _phase("Promoted"), "promoted", 180)
    assert "Phase:     Promoted" in plugin("status")
    assert promoted["status"]["previousRevision"] == hashes["smol-v1"]
    _wait_pool(kube, op, namespace, POOL,
               lambda p: p["status"].get("servingRevision") == hashes["smol-v2"]
               and not _traffic(p), "the promoted revision serving", 60)
    assert _pods(kube, namespace, hashes["smol-v1"]) == stable_pods
    assert argo_health.settings.actions(promoted)["undo"] is False  # offered
    with traffic.lock:
        before = traffic.revisions[hashes["smol-v1"][:12]]
    undone_at = time.monotonic()
    plugin("undo")
    _wait_pool(kube, op, namespace, POOL,
               lambda p: p["status"].get("servingRevision") == hashes["smol-v1"],
               "servingRevision back on the kept revision", 30)
    while True:  # its answers come back at once: the router follows the pool
        with traffic.lock:
            if traffic.revisions[hashes["smol-v1"][:12]] > before:
                break
        assert time.monotonic() - undone_at < 30, "no answer from the kept revision"
        time.sleep(0.2)
    print(f"undo: first answer from the kept revision "
          f"{time.monotonic() - undone_at:.1f}s after the request")
    assert _pods(kube, namespace, hashes["smol-v1"]) == stable_pods  # the same pods
    back = _wait_rollout(kube, op, namespace, _phase("RolledBack"),
                         "the promoted revision rolled back", 60)
    assert "undone on request after promotion" in back["status"]["message"]
    assert len(_posted(kube, namespace, "RollingBack", 1)) == 1
    pool = _wait_pool(kube, op, namespace, POOL,
                      lambda p: not _pods(kube, namespace, hashes["smol-v2"]),
                      "the promoted revision removed", 60)
    assert hashes["smol-v2"] in [r["revision"] for r in
                                 pool["status"].get("refusedRevisions", [])]


def test_silence_pauses_a_new_artifact_restarts_from_stable_and_a_crash_rolls_back(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,  # noqa: F811
    local_node: str, fake_nodes: list[str], argo_health: ArgoHealth, faults: dict[str, str],
) -> None:
    """No traffic at all: the step waits for samples, then puts its live traffic back on
    stable and pauses saying so, never passes (and with probe prompts, at the end, the
    routers' own requests judge and promote a revision with no client at all).
    The artifactRef changed again meanwhile: the rollout restarts from stable with the new
    canary (the previous canary removed, stable untouched). That canary's engine crashes
    some seconds after it is ready (its container restarts): the restart watch rolls it
    back, naming the pod and exit code, with no request judged at all."""
    with _only_the_local_l4_node(kube, kubectl):
        hashes = _setup(kube, namespace, max_wait_seconds=12)
        os.environ[FAULTS_ENV] = f"{hashes['smol-v3'][:12]}:exit_after=8"
        _wait_pool(kube, operator, namespace, POOL, _available, "the first revision Ready", 300)
        stable_pods = _pods(kube, namespace, hashes["smol-v1"])
        set_artifact(kube, namespace, POOL, "smol-v2")
        paused = _wait_rollout(
            kube, operator, namespace,
            lambda r: (r.get("status") or {}).get("pauseReason") == "TooFewSamples",
            "paused for want of samples", 180)
        status = paused["status"]
        # onTimeout HoldAtZero (the default): live traffic back on stable, canary pods kept.
        assert status["currentWeight"] == 0 and status["currentStep"] == 0
        assert "no conclusive analysis in" in status["message"]
        assert all(e["outcome"] == "Waiting" for e in status["evaluations"])
        assert next(c for c in status["conditions"] if c["type"] == "Degraded")["reason"] == \
            "TooFewSamples"
        # A pause only a person can end: Degraded, with the reason.
        argo_health.expect(paused, "Degraded", "paused-too-few-samples")

        set_artifact(kube, namespace, POOL, "smol-v3")
        restarted = _wait_rollout(
            kube, operator, namespace,
            lambda r: (r.get("status") or {}).get("canaryRevision") == hashes["smol-v3"],
            "restarted on the new artifact", 60)
        assert restarted["status"]["phase"] == "Progressing"
        assert restarted["status"]["stableRevision"] == hashes["smol-v1"]
        # (Events are posted after the status that records them: waited for.)
        assert any("the revision changed during a rollout" in e.get("message", "")
                   for e in _posted(kube, namespace, "RolloutStarted", 2))
        _wait_pool(kube, operator, namespace, POOL,
                   lambda p: not _pods(kube, namespace, hashes["smol-v2"]),
                   "the first canary removed", 60)
        started = time.monotonic()
        crashed = _wait_rollout(kube, operator, namespace, _phase("RollingBack", "RolledBack"),
                                "the crashing canary rolled back", 120)
        _decided_in(started, "a canary crashing 8 s after ready")
        message = crashed["status"]["message"]
        assert re.search(r"the canary's pods restarted \d+ times \(at most 0\): pod ",
                         message), message
        assert "(exit code 1)" in message and "injected crash" in message, message
        pool = _get(kube, "ServingPool", namespace, POOL)
        assert pool["status"]["servingRevision"] == hashes["smol-v1"]
        assert _pods(kube, namespace, hashes["smol-v1"]) == stable_pods

        # Still no client at all, but the policy now lists probe prompts and a router runs:
        # the routers' own requests are the evidence, and smol-v2 is judged and promoted.
        # (maxWaitSeconds back to the demo's: 12 s was for the silence above.)
        kube.merge_patch("Rollout", POOL, {"spec": {"analysis": {
            "probePrompts": ["Say hello.", "Name a colour.", "What is 2 + 2?"],
            "probeRatePerSecond": 6, "probeMaxTokens": 8, "maxWaitSeconds": 120}}},
            namespace)
        router_on_node(kube, namespace, local_node)
        started = time.monotonic()
        set_artifact(kube, namespace, POOL, "smol-v2")
        quiet = _wait_rollout(kube, operator, namespace, lambda r: _phase(
            "Promoted", "RolledBack", "Paused")(r) and r["status"].get("canaryRevision") ==
            hashes["smol-v2"], "promoted on the routers' own requests", 240)
        _decided_in(started, "a quiet pool with probe prompts")
        assert quiet["status"]["phase"] == "Promoted", yaml.safe_dump(quiet["status"])
        judged = [m for e in quiet["status"]["evaluations"] if e["revision"] == hashes["smol-v2"]
                  and e["outcome"] == "Pass" for m in e["metrics"] if m["name"] == "ttft"]
        assert judged and all(m["samples"] >= 12 for m in judged), judged



def _condition(obj: JsonObj, kind: str) -> JsonObj:
    return next((c for c in (obj.get("status") or {}).get("conditions", [])
                 if c["type"] == kind), {})


STAY_OUT = 15.0  # seconds a refused revision is watched for, after each change is seen


def _stays_out(kube: KubeClient, ns: str, revision: str, seconds: float,
               rollout_phase: str | None) -> None:
    """No pod of `revision` for `seconds`; the Rollout (if any) in `rollout_phase`."""
    watch_until = time.monotonic() + seconds
    while time.monotonic() < watch_until:
        assert not _pods(kube, ns, revision)
        if rollout_phase is not None:
            rollout = _get(kube, "Rollout", ns, POOL)
            assert (rollout.get("status") or {}).get("phase") == rollout_phase, rollout
        time.sleep(2)


def _patch_analysis(kube: KubeClient, ns: str, **analysis: Any) -> None:
    kube.merge_patch("Rollout", POOL, {"spec": {"analysis": analysis}}, ns)


def _decided_in(started: float, what: str) -> float:
    took = time.monotonic() - started
    print(f"\ntime to decision, {what}: {took:.0f} s")  # bench/README's figures
    return took


@pytest.mark.usefixtures("shared_cores")
def test_errors_inside_a_200_are_stopped_stay_out_and_a_broken_query_is_bounded(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,  # noqa: F811
    local_node: str, fake_nodes: list[str], faults: dict[str, str], argo_health: ArgoHealth,
) -> None:
    """a) A canary whose engines end 20 % of their streams with an error frame under HTTP 200
    is rolled back at its first analysed step; only its own streams failed.
    d) A threshold edit after the rollback, then the Rollout deleted, then created anew: the
    bad revision gets no request and no pod after any of them, and the pool's
    RevisionRefused condition says why.
    e) A canary that changes one engine setting (maxModelLength) is a rollout like an
    artifact's, its RolloutStarted naming the setting; with a custom query that returns two
    series, its weight is back at 0 within the bound, Degraded says why."""
    with _only_the_local_l4_node(kube, kubectl):
        hashes = _setup(kube, namespace)
        _wait_pool(kube, operator, namespace, POOL, _available, "the first revision Ready", 300)
        stable_pods = _pods(kube, namespace, hashes["smol-v1"])
        bad = hashes["smol-v2"][:12]
        os.environ[FAULTS_ENV] = stream_error_fault(hashes["smol-v2"])
        traffic = Traffic(router_on_node(kube, namespace, local_node))
        try:
            started = time.monotonic()
            set_artifact(kube, namespace, POOL, "smol-v2")
            done = _wait_rollout(kube, operator, namespace, lambda r: _phase(
                "RolledBack", "Promoted", "Paused")(r) and r["status"].get(
                "canaryRevision") == hashes["smol-v2"], "the stream-error canary stopped", 300)
            _decided_in(started, "errors inside a 200 (stream_error_rate 0.2)")
            status = done["status"]
            assert status["phase"] == "RolledBack", yaml.safe_dump(status)
            assert status["message"].startswith("step 1/2 weight 50%:") and \
                "errors" in status["message"], status["message"]
            _wait_pool(kube, operator, namespace, POOL, lambda p: not _pods(kube, namespace,
                       hashes["smol-v2"]), "the bad canary removed", 60)
            with traffic.lock:
                served_by_bad, failures = traffic.revisions[bad], list(traffic.failures)
            assert failures, "the fault never fired: the test proves nothing"
            assert all(f" from {bad}:" in f for f in failures), failures[:5]

            # d) An edit of the policy is not a new rollout of the known-bad revision; nor is
            # deleting the Rollout (a policy file removed from Git), nor applying it anew:
            # the pool itself refuses the revision, and says so.
            # Each change is watched for STAY_OUT seconds after the operator has seen it: a
            # canary it wrongly started would have pods within a few (the local runner).
            _patch_analysis(kube, namespace, byPromptLength={
                "maxRatio": 5.0, "minSamples": 12, "minDifferenceSeconds": 2.0})
            _wait_rollout(kube, operator, namespace, lambda r: r["status"].get(
                "observedGeneration") == r["metadata"]["generation"], "the edit seen", 30)
            _stays_out(kube, namespace, hashes["smol-v2"], STAY_OUT, rollout_phase="RolledBack")
            policy = _get(kube, "Rollout", namespace, POOL)
            kube.delete("Rollout", POOL, namespace)
            refused = _wait_pool(kube, operator, namespace, POOL, lambda p: _condition(
                p, "RevisionRefused").get("status") == "True", "RevisionRefused", 30)
            assert _condition(refused, "RevisionRefused")["reason"] == "RolledBack"
            assert [r["revision"] for r in refused["status"]["refusedRevisions"]] == [
                hashes["smol-v2"]]
            _stays_out(kube, namespace, hashes["smol-v2"], STAY_OUT, rollout_phase=None)
            kube.create({"apiVersion": policy["apiVersion"], "kind": "Rollout",
                         "metadata": {"name": POOL, "namespace": namespace},
                         "spec": policy["spec"]})
            rollout = _wait_rollout(kube, operator, namespace, _phase("Idle"),
                                    "the new Rollout Idle", 30)
            assert "RevisionRefused" in rollout["status"]["message"], rollout["status"]
            _stays_out(kube, namespace, hashes["smol-v2"], STAY_OUT, rollout_phase="Idle")
            with traffic.lock:
                assert traffic.revisions[bad] == served_by_bad, traffic.revisions

            # e) A custom query that can never be judged (a series per revision), on a canary
            # that is stable's artifact with one engine setting changed.
            _patch_analysis(kube, namespace, maxWaitSeconds=12, metrics=[
                *rollout["spec"]["analysis"]["metrics"],
                {"name": "per-revision", "threshold": 1e9, "query":
                 'sum by (revision) (kvfleet_router_requests_total{namespace="{{namespace}}",'
                 'pool="{{pool}}"})'}])
            kube.merge_patch("ServingPool", POOL, {"spec": {
                "artifactRef": {"name": "smol-v1"}, "engine": {"maxModelLength": 1536}}},
                namespace)
            canary = _wait_rollout(kube, operator, namespace,
                                   lambda r: (r.get("status") or {}).get("currentWeight") == 50,
                                   "the settings canary at 50 %", 240)["status"]
            change = "settings KVFLEET_MAX_MODEL_LEN 2048 -> 1536"
            assert canary["canaryChange"] == change, canary
            assert canary["canaryRevision"] not in hashes.values()
            started_events = [e["message"] for e in _events(kube, namespace, "RolloutStarted")]
            assert any(m.startswith(change) for m in started_events), started_events
            started = time.monotonic()
            held = _wait_rollout(
                kube, operator, namespace,
                lambda r: (r.get("status") or {}).get("pauseReason") == "AnalysisUnavailable",
                "the canary back at 0 on the broken query", 90)
            analysis = held["spec"]["analysis"]
            bound = (analysis["warmupSeconds"] + analysis["scrapeDelaySeconds"]
                     + analysis["maxWaitSeconds"] + analysis["intervalSeconds"])
            assert _decided_in(started, "a query returning two series") <= bound + 5
            assert held["status"]["currentWeight"] == 0
            degraded = next(c for c in held["status"]["conditions"] if c["type"] == "Degraded")
            assert (degraded["status"], degraded["reason"]) == ("True", "AnalysisUnavailable")
            assert "series" in degraded["message"] and "back on stable" in \
                degraded["message"], degraded
            pool = _wait_pool(kube, operator, namespace, POOL,
                              lambda p: _traffic(p) == {"stable": (100,)},
                              "the pool's traffic back on stable", 60)
            assert pool["status"]["servingRevision"] == hashes["smol-v1"]
        finally:
            traffic.close()
        assert _pods(kube, namespace, hashes["smol-v1"]) == stable_pods
        assert all(f" from {bad}:" in f for f in traffic.failures), traffic.failures[:5]


def _rolled_back(kube: KubeClient, operator: OperatorProcess, ns: str,  # noqa: F811
                 revision: str, what: str, timeout: float) -> tuple[JsonObj, dict[str, str]]:
    """Waits for the rollout of `revision` to stop (timed, as `what`); asserts it rolled
    back. Its status, and the outcome of each metric of the last window that judged it."""
    started = time.monotonic()
    done = _wait_rollout(kube, operator, ns, lambda r: _phase(
        "RolledBack", "Promoted", "Paused")(r) and r["status"].get(
        "canaryRevision") == revision, f"the canary {what} stopped", timeout)
    _decided_in(started, what)
    status = done["status"]
    assert status["phase"] == "RolledBack", yaml.safe_dump(status)
    status["evaluations"] = [e for e in status["evaluations"] if e["revision"] == revision]
    return status, {m["name"]: m["outcome"] for m in status["evaluations"][-1]["metrics"]}


@pytest.mark.usefixtures("shared_cores")
def test_a_canary_slow_only_on_long_prompts_is_stopped_by_the_prompt_class_split(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,  # noqa: F811
    local_node: str, fake_nodes: list[str], faults: dict[str, str],
) -> None:
    """c) A canary 14 s slower on prompts of 1300 tokens, which are 1 request in 60: the p95
    over all requests does not see it, the ≤4096-token class does. Rolled back by the window
    in which every all-requests latency metric passed, so the split is what caught it.
    d) A canary refusing those prompts (a smaller maxModelLength), 1 request in 30: rolled
    back by the class's error rate against stable's, its error rate over all requests not
    failing the pool's 5 % SLO."""
    with _only_the_local_l4_node(kube, kubectl):
        hashes = _setup(kube, namespace)
        # Long requests are rare: a step long enough to see a few (some 14 at the 5.7 requests
        # a second measured here, each revision's 3 missed about 1 time in 80), a class
        # minimum to match. The p95 over all requests is judged on 60 of the canary's: 3 slow
        # in 60 is 5 %, still fast. On the demo's 12 a p95 is nearly the slowest request, and
        # a window with 2 slow in 38 failed it (a share of 1 in N holds only on average).
        # TPOT likewise: a long prompt's prefill (3 chunks of 512 tokens) stalls the decode of
        # the requests beside it on both revisions, and a CI run's TPOT p95 on 38 canary
        # samples read 9x stable's (0.78 s against 0.085 s) and rolled back the control.
        policy = kube.get("Rollout", POOL, namespace)["spec"]
        metrics = [{**m, "minSamples": 60} if m["name"] in ("ttft", "tpot") else m
                   for m in policy["analysis"]["metrics"]]
        kube.merge_patch("Rollout", POOL, {"spec": {
            "steps": [{"weight": 50, "pauseSeconds": 150}, {"weight": 100}],
            "analysis": {"metrics": metrics,
                         "byPromptLength": {"maxRatio": 3.0, "minSamples": 3,
                                            "minDifferenceSeconds": 1.0}}}}, namespace)
        _wait_pool(kube, operator, namespace, POOL, _available, "the first revision Ready", 300)
        stable_pods = _pods(kube, namespace, hashes["smol-v1"])
        slow = hashes["smol-v2"]
        os.environ[FAULTS_ENV] = long_prompt_fault(slow)
        traffic = Traffic(router_on_node(kube, namespace, local_node), long_every=60)
        try:
            set_artifact(kube, namespace, POOL, "smol-v2")
            status, outcomes = _rolled_back(kube, operator, namespace, slow,
                                            "slow on long prompts only (1 in 60)", 420)
            assert "-le4096 canary/stable" in status["message"], status["message"]
            # The window that failed it judged the same requests over all prompts too: those
            # metrics passed (or had too few samples), so without the split it went on.
            failed = status["evaluations"][-1]
            overall = {n: o for n, o in outcomes.items() if "-le" not in n and "-over" not in n}
            assert "Fail" not in overall.values(), yaml.safe_dump(failed)
            assert any(o == "Fail" for n, o in outcomes.items() if "-le4096" in n), outcomes
            _wait_pool(kube, operator, namespace, POOL, lambda p: not _pods(kube, namespace,
                       slow), "the slow canary removed", 60)
            assert _pods(kube, namespace, hashes["smol-v1"]) == stable_pods
            with traffic.lock:
                assert traffic.failures == [], traffic.failures[:5]
                traffic.long_every = 30  # 3 % of the requests

            # d) A canary refusing the long prompts (maxModelLength 1024 < their 1300 tokens),
            # 3 % of the traffic: under the pool's 5 % error-rate SLO over all requests, the
            # <=4096-token class's error rate against stable's stops it. (The rate over all
            # requests is given the 300 samples it takes to tell 3 % from 5 % at all: on a
            # dozen, one refusal is 8 % and fails it by chance.)
            kube.merge_patch("Rollout", POOL, {"spec": {"analysis": {"metrics": [
                {**m, "minSamples": 300} if m["name"] == "errors" else m for m in metrics]}}},
                namespace)
            kube.merge_patch("ServingPool", POOL, {"spec": {
                "artifactRef": {"name": "smol-v1"}, "engine": {"maxModelLength": 1024}}},
                namespace)
            refusing = _wait_rollout(kube, operator, namespace, lambda r: (
                r.get("status") or {}).get("canaryChange", "").startswith(
                "settings KVFLEET_MAX_MODEL_LEN"), "the settings canary started", 60)
            short = refusing["status"]["canaryRevision"]
            status, outcomes = _rolled_back(kube, operator, namespace, short,
                                            "refusing long prompts only (1 in 30)", 300)
            assert "errorrate-le4096 canary" in status["message"], status["message"]
            assert outcomes["errorrate-le4096"] == "Fail", outcomes
            assert outcomes["errors"] != "Fail", outcomes
        finally:
            traffic.close()
        refused = traffic.failures
        assert refused and all(f" from {short[:12]}:" in f and "context" in f
                               for f in refused), refused[:5]
        assert traffic.codes["200"] > 80, traffic.codes


def _perturbed_revision(name: str, namespace: str, folder: Path) -> JsonObj:
    """The embedded SmolLM2 with one norm tensor scaled x1.5: same shapes, same speed, wrong
    answers (bench/README: answer agreement 0.06 with the original)."""
    from kvfleet.api.gguf_artifact import embedded_gguf_path
    from kvfleet.devcluster.perturb import scale_norm

    wrong = scale_norm(embedded_gguf_path(), folder / "wrong.gguf")
    obj = smollm2_revision(name, 40, namespace)
    obj["spec"]["weights"]["files"] = [{
        "uri": wrong.as_uri(), "sha256": hashlib.sha256(wrong.read_bytes()).hexdigest(),
        "sizeBytes": wrong.stat().st_size}]
    return obj


@pytest.mark.usefixtures("shared_cores")
def test_a_canary_with_wrong_weights_at_the_right_speed_is_stopped_by_answer_agreement(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,  # noqa: F811
    local_node: str, fake_nodes: list[str], tmp_path: Path,
) -> None:
    """b) Same shapes, same speed, wrong answers: stopped in the shadow phase, before any
    live request reaches it; with the shadow phase removed, at the first analysed step (a
    second such artifact). The agreement score is in the Rollout's status."""
    with _only_the_local_l4_node(kube, kubectl):
        hashes = _setup(kube, namespace, shadow=True)
        wrong = _perturbed_revision("smol-wrong", namespace, tmp_path)
        kube.create(wrong)
        bad = revision_for(local_pool(POOL, "smol-v1", namespace), wrong)
        _wait_pool(kube, operator, namespace, POOL, _available, "the first revision Ready", 300)
        stable_pods = _pods(kube, namespace, hashes["smol-v1"])
        traffic = Traffic(router_on_node(kube, namespace, local_node))

        def stopped() -> JsonObj:  # (`bad` names the second artifact later)
            return _wait_rollout(kube, operator, namespace, lambda r: _phase(
                "RolledBack", "Promoted", "Paused")(r) and r["status"].get(
                "canaryRevision") == bad, "the wrong-weights canary stopped", 300)

        def agreement(status: JsonObj) -> JsonObj:
            last = [e for e in status["evaluations"] if e["revision"] == bad][-1]
            return next(m for m in last["metrics"] if m["name"] == "output-agreement")

        try:
            started = time.monotonic()
            set_artifact(kube, namespace, POOL, "smol-wrong")
            status = stopped()["status"]
            _decided_in(started, "wrong weights, shadow on")
            assert status["phase"] == "RolledBack", yaml.safe_dump(status)
            assert status["message"].startswith("shadow 50%:"), status["message"]
            assert status["currentWeight"] == 0
            with traffic.lock:
                assert traffic.revisions[bad[:12]] == 0  # no live request ever reached it
            score = agreement(status)
            assert score["outcome"] == "Fail" and score["canaryValue"] < score["threshold"], score
            print(f"agreement in the shadow phase: {score['canaryValue']:.3f} "
                  f"({score['message']})")

            # Without a shadow phase: another wrong artifact, stopped at the first step.
            kube.merge_patch("Rollout", POOL, {"spec": {"shadow": None}}, namespace)
            second = {**wrong, "metadata": {"name": "smol-wrong-2", "namespace": namespace},
                      "spec": {**wrong["spec"], "samplingDefaults": {"topK": 50}}}
            kube.create(second)
            bad = revision_for(local_pool(POOL, "smol-v1", namespace), second)
            started = time.monotonic()
            set_artifact(kube, namespace, POOL, "smol-wrong-2")
            status = stopped()["status"]
            _decided_in(started, "wrong weights, no shadow phase")
            assert status["phase"] == "RolledBack", yaml.safe_dump(status)
            assert status["message"].startswith("step 1/2 weight 50%:"), \
                yaml.safe_dump(status["evaluations"])
            score = agreement(status)
            assert score["outcome"] == "Fail" and score["canaryValue"] < score["threshold"], score
        finally:
            traffic.close()
        assert _pods(kube, namespace, hashes["smol-v1"]) == stable_pods
        assert traffic.failures == [], traffic.failures[:5]
