"""spec.pod: what a platform team sets on engine pods, refused at admission when wrong (naming
the field), rendered by the operator into the Deployment as Kubernetes expects it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from operator_fakes import artifact, pool

from kvfleet.api.builders import make_pool
from kvfleet.capacity import plan_for_pool
from kvfleet.compat import default_matrix
from kvfleet.operator import builders

TEAM_NODES = {"kvfleet.test/partition": "team-a"}


def _pod_spec(**pod: Any) -> dict[str, Any]:
    p, a = pool(spec__pod=pod), artifact()
    plan = plan_for_pool(a.spec, p.spec, default_matrix().gpu_products["NVIDIA-L4"].memory_bytes)
    deployment = builders.build_deployment(p, a, plan)
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    spec["metadata"] = deployment["spec"]["template"]["metadata"]
    return spec


def _denied(pod: dict[str, Any]) -> str:
    """The webhook's message for a pool with these pod settings."""
    from kvfleet.webhooks import admit

    data = make_pool().data()
    data["spec"]["pod"] = pod

    async def fetch(kind: str, namespace: str, name: str) -> None:
        return None

    decision = asyncio.run(admit("ServingPool", data, None, fetch=fetch,
                                 matrix=default_matrix(), namespace="default"))
    assert not decision.allowed, pod
    return decision.message("ServingPool", "chat")


@pytest.mark.parametrize(("pod", "field", "says"), [
    ({"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100"}}, "spec.pod.nodeSelector",
     "selected from spec.gpu.product"),
    ({"tolerations": [{"operator": "Exists", "value": "x"}]}, "spec.pod.tolerations[0]",
     "operator Exists takes no value"),
    ({"tolerations": [{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 5}]},
     "spec.pod.tolerations[0]", "NoExecute only"),
    ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "a", "operator": "In"}]}]}}}},
     "spec.pod.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution."
     "nodeSelectorTerms[0].matchExpressions[0]", "operator In needs at least one value"),
    ({"resources": {"requests": {"memory": "64Gi"}, "limits": {"memory": "32Gi"}}},
     "spec.pod.resources", "requests.memory 64Gi exceeds limits.memory 32Gi"),
    ({"resources": {"requests": {"cpu": "two"}}}, "spec.pod.resources.requests.cpu", "pattern"),
    ({"modelCache": {}}, "spec.pod.modelCache", "exactly one of emptyDir and"),
    ({"env": [{"name": "KVFLEET_BLOCK_SIZE", "value": "32"}]}, "spec.pod.env[0].name",
     "set by the operator"),
    ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "spec.pod.env",
     "A appear twice"),
    ({"env": [{"name": "S", "valueFrom": {}}]}, "spec.pod.env[0].valueFrom",
     "exactly one of secretKeyRef and configMapKeyRef"),
    ({"labels": {"kvfleet.io/pool": "other"}}, "spec.pod.labels", "are the operator's"),
    ({"imagePullSecrets": ["Not_A_Name"]}, "spec.pod.imagePullSecrets", "not a Secret name"),
    ({"priorityClassName": "High"}, "spec.pod.priorityClassName", "pattern"),
])
def test_a_wrong_pod_setting_is_refused_naming_the_field(pod: dict[str, Any], field: str,
                                                         says: str) -> None:
    message = _denied(pod)
    assert f"{field}: " in message and says in message, message


def test_defaults_select_the_gpu_tolerate_its_taint_and_size_the_cache() -> None:
    spec = _pod_spec()
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                    "effect": "NoSchedule"}]
    (engine,) = spec["containers"]
    a = artifact()
    weights = plan_for_pool(a.spec, pool().spec, None).weight_bytes
    assert weights is not None
    memory = int(engine["resources"]["requests"]["memory"].removesuffix("Mi")) * 2**20
    assert weights + 2**30 <= memory < weights + 2**30 + 2**20  # the ledger's weights + 1 GiB
    assert "memory" not in engine["resources"]["limits"]
    for key in ("priorityClassName", "serviceAccountName", "imagePullSecrets", "affinity"):
        assert key not in spec
    assert spec["volumes"][0]["emptyDir"]["sizeLimit"].endswith("Mi")


def test_every_setting_reaches_the_deployment() -> None:
    spec = _pod_spec(
        nodeSelector=TEAM_NODES,
        tolerations=[{"key": "dedicated", "operator": "Equal", "value": "inference",
                      "effect": "NoSchedule"}],
        affinity={"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 50, "preference": {"matchExpressions": [
                {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}]}}]}},
        priorityClassName="llm-serving", serviceAccountName="model-reader",
        resources={"requests": {"cpu": "4", "memory": "24Gi"}, "limits": {"memory": "32Gi"}},
        modelCache={"persistentVolumeClaim": {"claimName": "models"}},
        image="registry.internal/kvfleet:0.1.0", imagePullPolicy="Always",
        imagePullSecrets=["registry"],
        env=[{"name": "AWS_ENDPOINT_URL", "value": "http://minio:9000"},
             {"name": "AWS_SECRET_ACCESS_KEY",
              "valueFrom": {"secretKeyRef": {"name": "s3", "key": "secret"}}}],
        labels={"team": "a"}, annotations={"sidecar.istio.io/inject": "false"},
    )
    assert spec["nodeSelector"] == {**TEAM_NODES, "nvidia.com/gpu.product": "NVIDIA-L4"}
    assert spec["tolerations"][1] == {"key": "dedicated", "operator": "Equal",
                                      "value": "inference", "effect": "NoSchedule"}
    preferred = spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred[0]["weight"] == 50
    assert (spec["priorityClassName"], spec["serviceAccountName"]) == ("llm-serving",
                                                                       "model-reader")
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert spec["volumes"][0] == {"name": "model-cache",
                                  "persistentVolumeClaim": {"claimName": "models"}}
    (fetch,), (engine,) = spec["initContainers"], spec["containers"]
    for container in (fetch, engine):
        assert (container["image"], container["imagePullPolicy"]) == (
            "registry.internal/kvfleet:0.1.0", "Always")
        env = {e["name"]: e for e in container["env"]}
        assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio:9000"
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {
            "secretKeyRef": {"name": "s3", "key": "secret"}}
        assert "KVFLEET_MODEL_CACHE_LIMIT_BYTES" not in env  # a shared claim: no cap of ours
    assert engine["resources"] == {
        "requests": {"nvidia.com/gpu": "1", "cpu": "4", "memory": "24Gi"},
        "limits": {"nvidia.com/gpu": "1", "memory": "32Gi"}}
    # 4 CPUs asked and no CPU limit (no quota for the engine to read): 4 threads, not a
    # thread per core of the node.
    assert {e["name"]: e for e in engine["env"]}["KVFLEET_CPU_THREADS"]["value"] == "4"
    assert spec["metadata"]["labels"]["team"] == "a"
    assert spec["metadata"]["labels"]["kvfleet.io/pool"] == "chat"
    assert spec["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"


@pytest.mark.parametrize(("resources", "threads"), [
    ({"requests": {"cpu": "2500m"}}, "2"),
    ({"requests": {"cpu": "500m"}}, "1"),
    ({"requests": {"cpu": "4"}, "limits": {"cpu": "4"}}, None),  # the quota: the engine reads it
    ({"limits": {"cpu": "2"}}, None),
    ({"requests": {"memory": "8Gi"}}, None),  # nothing said of CPUs: the engine's CPUs decide
])
def test_engine_threads_follow_requested_cpus_without_a_limit(
        resources: dict[str, dict[str, str]], threads: str | None) -> None:
    (engine,) = _pod_spec(resources=resources)["containers"]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env.get("KVFLEET_CPU_THREADS") == threads


def test_the_engine_reads_the_threads_the_operator_sets() -> None:
    from kvfleet.engine import device

    env = {builders.CPU_THREADS_ENV: "3"}
    assert device.cpu_threads(None, env, 8, None).threads == 3


def test_the_gpu_memory_bound_joins_every_required_term() -> None:
    """Terms are alternatives: a bound added as a term of its own would let nodes of any GPU
    memory in through the team's terms."""
    terms = [{"matchExpressions": [{"key": "kvfleet.test/partition", "operator": "In",
                                    "values": [team]}]} for team in ("a", "b")]
    p = pool(spec__gpu__memory="24Gi", spec__pod={"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}})
    affinity = builders.node_affinity(p.spec)
    assert affinity is not None
    got = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    bound = {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["24575"]}
    assert [t["matchExpressions"] for t in got["nodeSelectorTerms"]] == [
        [*t["matchExpressions"], bound] for t in terms]


def test_a_memory_request_defaults_below_the_pools_own_limit() -> None:
    spec = _pod_spec(resources={"limits": {"memory": "1Gi"}})
    assert spec["containers"][0]["resources"]["requests"]["memory"] == "1024Mi"


def test_an_empty_dir_cache_of_the_pools_size_caps_the_fetch() -> None:
    spec = _pod_spec(modelCache={"emptyDir": {"sizeLimit": "40Gi", "medium": "Memory"}})
    assert spec["volumes"][0] == {"name": "model-cache",
                                  "emptyDir": {"sizeLimit": "40Gi", "medium": "Memory"}}
    env = {e["name"]: e.get("value") for e in spec["initContainers"][0]["env"]}
    assert env["KVFLEET_MODEL_CACHE_LIMIT_BYTES"] == str(40 * 2**30)
