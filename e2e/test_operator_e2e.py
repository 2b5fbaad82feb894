"""The operator against a real apiserver, scheduler and KWOK GPU nodes.

The operator runs as a subprocess (`.venv/bin/kvfleet operator`) with the harness kubeconfig,
so restarting it is a real restart: a new process, new watches, state only from the cluster.
Pods land on KWOK fake nodes, which mark them Running/Ready without running the engine; that
is what placement, availability and drift need. Each test uses its own namespace; nodes a test
adds are deleted by that test.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.argocd_health import ArgoHealth
from kvfleet.api import manifest_hash
from kvfleet.api.builders import make_artifact, make_pool
from kvfleet.devcluster import fleet
from kvfleet.devcluster.cluster import DevCluster, ExistingCluster
from kvfleet.devcluster.kube import KubeClient
from kvfleet.kube.api import path_of
from kvfleet.operator import naming
from kvfleet.operator.rbac import NAME as RBAC_NAME
from kvfleet.operator.rbac import build_rbac, cluster_role_rules, permissions
from kvfleet.operator.revisions import revision_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
KVFLEET = ROOT / ".venv" / "bin" / "kvfleet"
H100 = fleet.H100_80GB.product
L40S = fleet.GpuProduct("NVIDIA-L40S", 46068, "ada-lovelace", 8, 9, "l40s")
Kubectl = Callable[..., "subprocess.CompletedProcess[str]"]
JsonObj = dict[str, Any]
DRIFT_INTERVAL_S = 3.0
# A drift interval whose first tick (kopf's initial delay: 0.5-1.5 intervals) comes long after
# any test's deadline: what the operator does meanwhile, watch events made it do.
NO_DRIFT_INTERVAL_S = 600.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """In the child: SIGTERM when the parent dies, so a killed run leaves no operator behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


class OperatorProcess:
    """`kvfleet operator` as a child process; `restart()` is a real process restart."""

    def __init__(self, kubeconfig: Path, log_dir: Path, prometheus_url: str | None = None,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.extra_args, self.env = extra_args, env or {}
        self.prometheus_url = prometheus_url  # what the Rollout analysis queries
        self.log_dir = log_dir
        self.metrics_port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.drift_interval = DRIFT_INTERVAL_S

    def start(self) -> None:
        self.starts += 1
        log = (self.log_dir / f"operator-{self.starts}.log").open("wb")
        command = [str(KVFLEET)] if KVFLEET.exists() else [sys.executable, "-m", "kvfleet"]
        self.proc = subprocess.Popen(
            [*command, "operator", "--all-namespaces", "--standalone",
             "--metrics-port", str(self.metrics_port), "--metrics-address", "127.0.0.1",
             "--drift-interval", str(self.drift_interval), "--verbose", *self.extra_args],
            env={**os.environ, **self.env, "KUBECONFIG": str(self.kubeconfig),
                 "PYTHONPATH": str(ROOT),
                 **({"KVFLEET_PROMETHEUS_URL": self.prometheus_url}
                    if self.prometheus_url else {})},
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        log.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    def restart(self, sig: int = signal.SIGTERM) -> None:
        self.stop(sig)
        self.start()

    @contextlib.contextmanager
    def without_drift_timer(self) -> Iterator[None]:
        """Restarted with a drift timer that does not tick within a test (then restored)."""
        self.drift_interval = NO_DRIFT_INTERVAL_S
        self.restart()
        try:
            yield
        finally:
            self.drift_interval = DRIFT_INTERVAL_S
            self.restart()

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        for _ in range(10):
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    text: str = response.read().decode()
                    return text
            except OSError as exc:
                error = exc
                time.sleep(1)
        alive = self.proc is not None and self.proc.poll() is None
        pytest.fail(f"operator metrics at {url}: {error} (alive={alive})\n{self.log_tail()}")

    def log_tail(self) -> str:
        path = self.log_dir / f"operator-{self.starts}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


@pytest.fixture(scope="module")
def crds(kubectl: Kubectl) -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(ROOT / "crds"))


OPERATOR_NAMESPACE = "kvfleet-system"  # the dev cluster's apiserver audits its accounts


def operator_kubeconfig(kube: KubeClient, kubectl: Kubectl, folder: Path) -> Path:
    """A kubeconfig of the operator's own ServiceAccount, with exactly the RBAC
    `kvfleet operator --print-rbac` prints: the e2e operator runs with what it is granted."""
    if kube.get_or_none("Namespace", OPERATOR_NAMESPACE) is None:
        kube.create({"apiVersion": "v1", "kind": "Namespace",
                     "metadata": {"name": OPERATOR_NAMESPACE}})
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(build_rbac(OPERATOR_NAMESPACE)))
    token = kube.request(
        "POST", f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/serviceaccounts/{RBAC_NAME}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
         "spec": {"expirationSeconds": 6 * 3600}})["status"]["token"]
    tls = kube.credentials.tls
    cluster_entry: dict[str, Any] = {"server": kube.credentials.server}
    if tls.ca is not None:
        cluster_entry["certificate-authority-data"] = base64.b64encode(tls.ca).decode()
    if tls.insecure:
        cluster_entry["insecure-skip-tls-verify"] = True
    path = folder / "operator.kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "operator",
        "clusters": [{"name": "cluster", "cluster": cluster_entry}],
        "users": [{"name": RBAC_NAME, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "cluster",
                                                       "user": RBAC_NAME}}]}))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def operator(
    cluster: DevCluster | ExistingCluster, crds: None, kube: KubeClient, kubectl: Kubectl,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OperatorProcess]:
    folder = tmp_path_factory.mktemp("operator")
    proc = OperatorProcess(operator_kubeconfig(kube, kubectl, folder), folder,
                           cluster.prometheus.url if cluster.prometheus is not None else None)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def _get(kube: KubeClient, kind: str, ns: str, name: str) -> JsonObj:
    return kube.request("GET", path_of(kind, ns, name))


def _create(kube: KubeClient, obj: JsonObj) -> None:
    kube.request("POST", path_of(obj["kind"], obj["metadata"]["namespace"]), obj)


def _cond(obj: JsonObj, cond_type: str) -> JsonObj:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == cond_type), {})


def _wait_pool(
    kube: KubeClient, op: OperatorProcess, ns: str, name: str, check: Callable[[JsonObj], bool],
    what: str, timeout: float = 90,
) -> JsonObj:  # fmt: skip
    deadline = time.monotonic() + timeout
    pool: JsonObj = {}
    while time.monotonic() < deadline:
        pool = _get(kube, "ServingPool", ns, name)
        if check(pool):
            return pool
        time.sleep(0.5)
    pytest.fail(
        f"ServingPool {ns}/{name}: timed out waiting for {what}; status: "
        f"{yaml.safe_dump(pool.get('status'))}\noperator log tail:\n{op.log_tail()}"
    )


def _available(pool: JsonObj) -> bool:
    return _cond(pool, "Available").get("status") == "True"


def _wait_artifact(kube: KubeClient, ns: str, name: str, check: Callable[[JsonObj], bool],
                   timeout: float = 60) -> JsonObj:
    def probe() -> JsonObj | None:
        artifact = _get(kube, "ModelArtifact", ns, name)
        return artifact if check(artifact) else None

    return kube.wait_for(f"ModelArtifact {ns}/{name} to reach the state the test waits for",
                         probe, timeout)


def _namespaced(obj: JsonObj, ns: str) -> JsonObj:
    obj["metadata"]["namespace"] = ns
    return obj


def _artifact_and_pool(kube: KubeClient, ns: str, pool: str, **sets: Any) -> None:
    _create(kube, make_artifact("qwen3-8b", ns).data())
    # H100 nodes: the harness's one local node (whose pods really run) is an L4.
    builder = make_pool(pool, "qwen3-8b", ns).set("spec.gpu.product", H100)
    for path, value in sets.items():
        builder.set(path.replace("__", "."), value)
    _create(kube, builder.data())


@pytest.fixture
def add_nodes(kube: KubeClient) -> Iterator[Callable[[list[JsonObj]], None]]:
    created: list[str] = []

    def add(nodes: list[JsonObj]) -> None:
        created.extend(fleet.create_nodes(kube, nodes))

    yield add
    for name in created:
        kube.delete("Node", name)


def test_examples_become_available_on_matching_gpu_nodes(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,
    add_nodes: Callable[[list[JsonObj]], None], argo_health: ArgoHealth,
) -> None:  # fmt: skip
    example_pool = yaml.safe_load((EXAMPLES / "02-servingpool-l4.yaml").read_text())
    region = example_pool["spec"]["region"]
    nodes = [
        fleet.build_node(f"gpu-l4-{region}-{namespace}-{i}", fleet.L4, 1, f"{region}a")
        for i in range(example_pool["spec"]["replicas"])
    ]
    for node in nodes:
        node["metadata"]["labels"]["topology.kubernetes.io/region"] = region
    add_nodes(nodes)
    # Every example (artifacts, pool, quota, rollout; not examples/invalid/). The Rollout names
    # the pool but only matters once the pool's artifact changes.
    kubectl("apply", "-n", namespace, "-f", str(EXAMPLES))
    name = example_pool["metadata"]["name"]
    pool = _wait_pool(kube, operator, namespace, name, _available, "Available=True")

    assert pool["status"]["readyReplicas"] == example_pool["spec"]["replicas"]
    assert pool["status"]["capacity"]["candidateConcurrency"] == 5
    assert _cond(pool, "CapacityOK")["status"] == "True"
    assert _cond(pool, "Degraded")["status"] == "False"
    artifact = _get(kube, "ModelArtifact", namespace, "qwen3-8b")
    assert artifact["status"]["manifestHash"] == manifest_hash(artifact["spec"])
    # The revision: the artifact's manifest, the engine image and the pool's engine settings.
    assert pool["status"]["servingRevision"] == pool["status"]["revision"] == revision_for(
        example_pool, {**artifact, "metadata": {"name": "qwen3-8b"}, "status": None})
    assert _cond(artifact, "Verified")["status"] == "True"
    assert _cond(artifact, "Compatible")["status"] == "True"
    # What Argo CD shows for an Application holding these examples.
    argo_health.expect(pool, "Healthy", "available-on-fake-nodes")
    argo_health.expect(artifact, "Healthy", "verified")
    quota = _get(kube, "TenantQuota", namespace, "search")
    argo_health.expect(quota, "Healthy", "no-router-yet")
    # The matrix's refusal, as the operator reports it (no webhook runs in this test).
    fp8 = yaml.safe_load((EXAMPLES / "invalid" / "modelartifact-fp8-unsupported.yaml")
                         .read_text())
    _create(kube, _namespaced(fp8, namespace))
    refused = _wait_artifact(kube, namespace, fp8["metadata"]["name"],
                             lambda a: _cond(a, "Compatible").get("status") == "False")
    health = argo_health.expect(refused, "Degraded", "incompatible")
    assert health.message.startswith("Incompatible: ")

    pods = kube.list("Pod", namespace, label_selector=f"{naming.POOL_LABEL}={name}")
    assert len(pods) == example_pool["spec"]["replicas"]
    node_names = {n["metadata"]["name"] for n in nodes}
    for p in pods:
        assert p["status"]["phase"] == "Running"
        assert p["spec"]["nodeName"] in node_names  # the eu-west-1 L4s, not dev-region ones
    for kind, obj_name in [("Service", name)]:
        owner = kube.get(kind, obj_name, namespace)["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == ("ServingPool", name)

    header, row = kubectl("get", "servingpools", "-n", namespace).stdout.splitlines()[:2]
    # Cells by the header's positions: an empty one (Scaled-By, not autoscaled) is blanks.
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    cells = {title: row[a:b].strip() for title, a, b in zip(
        header.split(), starts, [*starts[1:], None], strict=True)}
    assert list(cells.items())[:9] == [
        ("NAME", name), ("ARTIFACT", "qwen3-8b"), ("SERVING", "qwen3-8b"),
        ("GPU", "NVIDIA-L4"), ("DESIRED", "2"), ("CURRENT", "2"), ("READY-REPLICAS", "2"),
        ("SCALED-BY", ""), ("READY", "True")]
    # kopf writes nothing onto a pool (the pools reach the operator as events: no progress or
    # last-handled annotations); status holds only what the operator decided.
    assert not any(k.startswith("kvfleet.io/") for k in pool["metadata"].get("annotations") or {})
    assert "kopf" not in pool["status"]
    metrics = operator.metrics()
    assert 'kvfleet_operator_reconciles_total{kind="ServingPool"}' in metrics
    assert 'kvfleet_operator_reconcile_duration_seconds_bucket{kind="ModelArtifact"' in metrics


def test_missing_gpu_product_reports_why_until_a_node_appears(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,
    add_nodes: Callable[[list[JsonObj]], None], argo_health: ArgoHealth,
) -> None:  # fmt: skip
    """The reason, its update and the recovery arrive through watch events: the drift timer
    does not tick during the test, and the scheduler's verdict is only on the pod."""
    with operator.without_drift_timer():
        _unschedulable_until_a_node_appears(kube, kubectl, operator, namespace, add_nodes,
                                            argo_health)


def _unschedulable_until_a_node_appears(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,
    add_nodes: Callable[[list[JsonObj]], None], argo_health: ArgoHealth,
) -> None:  # fmt: skip
    _artifact_and_pool(kube, namespace, "big", spec__gpu__product="NVIDIA-L40S")
    pool = _wait_pool(
        kube, operator, namespace, "big",
        lambda p: _cond(p, "Available").get("reason") == "Unschedulable",
        "Available=False reason Unschedulable", timeout=60,
    )  # fmt: skip
    available = _cond(pool, "Available")
    assert available["status"] == "False"
    assert "no node with 1 free nvidia.com/gpu of product NVIDIA-L40S" in available["message"]
    assert _cond(pool, "Degraded")["reason"] == "Unschedulable"
    assert argo_health.expect(pool, "Degraded", "unschedulable").message.startswith(
        "Unschedulable: ")
    events = kubectl(
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        "involvedObject.kind=ServingPool,reason=Unschedulable",
        "-o",
        "name",
    ).stdout
    assert events.strip(), "no Unschedulable event on the pool"
    generation, spec = pool["metadata"]["generation"], pool["spec"]

    # A cordoned L40S node changes only the scheduler's verdict on the pod (the Deployment
    # sees nothing), so the pool's message follows through the pod watch alone.
    node = fleet.build_node(f"gpu-l40s-{namespace}", L40S, 1, "zone-a")
    node["spec"]["unschedulable"] = True
    add_nodes([node])
    _wait_pool(
        kube, operator, namespace, "big",
        lambda p: "node(s) were unschedulable" in _cond(p, "Available").get("message", ""),
        "the scheduler's new verdict (a cordoned L40S node) on the pool", timeout=60,
    )  # fmt: skip
    kubectl("uncordon", node["metadata"]["name"])
    pool = _wait_pool(
        kube, operator, namespace, "big", _available, "Available after uncordon", timeout=60
    )
    assert pool["metadata"]["generation"] == generation and pool["spec"] == spec
    assert _cond(pool, "Degraded")["status"] == "False"


def test_pod_settings_place_pods_on_a_teams_tainted_gpu_nodes(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,
    add_nodes: Callable[[list[JsonObj]], None],
) -> None:  # fmt: skip
    """A team's GPU nodes as real clusters have them: tainted for GPUs and for the team,
    labelled with its partition. The pool selects the partition (the dev fleet's untainted
    A100s are not the team's) and stays Unschedulable, with the scheduler's taint verdict,
    until it tolerates the team's taint; then it runs there, at the team's priority (the
    apiserver resolved the PriorityClass), with the pool's resources, env and labels."""
    partition = {"kvfleet.test/partition": f"team-{namespace}"}
    team_taint = {"key": "dedicated", "value": f"team-{namespace}", "effect": "NoSchedule"}
    node = fleet.build_node(f"gpu-a100-team-{namespace}", fleet.A100_40GB, 8, "zone-a",
                            taints=[fleet.GPU_TAINT, team_taint])
    node["metadata"]["labels"].update(partition)
    add_nodes([node])
    priority = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": f"e2e-{namespace}"}, "value": 100000,
                "description": "kvfleet e2e: a team's serving priority"}
    kube.create(priority)
    try:
        _create(kube, make_artifact("qwen3-8b", namespace).data())
        pod_settings = {
            "nodeSelector": partition, "priorityClassName": f"e2e-{namespace}",
            "resources": {"requests": {"cpu": "4", "memory": "48Gi"},
                          "limits": {"memory": "64Gi"}},
            "env": [{"name": "AWS_ENDPOINT_URL", "value": "http://minio.storage:9000"}],
            "labels": {"team": "a"},
        }
        _create(kube, make_pool("team", "qwen3-8b", namespace)
                .set("spec.gpu.product", fleet.A100_40GB.product)
                .set("spec.pod", pod_settings).data())
        pool = _wait_pool(
            kube, operator, namespace, "team",
            lambda p: "untolerated taint" in _cond(p, "Available").get("message", ""),
            "Unschedulable with the scheduler's taint verdict", timeout=90,
        )  # fmt: skip
        assert _cond(pool, "Available")["reason"] == "Unschedulable"
        tolerated = [{"key": "dedicated", "operator": "Equal", "value": f"team-{namespace}",
                      "effect": "NoSchedule"}]
        kube.merge_patch("ServingPool", "team", {"spec": {"pod": {"tolerations": tolerated}}},
                         namespace)
        _wait_pool(kube, operator, namespace, "team", _available, "Available", timeout=120)
        (pod,) = [p for p in kube.list("Pod", namespace,
                                       label_selector=f"{naming.POOL_LABEL}=team")
                  if not p["metadata"].get("deletionTimestamp")]
        spec = pod["spec"]
        assert spec["nodeName"] == node["metadata"]["name"]
        assert (spec["priorityClassName"], spec["priority"]) == (f"e2e-{namespace}", 100000)
        (engine,) = spec["containers"]
        assert engine["resources"]["requests"]["memory"] == "48Gi"
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
        for container in (engine, spec["initContainers"][0]):
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["AWS_ENDPOINT_URL"] == "http://minio.storage:9000"
        assert pod["metadata"]["labels"]["team"] == "a"
        assert {"key": "nvidia.com/gpu", "operator": "Exists",
                "effect": "NoSchedule"} in spec["tolerations"]
    finally:
        kube.delete("PriorityClass", f"e2e-{namespace}")


def test_kubectl_scale_sets_the_pools_count_and_the_operator_keeps_it(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str
) -> None:
    """Without `spec.autoscaling`, the pool's /scale subresource is its replica count: whoever
    writes it (a person with kubectl, an HPA, KEDA) sets the Deployment's, and the operator
    keeps it there (issue 37's item f)."""
    _artifact_and_pool(kube, namespace, "chat", spec__replicas=1)
    pool = _wait_pool(kube, operator, namespace, "chat", _available, "Available")
    deployment = naming.deployment_name("chat", pool["status"]["servingRevision"])
    kubectl("scale", "servingpool", "chat", "-n", namespace, "--replicas=2")
    scale = kube.request("GET", path_of("ServingPool", namespace, "chat") + "/scale")
    assert scale["spec"]["replicas"] == 2
    kube.wait_for(f"Deployment {deployment} at 2", lambda: kube.get(
        "Deployment", deployment, namespace)["spec"]["replicas"] == 2 or None, 30)
    # Kept: a drift round later (the operator reconciles its children every few seconds).
    time.sleep(2 * DRIFT_INTERVAL_S)
    assert kube.get("Deployment", deployment, namespace)["spec"]["replicas"] == 2
    _wait_pool(kube, operator, namespace, "chat",
               lambda p: p.get("status", {}).get("readyReplicas") == 2 or None, "2 ready", 60)
    # The /scale selector finds the pool's pods, and the control plane's own HPA controller
    # accepts the pool as a target (without one it says InvalidSelector and never scales).
    selector = kube.request("GET", path_of("ServingPool", namespace, "chat") + "/scale")[
        "status"]["selector"]
    assert len(kube.list("Pod", namespace, label_selector=selector)) == 2, selector
    kube.create({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                 "metadata": {"name": "chat", "namespace": namespace},
                 "spec": {"scaleTargetRef": {"apiVersion": "kvfleet.io/v1alpha1",
                                             "kind": "ServingPool", "name": "chat"},
                          "minReplicas": 2, "maxReplicas": 2,
                          "metrics": [{"type": "Resource", "resource": {
                              "name": "cpu", "target": {"type": "Utilization",
                                                        "averageUtilization": 80}}}]}})

    def hpa_read_the_scale() -> dict[str, JsonObj] | None:
        status = kube.get("HorizontalPodAutoscaler", "chat", namespace).get("status") or {}
        conditions = {c["type"]: c for c in status.get("conditions", [])}
        return conditions if "ScalingActive" in conditions else None

    conditions = kube.wait_for("the HPA's first sync", hpa_read_the_scale, 60)
    assert conditions["AbleToScale"]["status"] == "True", conditions
    # (No metrics server here: the metric fails, but not the selector.)
    assert conditions["ScalingActive"]["reason"] != "InvalidSelector", conditions


def test_drift_is_restored_and_deleted_service_recreated(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str
) -> None:
    _artifact_and_pool(kube, namespace, "chat", spec__replicas=1)
    pool = _wait_pool(kube, operator, namespace, "chat", _available, "Available")
    deployment = naming.deployment_name("chat", pool["status"]["servingRevision"])

    kubectl("scale", "deployment", deployment, "-n", namespace, "--replicas=3")
    kubectl("set", "image", f"deployment/{deployment}", "engine=evil:latest", "-n", namespace)

    def restored() -> JsonObj | None:
        d = kube.get("Deployment", deployment, namespace)
        image = d["spec"]["template"]["spec"]["containers"][0]["image"]
        return d if d["spec"]["replicas"] == 1 and image != "evil:latest" else None

    kube.wait_for(f"Deployment {deployment} restored", restored, 30)
    old_uid = kube.get("Service", "chat", namespace)["metadata"]["uid"]
    kube.delete("Service", "chat", namespace)
    kube.wait_for(
        "Service chat recreated",
        lambda: (
            (s := kube.get_or_none("Service", "chat", namespace))
            and s["metadata"]["uid"] != old_uid
        ),
        30,
    )
    final = _wait_pool(kube, operator, namespace, "chat", _available, "Available again")
    assert final["spec"] == pool["spec"] and final["metadata"]["generation"] == 1
    reasons = kubectl(
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        "involvedObject.kind=ServingPool,reason=Restored",
        "-o",
        "jsonpath={.items[*].message}",
    ).stdout
    assert "drifted at .spec.replicas" in reasons or "drifted at .spec.template" in reasons


def _metric_total(text: str, prefix: str) -> float:
    """The sum of the samples whose name and labels start with `prefix`."""
    return sum(
        float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(prefix)
    )


def test_drift_ticks_of_a_converged_pool_send_no_request(
    kube: KubeClient, operator: OperatorProcess, namespace: str
) -> None:
    """The drift check reads the watch-fed cache: once nothing differs, a tick costs the
    apiserver nothing (each tick used to GET the pool, its artifact and its four children)."""
    _artifact_and_pool(kube, namespace, "quiet")
    _wait_pool(kube, operator, namespace, "quiet", _available, "Available")
    reconciles = 'kvfleet_operator_reconciles_total{kind="ServingPool"}'
    requests = "kvfleet_operator_apiserver_requests_total"
    seen: list[tuple[float, float]] = []
    deadline = time.monotonic() + 60  # other tests' pools may still be settling
    while time.monotonic() < deadline:
        before = operator.metrics()
        time.sleep(3 * DRIFT_INTERVAL_S)  # every pool ticks at least twice
        after = operator.metrics()
        window = (
            _metric_total(after, reconciles) - _metric_total(before, reconciles),
            _metric_total(after, requests) - _metric_total(before, requests),
        )
        if window[0] >= 2 and window[1] == 0:
            return
        seen.append(window)
    pytest.fail(f"no quiet window of drift ticks; (reconciles, requests) per window: {seen}")


def test_operator_restart_converges_without_duplicates(
    kube: KubeClient, operator: OperatorProcess, namespace: str
) -> None:
    _artifact_and_pool(kube, namespace, "p0")
    _wait_pool(kube, operator, namespace, "p0", _available, "p0 Available")
    new = [f"p{i}" for i in range(1, 7)]

    def made() -> list[str]:
        return sorted(d["metadata"]["labels"][naming.POOL_LABEL]
                      for d in kube.list("Deployment", namespace)
                      if d["metadata"]["labels"][naming.POOL_LABEL] != "p0")

    # One reconcile at a time, so there is a stretch with some pools' children made and others'
    # not; the kill lands in it, as soon as a watch reports the first new Deployment. (A LIST
    # poll was too slow: in a CI run all 3 pools of the test's first form were made by then.)
    deployments = path_of("Deployment", namespace)
    try:
        operator.stop()
        for name in new:
            _create(kube, make_pool(name, "qwen3-8b", namespace)
                    .set("spec.gpu.product", H100).data())
        kube.delete("Service", "p0", namespace)
        since = kube.request("GET", deployments)["metadata"]["resourceVersion"]
        operator.extra_args = ("--max-concurrent-reconciles", "1")
        operator.start()
        with contextlib.closing(kube.watch(deployments, since, timeout_s=90)) as events:
            first = next((e for e in events if e["type"] == "ADDED" and (
                e["object"]["metadata"].get("labels") or {}).get(naming.POOL_LABEL) in new), None)
    finally:
        operator.stop(signal.SIGKILL)
        operator.extra_args = ()
        at_kill = made()
        operator.start()  # (also when the test fails here: the module's next tests need it)
    assert first is not None, "the restarted operator made no new Deployment in 90 s"
    assert 1 <= len(at_kill) < len(new), f"not killed mid-way: {at_kill} existed"
    for name in ["p0", *new]:
        _wait_pool(kube, operator, namespace, name, _available, f"{name} Available")
    pools = sorted(d["metadata"]["labels"][naming.POOL_LABEL]
                   for d in kube.list("Deployment", namespace))
    assert pools == ["p0", *new]
    services = sorted(s["metadata"]["name"] for s in kube.list("Service", namespace))
    assert services == ["p0", *new]
    assert len(kube.list("Pod", namespace)) == 1 + len(new)


@contextlib.contextmanager
def _only_the_local_l4_node(kube: KubeClient, kubectl: Kubectl) -> Iterator[None]:
    """Cordon the KWOK L4 nodes, so the harness's local node (whose pods really run the
    engine) is the only L4 that takes new pods; uncordon them afterwards."""
    fake_l4 = [
        n["metadata"]["name"]
        for n in kube.list("Node", label_selector=f"{fleet.PRODUCT_LABEL}=NVIDIA-L4,type=kwok")
    ]
    kubectl("cordon", *fake_l4)
    try:
        yield
    finally:
        kubectl("uncordon", *fake_l4)


def _local_engine_pool(name: str, artifact: str, ns: str) -> JsonObj:
    """A one-replica L4 pool sized for a local engine process: a 1 GiB "GPU" keeps the planned
    KV cache small, since the local engine allocates it in RAM."""
    pool = make_pool(name, artifact, ns)
    for path, value in {
        "spec.gpu.memory": "1Gi",
        "spec.engine.workspace": "64Mi",
        "spec.engine.safetyMargin": "64Mi",
        "spec.engine.maxModelLength": 2048,
        "spec.engine.maxBatchedTokens": 512,
    }.items():
        pool.set(path, value)
    return pool.data()


def test_real_engine_pod_serves_the_artifact_on_the_local_node(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,
    local_node: str, fake_nodes: list[str],
) -> None:  # fmt: skip
    """One pool whose pod really runs `kvfleet serve` (the harness's local L4 node): the args,
    settings and readiness the operator builds are those the real engine accepts."""
    kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / "01-modelartifact-smollm2.yaml"))
    with _only_the_local_l4_node(kube, kubectl):
        _create(kube, _local_engine_pool("smol", "smollm2-135m-instruct", namespace))
        ready = _wait_pool(kube, operator, namespace, "smol", _available, "real pod Ready", 300)
    (pod,) = kube.list("Pod", namespace, label_selector=f"{naming.POOL_LABEL}=smol")
    assert pod["spec"]["nodeName"] == local_node
    revision = ready["status"]["servingRevision"]
    url = f"http://{pod['status']['podIP']}:8000/v1/models"
    with urllib.request.urlopen(url, timeout=10) as response:
        models = yaml.safe_load(response.read())
    assert [(m["id"], m["revision"]) for m in models["data"]] == [
        ("smollm2-135m-instruct", revision[:12])
    ]
    assert ready["status"]["capacity"]["kvTokensPerReplica"] > 0
    # What the engine allocated, as Prometheus scraped it, against the plan it was pinned to.
    if operator.prometheus_url is None:
        return  # an existing cluster without the harness's Prometheus
    planned = -(-ready["status"]["capacity"]["kvTokensPerReplica"] // 16)
    pool = _wait_pool(
        kube, operator, namespace, "smol",
        lambda p: _cond(p, "KVCacheAsPlanned").get("status") == "True",
        "KVCacheAsPlanned from the engine's kvfleet_engine_kv_cache_blocks", timeout=120,
    )  # fmt: skip
    assert f"the planned {planned} KV blocks" in _cond(pool, "KVCacheAsPlanned")["message"]


def _says_sha256_differs(pool: JsonObj) -> bool:
    degraded = _cond(pool, "Degraded")
    message = degraded.get("message", "")
    return degraded.get("status") == "True" and "the manifest says" in message


def _keeps_saying_through_a_restart(
    kube: KubeClient, ns: str, name: str, check: Callable[[JsonObj], bool]
) -> None:
    """`check` holds for the pool at every look while its pod's failing container (the init
    step's, else the engine's) runs again and fails again (two more failures: at least one
    whole run and back-off lie between them)."""
    selector = f"{naming.POOL_LABEL}={name}"

    def restarts() -> int:
        (pod,) = kube.list("Pod", ns, label_selector=selector)
        status = pod["status"]
        states = status.get("initContainerStatuses") or status["containerStatuses"]
        return int(states[0]["restartCount"])

    first = restarts()
    deadline = time.monotonic() + 120
    while restarts() < first + 2:
        assert time.monotonic() < deadline, f"pod of {ns}/{name} did not crash twice in 120 s"
        pool = _get(kube, "ServingPool", ns, name)
        assert check(pool), f"the pool lost its reason between restarts: {pool['status']}"
        time.sleep(0.3)


def test_engine_refusing_weights_whose_sha256_differs_degrades_the_pool_with_its_reason(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,
    local_node: str, fake_nodes: list[str], argo_health: ArgoHealth,
) -> None:  # fmt: skip
    """An artifact that pins a sha256 the real file does not have is admitted and Verified (the
    operator never reads weights), but the pod's init step (`kvfleet artifact fetch`) refuses
    the file and exits, so the engine never starts; its last log line becomes the init
    container's termination message, which the pool shows. The drift timer does not tick
    meanwhile: the crash reaches the pool through the pod watch."""
    artifact = yaml.safe_load((EXAMPLES / "01-modelartifact-smollm2.yaml").read_text())
    real_sha256 = artifact["spec"]["weights"]["files"][0]["sha256"]
    claimed = "0" * 64
    artifact["spec"]["weights"]["files"][0]["sha256"] = claimed
    with operator.without_drift_timer(), _only_the_local_l4_node(kube, kubectl):
        _create(kube, _namespaced(artifact, namespace))
        _create(kube, _local_engine_pool("tampered", artifact["metadata"]["name"], namespace))
        degraded = _wait_pool(
            kube, operator, namespace, "tampered", _says_sha256_differs,
            "Degraded with the engine's sha256 reason", 180,
        )  # fmt: skip
        _keeps_saying_through_a_restart(kube, namespace, "tampered", _says_sha256_differs)
    assert _cond(_get(kube, "ModelArtifact", namespace, artifact["metadata"]["name"]),
                 "Verified")["status"] == "True"  # fmt: skip
    condition = _cond(degraded, "Degraded")
    assert condition["status"] == "True" and condition["reason"] == "CrashLoopBackOff"
    argo_health.expect(degraded, "Degraded", "crash-loop")
    # The fetch's own words, the file and both digests, nothing of the log lines before them.
    message = condition["message"]
    assert f"sha256 is {real_sha256}, the manifest says {claimed}" in message
    assert ("init container fetch-model CrashLoopBackOff (last exit code 1): error: "
            "SmolLM2-135M-Instruct.Q4_1.gguf: ") in message
    assert "fetch SmolLM2" not in message  # the progress lines before it
    assert not _available(degraded)
    (pod,) = kube.list("Pod", namespace, label_selector=f"{naming.POOL_LABEL}=tampered")
    assert pod["spec"]["nodeName"] == local_node
    (state,) = pod["status"]["initContainerStatuses"]
    assert state["restartCount"] >= 1 and not state["ready"]
    (engine,) = pod["status"]["containerStatuses"]
    assert "running" not in engine["state"] and engine["restartCount"] == 0  # never started
    # The local kubelet's termination message: the log's tail, whose last line is the reason.
    last = state["lastState"]["terminated"]
    assert last["exitCode"] == 1
    assert "the manifest says" in last["message"].rstrip().splitlines()[-1]


def test_an_engine_settings_change_is_a_new_revision_rolled_over(
    kube: KubeClient, operator: OperatorProcess, namespace: str
) -> None:
    """An ungoverned pool: a settings change is a new revision (its own Deployment, named in
    status.revision), which replaces the old one; replicas alone would not have been."""
    _artifact_and_pool(kube, namespace, "chat")
    pool = _wait_pool(kube, operator, namespace, "chat", _available, "Available")
    old = pool["status"]["servingRevision"]
    assert pool["status"]["revision"] == old
    kube.request(
        "PATCH",
        path_of("ServingPool", namespace, "chat"),
        {"spec": {"replicas": 2, "engine": {"maxRunningRequests": 32}}},
        content_type="application/merge-patch+json",
    )
    pool = _wait_pool(
        kube, operator, namespace, "chat",
        # Progressing=Complete, not only 2 ready: mid-roll an old pod and a new one are ready.
        lambda p: _available(p) and p["status"].get("readyReplicas") == 2
        and p["status"].get("observedGeneration") == 2
        and _cond(p, "Progressing").get("reason") == "Complete",
        "2 ready replicas with the new settings, rollout complete",
    )  # fmt: skip
    new = pool["status"]["servingRevision"]
    assert new == pool["status"]["revision"] != old
    deployment = kube.get("Deployment", naming.deployment_name("chat", new), namespace)
    assert deployment["spec"]["replicas"] == 2
    env = {e["name"]: e.get("value") for e in
           deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVFLEET_MAX_NUM_SEQS"] == "32"
    kube.wait_for("the old revision's Deployment retired", lambda: not kube.list(
        "Deployment", namespace, label_selector=f"{naming.REVISION_LABEL}={old[:12]}") or None,
        60)
    pods = kube.list("Pod", namespace, label_selector=f"{naming.POOL_LABEL}=chat")
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    assert {p["metadata"]["labels"][naming.REVISION_LABEL] for p in live} == {new[:12]}


# -- least privilege, measured: the last test of this module ---------------------------------

# Granted but not always seen in the audit log, each for a reason: server-side apply that
# creates an object is audited as `patch` but authorized as `create` too; a Deployment is
# deleted only when a revision retires (the rollout tests); kopf watches namespaces only to
# resolve `--namespace` globs (the tests run cluster-wide).
NEEDED_UNSEEN = {
    **{(group, resource, "create"): "server-side apply creating an object"
       for group, resource in (("apps", "deployments"), ("", "services"),
                               ("", "secrets"), ("networking.k8s.io", "networkpolicies"),
                               ("policy", "poddisruptionbudgets"))},
    ("apps", "deployments", "delete"): "a retired revision",
    ("kvfleet.io", "servingpools", "patch"): "the autoscaler's spec.replicas (kopf writes "
                                             "nothing onto a pool; test_autoscale_e2e.py)",
    **{("", "namespaces", verb): "--namespace globs" for verb in ("list", "watch")},
}


def _used(audit_log: Path, user: str) -> set[tuple[str, str, str]]:
    used: set[tuple[str, str, str]] = set()
    for line in audit_log.read_text().splitlines():
        entry = json.loads(line)
        ref = entry.get("objectRef")
        if entry["user"]["username"] != user or ref is None:
            continue  # discovery (/api, /apis) carries no objectRef: any user may read it
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        used.add((ref.get("apiGroup", ""), resource, entry["verb"]))
    return used


def test_the_operator_used_what_its_role_grants_and_nothing_more(
    cluster: DevCluster | ExistingCluster, operator: OperatorProcess,
) -> None:
    """The apiserver's audit log of this module's operator (its own ServiceAccount, the RBAC
    `--print-rbac` prints): every request was granted (else it would have failed with 403),
    and every grant was used, or is listed with the reason the tests cannot show it."""
    if not isinstance(cluster, DevCluster):
        pytest.skip("reads the dev cluster's apiserver audit log")
    user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{RBAC_NAME}"
    used = _used(cluster.audit_log, user)
    granted = permissions(cluster_role_rules())
    assert used, f"no request by {user} in {cluster.audit_log}"
    assert used <= granted, f"used but not granted: {sorted(used - granted)}"
    unused = granted - used - set(NEEDED_UNSEEN)
    assert not unused, f"granted but never used: {sorted(unused)}"
