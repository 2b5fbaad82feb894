"""Smoke tests of the real control plane: versions, GPU scheduling onto KWOK nodes, a pod that
really runs on a local node (readiness, pod IP, Prometheus, SIGTERM), warm start and teardown."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from e2e.conftest import Kubectl
from kvfleet.devcluster import fleet
from kvfleet.devcluster.cluster import ClusterOptions, DevCluster, ExistingCluster
from kvfleet.devcluster.kube import JsonObj, KubeClient, condition_true
from kvfleet.devcluster.prometheus import PrometheusClient

pytestmark = pytest.mark.e2e


def gpu_deployment(name: str, gpus: int, selector: dict[str, str]) -> dict[str, Any]:
    labels = {"app": name}
    container = {
        "name": "main",
        "image": "registry.k8s.io/pause:3.10",
        "resources": {"limits": {fleet.GPU_RESOURCE: str(gpus)}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"nodeSelector": selector, "containers": [container]},
            },
        },
    }


def pods_of(kube: KubeClient, namespace: str, app: str) -> list[JsonObj]:
    return kube.list("Pod", namespace, label_selector=f"app={app}")


def test_kubectl_and_server_report_v1_34(kubectl: Kubectl) -> None:
    out = json.loads(kubectl("version", "-o", "json").stdout)
    assert out["clientVersion"]["gitVersion"].startswith("v1.34.")
    assert out["serverVersion"]["gitVersion"].startswith("v1.34.")
    assert out["serverVersion"]["minor"] == "34"


def test_gpu_deployment_lands_on_an_l4_node_and_becomes_ready(
    kube: KubeClient, namespace: str, fake_nodes: list[str]
) -> None:
    selector = {fleet.PRODUCT_LABEL: fleet.L4.product, fleet.FAKE_NODE_LABEL: "kwok"}
    obj = gpu_deployment("l4-infer", 1, selector)
    obj["metadata"]["namespace"] = namespace
    kube.create(obj)

    def ready_pod() -> JsonObj | None:
        pods = pods_of(kube, namespace, "l4-infer")
        ok = [
            p for p in pods if p["status"].get("phase") == "Running" and condition_true(p, "Ready")
        ]
        return ok[0] if ok else None

    pod = kube.wait_for("the L4 pod Running and Ready", ready_pod, 60)
    node = kube.get("Node", pod["spec"]["nodeName"])
    assert node["metadata"]["labels"][fleet.PRODUCT_LABEL] == "NVIDIA-L4"
    assert node["metadata"]["annotations"][fleet.KWOK_ANNOTATION] == "fake"  # a KWOK node
    deployment = kube.wait_for(
        "the Deployment to count its ready replica",
        lambda: (
            d
            if (d := kube.get("Deployment", "l4-infer", namespace))["status"].get("readyReplicas")
            == 1
            else None
        ),
        60,
    )
    assert deployment["status"]["readyReplicas"] == 1


def test_more_gpus_than_any_node_stays_pending_with_failed_scheduling(
    kube: KubeClient, namespace: str, fake_nodes: list[str]
) -> None:
    obj = gpu_deployment("too-big", 64, {})
    obj["metadata"]["namespace"] = namespace
    kube.create(obj)

    def failed_scheduling() -> JsonObj | None:
        events = kube.list("Event", namespace, field_selector="reason=FailedScheduling")
        return events[0] if events else None

    event = kube.wait_for("a FailedScheduling event", failed_scheduling, 60)
    assert "Insufficient nvidia.com/gpu" in event["message"]
    time.sleep(2)  # the scheduler retries; the pod must still not be placed
    (pod,) = pods_of(kube, namespace, "too-big")
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")


# A real process: waits (so "Running but not Ready" is observable), then serves its folder,
# including a Prometheus-format `metrics` file, on the pod IP. SIGTERM is recorded in $MARKER.
HTTP_POD_SCRIPT = (
    'printf "kvfleet_smoke_up 1\\n" > metrics; '
    'trap \'echo TERM > "$MARKER"; kill "$child" 2>/dev/null; wait "$child"; exit 0\' TERM; '
    'sleep "$DELAY"; python -m http.server "$PORT" --bind "$POD_IP" & child=$!; wait "$child"'
)


def http_pod(name: str, node: str, marker: Path, port: int = 8080, delay: float = 3) -> JsonObj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {"app": name},
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(port),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 10,
            "containers": [
                {
                    "name": "web",
                    "image": "python:3.11",
                    "command": ["sh", "-c", HTTP_POD_SCRIPT],
                    "env": [
                        {
                            "name": "POD_IP",
                            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                        },
                        {"name": "PORT", "value": str(port)},
                        {"name": "DELAY", "value": str(delay)},
                        {"name": "MARKER", "value": str(marker)},
                    ],
                    "ports": [{"name": "http", "containerPort": port}],
                    "readinessProbe": {
                        "httpGet": {"path": "/", "port": "http"},
                        "periodSeconds": 1,
                    },
                    "resources": {"limits": {fleet.GPU_RESOURCE: "1"}},
                }
            ],
        },
    }


def test_local_pod_really_runs_is_probed_scraped_and_terminated(
    kube: KubeClient, kubectl: Kubectl, namespace: str, local_node: str,
    prometheus: PrometheusClient, tmp_path: Path,
) -> None:
    marker = tmp_path / "sigterm"
    pod_obj = http_pod("web", local_node, marker)
    pod_obj["metadata"]["namespace"] = namespace
    kube.create(pod_obj)

    def running() -> JsonObj | None:
        pod = kube.get("Pod", "web", namespace)
        return (
            pod if pod["status"].get("phase") == "Running" and pod["status"].get("podIP") else None
        )

    pod = kube.wait_for("the local pod Running", running, 30)
    pod_ip = pod["status"]["podIP"]
    assert pod_ip.startswith("127.64.")
    assert pod["spec"]["nodeName"] == local_node
    # Still sleeping: the process does not answer yet, so the pod must not be Ready.
    assert not condition_true(kube.get("Pod", "web", namespace), "Ready")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{pod_ip}:8080/", timeout=1)

    kube.wait_for(
        "the local pod Ready",
        lambda: p if condition_true(p := kube.get("Pod", "web", namespace), "Ready") else None,
        30,
    )
    assert httpx.get(f"http://{pod_ip}:8080/metrics", timeout=5).text == "kvfleet_smoke_up 1\n"
    # `kubectl logs` reaches the process's output through the apiserver, as on a real node.
    kube.wait_for("the request in `kubectl logs`", lambda: True if '"GET /metrics HTTP/1.1" 200'
                  in kubectl("logs", "-n", namespace, "web").stdout else None, 10)
    assert kubectl("logs", "-n", namespace, "web", "--tail=1").stdout.count("\n") == 1

    def scraped() -> list[JsonObj] | None:
        result = prometheus.query(f'kvfleet_smoke_up{{namespace="{namespace}",pod="web"}}')
        return result or None

    (sample,) = kube.wait_for("Prometheus to scrape the pod", scraped, 60, interval=1)
    assert sample["value"][1] == "1"
    (target,) = [
        t for t in prometheus.active_targets() if t["labels"].get("namespace") == namespace
    ]
    assert target["scrapeUrl"] == f"http://{pod_ip}:8080/metrics"
    assert target["health"] == "up"

    kube.delete("Pod", "web", namespace)
    kube.wait_for(
        "the pod object to be removed",
        lambda: True if kube.get_or_none("Pod", "web", namespace) is None else None,
        30,
    )
    assert marker.read_text().strip() == "TERM"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{pod_ip}:8080/", timeout=1)


def test_warm_start_is_quick_and_teardown_leaves_nothing(
    cluster: DevCluster | ExistingCluster, tmp_path: Path
) -> None:
    if isinstance(cluster, ExistingCluster):
        pytest.skip("start/stop is measured on the harness cluster only")
    options = ClusterOptions(node_groups=(fleet.NodeGroup(fleet.L4, 1, 1),), local_nodes=1)
    second = DevCluster(options)
    try:
        second.start()
        assert second.startup_seconds is not None
        assert second.startup_seconds <= 30, f"warm start took {second.startup_seconds:.1f}s"
        pod = http_pod("web", second.local_node_names[0], tmp_path / "m", delay=0)
        pod["metadata"]["namespace"] = "default"
        second.api.create(pod)
        second.api.wait_for(
            "a running local pod",
            lambda: (
                p
                if (p := second.api.get("Pod", "web", "default"))["status"].get("phase")
                == "Running"
                else None
            ),
            30,
        )
        assert second.runner is not None
        pids = second.pids() + [
            c.process.pid
            for p in second.runner.pods.values()
            for c in p.containers
            if c.process is not None
        ]
        workdir = second.workdir
    finally:
        second.stop()
    alive = [
        pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
    ]
    assert alive == []
    assert not workdir.exists()
    assert not any(
        str(workdir) in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])
    ), "a process still refers to the removed work dir"


def test_local_pod_restarts_per_restart_policy(
    kube: KubeClient, namespace: str, local_node: str
) -> None:
    def crashing(name: str, policy: str) -> JsonObj:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": local_node},
                "restartPolicy": policy,
                "containers": [{"name": "c", "image": "none", "command": ["sh", "-c", "exit 3"]}],
            },
        }

    kube.create(crashing("always", "Always"))
    kube.create(crashing("never", "Never"))

    def restarted_twice() -> JsonObj | None:
        pod = kube.get("Pod", "always", namespace)
        statuses = pod["status"].get("containerStatuses") or [{}]
        return pod if statuses[0].get("restartCount", 0) >= 2 else None

    pod = kube.wait_for("the Always pod restarted twice", restarted_twice, 30)
    assert pod["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 3
    failed = kube.wait_for(
        "the Never pod Failed",
        lambda: (
            p if (p := kube.get("Pod", "never", namespace))["status"]["phase"] == "Failed" else None
        ),
        30,
    )
    (status,) = failed["status"]["containerStatuses"]
    assert status["restartCount"] == 0
    assert status["state"]["terminated"]["exitCode"] == 3


WHOAMI = (
    "import os, pathlib; "
    "from kvfleet.devcluster.kube import connect; "
    "api = connect(pathlib.Path(os.environ['KUBECONFIG'])); "
    "review = api.request('POST', '/apis/authentication.k8s.io/v1/selfsubjectreviews', "
    "{'apiVersion': 'authentication.k8s.io/v1', 'kind': 'SelfSubjectReview'}); "
    "pathlib.Path(os.environ['OUT']).write_text(review['status']['userInfo']['username'])"
)


def test_local_pod_talks_to_the_api_server_as_its_service_account(
    kube: KubeClient, namespace: str, local_node: str, tmp_path: Path
) -> None:
    out = tmp_path / "whoami"
    container = {
        "name": "c",
        "image": "none",
        "command": ["python", "-c", WHOAMI],
        "env": [{"name": "OUT", "value": str(out)}],
    }
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "whoami", "namespace": namespace},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": local_node},
                "restartPolicy": "Never",
                "containers": [container],
            },
        }
    )
    pod = kube.wait_for(
        "the whoami pod to finish",
        lambda: (
            p
            if (p := kube.get("Pod", "whoami", namespace))["status"].get("phase")
            in ("Succeeded", "Failed")
            else None
        ),
        60,
    )
    assert pod["status"]["phase"] == "Succeeded", pod["status"]
    assert out.read_text() == f"system:serviceaccount:{namespace}:default"


def test_helm_installs_into_the_cluster_and_sees_v1_34(
    helm: Kubectl, kube: KubeClient, namespace: str, tmp_path: Path
) -> None:
    chart = tmp_path / "smoke"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: smoke\nversion: 0.1.0\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}\n"
        "data:\n  kubeVersion: {{ .Capabilities.KubeVersion.Version | quote }}\n"
    )
    assert helm("version", "--short").stdout.startswith("v3.22.")
    helm("install", "smoke", str(chart), "--namespace", namespace, "--wait")
    cm = kube.get("ConfigMap", "smoke", namespace)
    assert cm["data"]["kubeVersion"].startswith("v1.34.")
    helm("uninstall", "smoke", "--namespace", namespace)
    assert kube.get_or_none("ConfigMap", "smoke", namespace) is None


def test_failing_liveness_probe_restarts_the_container(
    kube: KubeClient, namespace: str, local_node: str
) -> None:
    container = {
        "name": "c",
        "image": "none",
        "command": ["sleep", "600"],
        # Nothing listens on the pod IP's port 9: every probe fails.
        "livenessProbe": {"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 2},
    }
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "unlive", "namespace": namespace},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": local_node},
                "terminationGracePeriodSeconds": 1,
                "containers": [container],
            },
        }
    )

    def restarted() -> JsonObj | None:
        pod = kube.get("Pod", "unlive", namespace)
        statuses = pod["status"].get("containerStatuses") or [{}]
        return pod if statuses[0].get("restartCount", 0) >= 1 else None

    pod = kube.wait_for("a liveness restart", restarted, 30)
    terminated = pod["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert terminated["exitCode"] == 143  # 128 + SIGTERM, as a container runtime reports it
