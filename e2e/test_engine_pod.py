"""The whole path with the real engine: a Deployment on a local GPU node runs `kvfleet serve`
(SmolLM2), is Ready only through the engine's own /ready, answers at its pod IP, and
Prometheus scrapes its kvfleet_engine_* metrics through pod discovery."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.api.labels import ENGINE_COMPONENT, POOL_LABEL, REVISION_LABEL
from kvfleet.devcluster import fleet
from kvfleet.devcluster.kube import JsonObj, KubeClient, condition_true
from kvfleet.devcluster.prometheus import PrometheusClient
from kvfleet.engine.faults import FAULTS_ENV
from kvfleet.router.cluster import state_from_objects

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PORT = 8000


def engine_deployment(name: str, namespace: str) -> dict[str, Any]:
    labels = {"app": name}
    container = {
        "name": "engine",
        "image": "kvfleet:dev",
        "command": ["kvfleet", "serve"],
        "args": ["--host", "$(POD_IP)", "--port", str(PORT)],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": PORT}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
        "resources": {"limits": {fleet.GPU_RESOURCE: "1"}},
    }
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PORT),
        "prometheus.io/path": "/metrics",
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": {
                    "nodeSelector": {fleet.LOCAL_NODE_LABEL: "true"},
                    "terminationGracePeriodSeconds": 15,
                    "containers": [container],
                },
            },
        },
    }


def generated_tokens(url: str) -> float:
    """kvfleet_engine_generation_tokens_total as the engine exposes it, summed over labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvfleet_engine_generation_tokens_total"
    )


def test_engine_deployment_on_a_local_node_serves_and_is_scraped(
    kube: KubeClient, namespace: str, local_node: str, prometheus: PrometheusClient
) -> None:
    kube.create(engine_deployment("engine", namespace))

    def ready_pod() -> JsonObj | None:
        pods = kube.list("Pod", namespace, label_selector="app=engine")
        return next((p for p in pods if condition_true(p, "Ready")), None)

    pod = kube.wait_for("the engine pod Ready (model loaded)", ready_pod, 240, interval=1)
    assert pod["spec"]["nodeName"] == local_node
    url = f"http://{pod['status']['podIP']}:{PORT}"
    before = generated_tokens(url)
    resp = httpx.post(
        f"{url}/v1/completions",
        json={"model": "any", "prompt": "Kubernetes is", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert resp.status_code in (200, 404), resp.text  # 404: model id unknown to the engine
    if resp.status_code == 404:
        served = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        resp = httpx.post(
            f"{url}/v1/completions",
            json={"model": served, "prompt": "Kubernetes is", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
    assert resp.status_code == 200, resp.text
    completion_tokens = resp.json()["usage"]["completion_tokens"]
    assert completion_tokens >= 1
    after = generated_tokens(url)
    assert after - before == completion_tokens

    query = f'sum(kvfleet_engine_generation_tokens_total{{namespace="{namespace}"}})'
    (sample,) = kube.wait_for(
        "Prometheus to scrape the engine's generated tokens",
        lambda: [r for r in prometheus.query(query) if float(r["value"][1]) >= after] or None,
        60,
        interval=1,
    )
    assert float(sample["value"][1]) == after


def test_a_stalled_engine_fails_its_probes_is_restarted_and_leaves_the_routes(
    kube: KubeClient, namespace: str, local_node: str
) -> None:
    """The watchdog on the real pod path: the engine thread hangs mid-request (the injected
    `stall_after` fault, as a stuck kernel would), the stream ends with an error event instead
    of hanging, /health and /ready answer 503 with the reason, the pod turns NotReady so the
    router's state (built from the live pod objects, as its informers see them) drops it, the
    kubelet (the local pod runner) restarts the process on the failed liveness probe, and the
    restarted engine is Ready and routed again."""
    revision = "stall0"
    deployment = engine_deployment("stall", namespace)
    template = deployment["spec"]["template"]
    template["metadata"]["labels"].update({
        "app.kubernetes.io/component": ENGINE_COMPONENT, POOL_LABEL: "stall",
        REVISION_LABEL: revision})
    deployment["spec"]["selector"]["matchLabels"] = template["metadata"]["labels"]
    template["spec"]["terminationGracePeriodSeconds"] = 5
    (container,) = template["spec"]["containers"]
    # Knobs a test needs: a 3 s stall limit (60 s in production) and a fast liveness probe,
    # which starts once the server surely listens (importing torch took over 4 s on a busy CI
    # host: probes from the first second killed every start before it listened).
    container["args"] += ["--revision", revision, "--stall-seconds", "3"]
    container["env"].append({"name": FAULTS_ENV, "value": f"{revision}:stall_after=3"})
    container["livenessProbe"] = {"httpGet": {"path": "/health", "port": "http"},
                                  "initialDelaySeconds": 30, "periodSeconds": 2,
                                  "timeoutSeconds": 5, "failureThreshold": 2}
    kube.create(deployment)

    def pod_where(ready: bool, restarts: int = 0) -> JsonObj | None:
        for pod in kube.list("Pod", namespace, label_selector="app=stall"):
            statuses = pod.get("status", {}).get("containerStatuses") or [{}]
            if (condition_true(pod, "Ready") == ready
                    and int(statuses[0].get("restartCount", 0)) >= restarts):
                return pod
        return None

    def routed() -> list[str]:
        pods = kube.list("Pod", namespace, label_selector="app=stall")
        pool = {"metadata": {"namespace": namespace, "name": "stall"}, "status": {}}
        state = state_from_objects([pool], pods, [], [], [], cluster_wide=False)
        return [e.address for e in state.pools["stall"].endpoints.get(revision, [])]

    pod = kube.wait_for("the engine pod Ready", lambda: pod_where(ready=True), 240, interval=1)
    assert pod["spec"]["nodeName"] == local_node
    url = f"http://{pod['status']['podIP']}:{PORT}"
    assert routed() == [f"{pod['status']['podIP']}:{PORT}"]
    served = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]

    started = time.monotonic()
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
            "model": served, "prompt": "Kubernetes is", "max_tokens": 200,
            "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    took = time.monotonic() - started
    # The stall limit is 3 s and the watchdog looks every second: the stream ends in ~4 s,
    # with an error, never after the client's 60 s timeout.
    assert took < 30, f"the stalled stream took {took:.1f} s to end"
    reasons = [c.get("finish_reason") for e in events for c in e.get("choices", [])]
    assert "error" in reasons, events[-3:]
    health = httpx.get(f"{url}/health", timeout=10)
    if health.status_code == 503:  # not yet restarted: the watchdog's reason is on the probe
        assert "no engine step finished" in health.json()["reason"]

    kube.wait_for("the stalled pod NotReady", lambda: pod_where(ready=False), 60, interval=0.5)
    kube.wait_for("the router state to drop the NotReady pod", lambda: not routed(), 30,
                  interval=0.5)
    restarted = kube.wait_for("the engine restarted on its failed liveness probe and Ready",
                              lambda: pod_where(ready=True, restarts=1), 240, interval=1)
    assert restarted["metadata"]["uid"] == pod["metadata"]["uid"]  # the process, not the pod
    assert routed() == [f"{restarted['status']['podIP']}:{PORT}"]
    url = f"http://{restarted['status']['podIP']}:{PORT}"
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
