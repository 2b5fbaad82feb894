"""Autoscaling against the real parts: real engine pods on the dev cluster's local node, the
router as a pod, the harness's Prometheus scraping both, and the operator reading them with
one query an interval.

a) A load ramp: 1 -> 3 replicas, each new one Ready and served from, back to 1 once the load
   stops and the scale-down window has passed; the time to each decision is printed.
e) The router stopped: its series go stale, AutoscalingActive turns False within two
   intervals (plus Prometheus's scrape and staleness), and the count is held.
b) Idle -> 0, the next request held and served after the cold start, a burst after it.
d) No GPU for more replicas: ScalingLimited, the count stops growing, nothing hangs.
c) A scale-down while 8 streams run fails none of them; and with spec.engine.drainSeconds,
   streams longer than the default drain finish on the replica being removed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from e2e.test_operator_e2e import (  # noqa: F401 (crds is a fixture)
    Kubectl,
    OperatorProcess,
    _available,
    _cond,
    _get,
    _only_the_local_l4_node,
    _wait_pool,
    crds,
    operator_kubeconfig,
)
from e2e.test_rollout_e2e import faults  # noqa: F401 (a fixture)
from kvfleet.api.labels import ENGINE_PORT, ROUTER_APP
from kvfleet.devcluster.cluster import DevCluster, ExistingCluster
from kvfleet.devcluster.demo import (
    POOL,
    TENANT_KEY,
    Traffic,
    local_pool,
    router_on_node,
    smollm2_revision,
    stream_problem,
    tenant,
)
from kvfleet.devcluster.kube import KubeClient
from kvfleet.devcluster.prometheus import PrometheusClient
from kvfleet.engine.faults import FAULTS_ENV
from kvfleet.operator.revisions import revision_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

INTERVAL_S = 3  # the operator's --autoscale-interval here (15 s by default)


@pytest.fixture(scope="module")
def operator(
    cluster: DevCluster | ExistingCluster, crds: None, kube: KubeClient,  # noqa: F811
    kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OperatorProcess]:
    if cluster.prometheus is None:
        pytest.skip("no Prometheus: on an existing cluster set KVFLEET_PROMETHEUS_URL")
    folder = tmp_path_factory.mktemp("operator")
    proc = OperatorProcess(operator_kubeconfig(kube, kubectl, folder), folder,
                           cluster.prometheus.url,
                           extra_args=("--autoscale-interval", str(INTERVAL_S)))
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def _replicas(pool: dict) -> tuple[int, int]:
    return int(pool["spec"]["replicas"]), int((pool.get("status") or {}).get(
        "readyReplicas", 0))


def _served_by(prometheus: PrometheusClient, namespace: str) -> dict[str, float]:
    """Requests each engine pod of the namespace finished (its own counter)."""
    rows = prometheus.query(f'sum by (pod) (kvfleet_engine_requests_total{{namespace='
                            f'"{namespace}"}})')
    return {r["metric"]["pod"]: float(r["value"][1]) for r in rows}


def _scaled_by(pool: dict) -> str | None:
    return ((pool.get("status") or {}).get("autoscaling") or {}).get("signal")


def _inactive_warnings(kube: KubeClient, namespace: str) -> list[str]:
    return [e["message"] for e in kube.list("Event", namespace)
            if e.get("reason") == "AutoscalingInactive"]


def _decided(started: float, what: str) -> float:
    took = time.monotonic() - started
    print(f"\n[autoscale] {what}: {took:.1f} s")
    return took


def test_a_load_ramp_scales_out_and_back_and_lost_signals_hold_the_count(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,
    local_node: str, prometheus: PrometheusClient,
) -> None:
    with _only_the_local_l4_node(kube, kubectl):
        # Sized for one running stream per replica: three streams want three replicas. The
        # scale-down waits 20 s of quiet (300 s by default).
        _autoscaled_pool(kube, namespace, {
            "minReplicas": 1, "maxReplicas": 3, "targetLoad": 1.0,
            "scaleDownStabilizationSeconds": 20, "staleAfterSeconds": 30, "sloScaling": False})
        _wait_pool(kube, operator, namespace, POOL, _available, "the first replica Ready", 300)
        url = router_on_node(kube, namespace, local_node)
        steady = _wait_pool(kube, operator, namespace, POOL, lambda p: _cond(
            p, "AutoscalingActive").get("status") == "True", "autoscaling active", 60)
        assert _replicas(steady) == (1, 1), steady["status"]
        assert _scaled_by(steady) in ("min", "load"), steady["status"]

        # a) The ramp: three clients streaming without a pause.
        streams = Traffic(url, workers=3, max_tokens=48)
        try:
            started = time.monotonic()
            _wait_pool(kube, operator, namespace, POOL, lambda p: _replicas(p)[0] == 3,
                       "3 replicas asked for", 120)
            _decided(started, "1 -> 3 decided")
            # (the status follows at the pool's reconcile)
            _wait_pool(kube, operator, namespace, POOL, lambda p: _scaled_by(p) in (
                "load", "max"), "the status saying the load decided", 30)
            _wait_pool(kube, operator, namespace, POOL, lambda p: _replicas(p) == (3, 3),
                       "3 replicas Ready", 240)
            _decided(started, "3 Ready")
            revision = _revision(kube, namespace)

            def all_served() -> bool:
                served = _served_by(prometheus, namespace)
                return len([v for v in served.values() if v > 0]) >= 3

            kube.wait_for("each of the 3 engines serving", all_served, 90)
            pods = kube.list("Pod", namespace, label_selector=f"kvfleet.io/revision={revision}")
            assert len(pods) == 3, [p["metadata"]["name"] for p in pods]
        finally:
            # The load falls from here: close() then waits for the streams under way, which
            # end one by one (a CI run timed the window from close()'s return and saw 16 s).
            stopped = time.monotonic()
            streams.close()
        assert streams.failures == [], streams.failures[:5]
        assert streams.codes == {"200": streams.codes["200"]} and streams.codes["200"] > 10
        _wait_pool(kube, operator, namespace, POOL, lambda p: _replicas(p)[0] == 1,
                   "back to 1 replica", 120)
        took = _decided(stopped, "3 -> 1 decided after the load stopped")
        # The last sample with all three streams running can precede the stop by an interval
        # (a client between two streams when it was taken); without the window the decision
        # would come within one interval and a scrape.
        assert took >= 20 - 2 * INTERVAL_S, "the scale-down did not wait its window"
        _wait_pool(kube, operator, namespace, POOL, lambda p: _scaled_by(p) in ("min", "load"),
                   "the status saying the quiet decided", 30)
        events = kube.list("Event", namespace)
        scaled = [e["message"] for e in events if e.get("reason") == "Scaled"]
        assert any(m.startswith("1 -> ") for m in scaled), scaled

        # e) The router stopped: no router series for the pool, so nothing measures demand.
        warnings_before = _inactive_warnings(kube, namespace)
        kubectl("-n", namespace, "scale", "deployment", "-l",
                f"app.kubernetes.io/name={ROUTER_APP}", "--replicas=0")
        stopped = time.monotonic()
        held = _wait_pool(kube, operator, namespace, POOL, lambda p: _cond(
            p, "AutoscalingActive").get("status") == "False", "AutoscalingActive False", 60)
        assert _decided(stopped, "AutoscalingActive False after the router stopped") <= \
            2 * INTERVAL_S + 10, "not within two intervals (and a scrape, and staleness)"
        message = _cond(held, "AutoscalingActive")["message"]
        assert "no router reports the pool" in message and "holding 1" in message, message
        assert _replicas(_get(kube, "ServingPool", namespace, POOL))[0] == 1
        time.sleep(3 * INTERVAL_S)
        warned = _inactive_warnings(kube, namespace)
        assert len(warned) == len(warnings_before) + 1, warned  # once, not every interval


def _autoscaled_pool(kube: KubeClient, namespace: str, autoscaling: dict) -> None:
    """The demo's SmolLM2 revision, tenant and local pool, with `autoscaling`."""
    artifact = smollm2_revision("smol", 40, namespace)
    kube.create(artifact)
    tenant(kube, namespace)
    pool = local_pool(POOL, "smol", namespace)
    pool["spec"]["autoscaling"] = autoscaling
    kube.create(pool)


def _revision(kube: KubeClient, namespace: str) -> str:
    """The short revision the operator says the pool's spec asks for."""
    return str(kube.get("ServingPool", POOL, namespace)["status"]["revision"])[:12]


def _first_token(url: str) -> tuple[int, float, str]:
    """One streamed request: its status, seconds to the first content frame, and text."""
    body = {"model": POOL, "max_tokens": 8, "stream": True,
            "messages": [{"role": "user", "content": "Say hello to the morning."}]}
    started, first = time.monotonic(), None
    with httpx.Client(timeout=600) as client, client.stream(
            "POST", url + "/v1/chat/completions", json=body,
            headers={"authorization": f"Bearer {TENANT_KEY}"}) as resp:
        chunks = []
        for line in resp.iter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.monotonic() - started
            chunks.append(line)
    return resp.status_code, first if first is not None else float("inf"), "\n".join(chunks)


def test_an_idle_pool_sleeps_at_zero_and_its_next_request_wakes_it(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,
    local_node: str,
) -> None:
    """b) Idle -> 0 replicas, still listed; a request arrives, is held, and is answered once
    a replica is up (its time to first token is the cold start, printed); a burst right after
    fails nothing."""
    with _only_the_local_l4_node(kube, kubectl):
        _autoscaled_pool(kube, namespace, {
            "minReplicas": 0, "maxReplicas": 2, "targetLoad": 4.0,
            "scaleToZero": {"idleSeconds": 30}, "scaleDownStabilizationSeconds": 20})
        _wait_pool(kube, operator, namespace, POOL, _available, "the first replica Ready", 300)
        url = router_on_node(kube, namespace, local_node)
        started = time.monotonic()
        _wait_pool(kube, operator, namespace, POOL, lambda p: _replicas(p)[0] == 0,
                   "scaled to zero", 180)
        _decided(started, "1 -> 0 after 30 s idle")
        _wait_pool(kube, operator, namespace, POOL, lambda p: _scaled_by(p) == "idle",
                   "the status saying idle decided", 30)
        revision = _revision(kube, namespace)
        kube.wait_for("the engine pod gone", lambda: not kube.list(
            "Pod", namespace, label_selector=f"kvfleet.io/revision={revision}") or None, 120)
        pool_now = _wait_pool(kube, operator, namespace, POOL, _available, "Available at 0", 60)
        assert _cond(pool_now, "Available")["reason"] == "ScaledToZero"
        models = httpx.get(url + "/v1/models",
                           headers={"authorization": f"Bearer {TENANT_KEY}"}).json()
        assert [m["id"] for m in models["data"]] == [POOL]

        status, ttft, text = _first_token(url)
        assert status == 200 and text.rstrip().endswith("[DONE]"), text[:500]
        print(f"\n[autoscale] a request to a pool at zero: first token after {ttft:.1f} s "
              "(the cold start)")
        assert _replicas(_get(kube, "ServingPool", namespace, POOL))[0] == 1
        woke = [e["message"] for e in kube.list("Event", namespace)
                if e.get("reason") == "Scaled" and e["message"].startswith("0 -> 1")]
        assert woke and "(held: 1 requests held)" in woke[0], woke

        results: list[tuple[int, float, str]] = []
        burst = [threading.Thread(target=lambda: results.append(_first_token(url)))
                 for _ in range(12)]
        for thread in burst:
            thread.start()
        for thread in burst:
            thread.join(300)
        assert [r[0] for r in results] == [200] * 12, [r[2][:200] for r in results]


def _occupy_gpus(kube: KubeClient, namespace: str, node: str, gpus: int) -> None:
    """A pod holding `gpus` of the local node's GPUs (a sleeping process), as another team's
    job would: what is left is all the pool can be placed on."""
    from kvfleet.devcluster.fleet import GPU_RESOURCE
    from kvfleet.operator.placement import tolerations

    kube.create({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "gpu-occupier", "namespace": namespace},
        "spec": {"nodeName": node, "tolerations": tolerations(), "containers": [{
            "name": "job", "image": "python",
            "command": ["python", "-c", "import time; time.sleep(3600)"],
            "resources": {"limits": {GPU_RESOURCE: str(gpus)}}}]}})


def test_no_gpu_for_a_replica_limits_the_count_and_a_scale_down_under_streams_fails_nothing(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,
    local_node: str,
) -> None:
    """d) Two of the node's four GPUs are taken: the pool grows one replica at a time past
    the two it can place; once a replica has been unschedulable for the grace (what a node
    autoscaler would have had to add a GPU node), ScalingLimited says so and the count stops
    growing short of what the load asks for, with every request still answered. c) Then
    maxReplicas 1 while 8 streams run: the pool goes to 1 and no request fails (the removed
    replicas stop getting requests, finish what they have, then go)."""
    with _only_the_local_l4_node(kube, kubectl):
        _occupy_gpus(kube, namespace, local_node, 2)
        _autoscaled_pool(kube, namespace, {
            "minReplicas": 1, "maxReplicas": 8, "targetLoad": 1.0, "maxStep": 1,
            "pendingGraceSeconds": 10, "scaleDownStabilizationSeconds": 10,
            "sloScaling": False})
        _wait_pool(kube, operator, namespace, POOL, _available, "the first replica Ready", 300)
        url = router_on_node(kube, namespace, local_node)
        streams = Traffic(url, workers=8, max_tokens=48)
        try:
            started = time.monotonic()
            limited = _wait_pool(kube, operator, namespace, POOL, lambda p: _cond(
                p, "ScalingLimited").get("reason") == "Unschedulable",
                "ScalingLimited: replicas without a GPU", 300)
            _decided(started, "ScalingLimited")
            message = _cond(limited, "ScalingLimited")["message"]
            assert "replicas unschedulable for" in message and "not growing to" in message, \
                message
            held = _replicas(_get(kube, "ServingPool", namespace, POOL))
            assert 3 <= held[0] < 8, held
            # The second replica may still be loading the model when the limit is set: the
            # two placed ones Ready, at the count that was held, first.
            _wait_pool(kube, operator, namespace, POOL, lambda p: _replicas(p) == (held[0], 2),
                       f"the 2 placed replicas Ready at {held[0]}", 120)
            for _ in range(3):  # the count stays while the load asks for more
                time.sleep(INTERVAL_S)
                assert _replicas(_get(kube, "ServingPool", namespace, POOL)) == (held[0], 2)
            served_before = streams.codes["200"]

            # c) Down to 1 under the 8 streams.
            kube.merge_patch("ServingPool", POOL, {"spec": {"autoscaling": {
                "maxReplicas": 1}}}, namespace)
            started = time.monotonic()
            _wait_pool(kube, operator, namespace, POOL, lambda p: _replicas(p) == (1, 1),
                       "down to 1 replica", 120)
            _decided(started, f"{held[0]} -> 1 under 8 streams")
            kube.wait_for("one engine pod left", lambda: len(kube.list(
                "Pod", namespace, label_selector="kvfleet.io/pool=" + POOL)) == 1 or None, 120)
            time.sleep(5)
        finally:
            streams.close()
        assert streams.failures == [], streams.failures[:5]
        assert streams.codes == {"200": streams.codes["200"]}
        assert streams.codes["200"] > served_before > 0


LONG_TOKENS = 800
TOKEN_DELAY_S = 0.05  # at least 40 s for a long stream: past the default 30 s drain


def _long_stream(url: str, n: int, out: dict[int, tuple[float, str]],
                 started: threading.Event) -> None:
    """One stream of LONG_TOKENS tokens through the router; `out[n]` = (when it ended, its
    text, or the error's repr)."""
    body = {"model": POOL, "max_tokens": LONG_TOKENS, "stream": True, "ignore_eos": True,
            "user": f"long-{n}", "messages": [{"role": "user", "content": f"Count from {n}."}]}
    lines: list[str] = []
    try:
        with httpx.Client(timeout=300) as client, client.stream(
                "POST", url + "/v1/chat/completions", json=body,
                headers={"authorization": f"Bearer {TENANT_KEY}"}) as resp:
            for line in resp.iter_lines():
                if '"content"' in line:
                    started.set()
                lines.append(line)
        out[n] = time.monotonic(), "\n".join(lines) if resp.status_code == 200 else resp.text
    except httpx.HTTPError as exc:
        out[n] = time.monotonic(), repr(exc)


def _running(pod: dict) -> float:
    """The engine pod's requests running now (its own /metrics)."""
    text = httpx.get(f"http://{pod['status']['podIP']}:{ENGINE_PORT}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def test_a_replica_removed_under_long_streams_finishes_them_past_the_default_drain(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,
    local_node: str, faults: dict[str, str],  # noqa: F811
) -> None:
    """spec.engine.drainSeconds 120 on a pool of 2 replicas whose engines take at least 50 ms a
    token (the token_delay fault): 6 streams of 800 tokens run on both, the pool goes to 1
    replica (`spec.replicas`, as `kubectl scale` writes it), and every stream ends whole, the
    removed replica's too, though they outlast the 30 s a default drain would have given them.
    The removed pod goes when its streams are done, not before."""
    artifact = smollm2_revision("smol", 40, namespace)
    kube.create(artifact)
    tenant(kube, namespace)
    pool = local_pool(POOL, "smol", namespace)
    pool["spec"]["replicas"] = 2
    pool["spec"]["engine"]["drainSeconds"] = 120
    revision = revision_for(pool, artifact)[:12]
    os.environ[FAULTS_ENV] = f"{revision}:token_delay={TOKEN_DELAY_S}"
    with _only_the_local_l4_node(kube, kubectl):
        kube.create(pool)
        _wait_pool(kube, operator, namespace, POOL, lambda p: _replicas(p) == (2, 2),
                   "2 replicas Ready", 300)
        url = router_on_node(kube, namespace, local_node)
        pods = kube.list("Pod", namespace, label_selector="kvfleet.io/pool=" + POOL)
        grace = pods[0]["spec"]["terminationGracePeriodSeconds"]
        assert grace > 120, grace
        out: dict[int, tuple[float, str]] = {}
        started = [threading.Event() for _ in range(6)]
        threads = [threading.Thread(target=_long_stream, args=(url, n, out, started[n]))
                   for n in range(6)]
        for thread in threads:
            thread.start()
        assert all(event.wait(120) for event in started), "the streams did not start"
        kube.wait_for("streams running on both replicas", lambda: all(
            _running(p) >= 1 for p in pods) or None, 30)

        scaled = time.monotonic()
        kube.merge_patch("ServingPool", POOL, {"spec": {"replicas": 1}}, namespace)
        kube.wait_for("one engine pod left", lambda: len(kube.list(
            "Pod", namespace, label_selector="kvfleet.io/pool=" + POOL)) == 1 or None, 200)
        gone = time.monotonic() - scaled
        for thread in threads:
            thread.join(200)
    last = max(ended for ended, _ in out.values()) - scaled
    print(f"2 -> 1 replica under 6 streams of {LONG_TOKENS} tokens: the removed pod went "
          f"{gone:.0f} s after the scale-down, the last stream ended {last:.0f} s after it")
    assert sorted(out) == list(range(6))
    for _, text in out.values():
        assert stream_problem(text) is None, text[-500:]
        assert '"finish_reason":"length"' in text.replace(" ", ""), text[-500:]
    assert gone > 30  # the streams outlived a default drain, and the pod waited for them
