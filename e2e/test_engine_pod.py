"""The whole path with the real engine: a Deployment on a local GPU node runs `kvfleet serve`
(SmolLM2), is Ready only through the engine's own /ready, answers at its pod IP, and
Prometheus scrapes its kvfleet_engine_* metrics through pod discovery."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.devcluster import fleet
from kvfleet.devcluster.kube import JsonObj, KubeClient, condition_true
from kvfleet.devcluster.prometheus import PrometheusClient

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
