"""Fake GPU nodes: manifests with the labels and extended resources that NVIDIA's GPU operator
(GPU feature discovery + device plugin) puts on real nodes. Pure builders; `create_nodes` is the
only function that talks to the API server."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvfleet.devcluster.kube import KubeClient

GPU_RESOURCE = "nvidia.com/gpu"
PRODUCT_LABEL = "nvidia.com/gpu.product"
ZONE_LABEL = "topology.kubernetes.io/zone"
# KWOK manages exactly the nodes with this annotation (its --manage-nodes-with-annotation-selector);
# the local pod runner's nodes lack it.
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_ANNOTATION_VALUE = "fake"
LOCAL_NODE_LABEL = "kvfleet.io/local-node"
FAKE_NODE_LABEL = "type"  # the label KWOK's docs use; lets tests target fake nodes


@dataclass(frozen=True)
class GpuProduct:
    """One GPU model as GPU feature discovery labels it."""

    product: str  # nvidia.com/gpu.product
    memory_mib: int  # nvidia.com/gpu.memory
    family: str  # nvidia.com/gpu.family
    compute_major: int
    compute_minor: int
    short: str  # used in node names


H100_80GB = GpuProduct("NVIDIA-H100-80GB-HBM3", 81559, "hopper", 9, 0, "h100")
A100_40GB = GpuProduct("NVIDIA-A100-SXM4-40GB", 40960, "ampere", 8, 0, "a100")
L4 = GpuProduct("NVIDIA-L4", 23034, "ada-lovelace", 8, 9, "l4")
PRODUCTS: tuple[GpuProduct, ...] = (H100_80GB, A100_40GB, L4)


@dataclass(frozen=True)
class NodeGroup:
    """`count` identical nodes of `gpus_per_node` GPUs each, spread round-robin over zones."""

    product: GpuProduct
    count: int
    gpus_per_node: int
    zones: tuple[str, ...] = ("zone-a", "zone-b")

    def __post_init__(self) -> None:
        if self.count < 0 or self.gpus_per_node < 0 or not self.zones:
            raise ValueError(
                f"NodeGroup({self.product.short}): count and gpus_per_node must be >= 0 and "
                f"zones non-empty, got count={self.count}, gpus_per_node={self.gpus_per_node}"
            )


# A small mixed fleet: big training-class nodes and single-GPU inference nodes.
DEFAULT_FLEET: tuple[NodeGroup, ...] = (
    NodeGroup(H100_80GB, count=2, gpus_per_node=8),
    NodeGroup(A100_40GB, count=2, gpus_per_node=8),
    NodeGroup(L4, count=2, gpus_per_node=1),
)


def gpu_labels(product: GpuProduct, gpus: int, zone: str) -> dict[str, str]:
    return {
        PRODUCT_LABEL: product.product,
        "nvidia.com/gpu.memory": str(product.memory_mib),
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.family": product.family,
        "nvidia.com/gpu.compute.major": str(product.compute_major),
        "nvidia.com/gpu.compute.minor": str(product.compute_minor),
        "nvidia.com/gpu.present": "true",
        ZONE_LABEL: zone,
        "topology.kubernetes.io/region": "dev-region",
        "node.kubernetes.io/instance-type": f"gpu-{product.short}-x{gpus}",
    }


def build_node(
    name: str, product: GpuProduct, gpus: int, zone: str, *, fake: bool = True,
    taints: Iterable[dict[str, str]] = (),
) -> dict[str, Any]:
    """A Node with GPU labels and capacity; `fake` ones carry KWOK's management annotation.
    `taints` as real GPU node pools have them (e.g. GPU_TAINT, a team's dedicated taint)."""
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        **gpu_labels(product, gpus, zone),
    }
    annotations: dict[str, str] = {"node.alpha.kubernetes.io/ttl": "0"}
    if fake:
        labels[FAKE_NODE_LABEL] = "kwok"
        annotations[KWOK_ANNOTATION] = KWOK_ANNOTATION_VALUE
    else:
        labels[LOCAL_NODE_LABEL] = "true"
    capacity = {
        "cpu": "96",
        "memory": "1Ti",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        GPU_RESOURCE: str(gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {"taints": list(taints)} if taints else {},
        # KWOK's node-initialize stage keeps capacity/allocatable that are already set; the
        # local runner reports these itself.
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }


# What the NVIDIA GPU operator's node setup (or a cloud's GPU node pool) puts on GPU nodes.
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}


def build_fleet(groups: Iterable[NodeGroup], prefix: str = "gpu") -> list[dict[str, Any]]:
    nodes = []
    for group in groups:
        for i in range(group.count):
            zone = group.zones[i % len(group.zones)]
            name = f"{prefix}-{group.product.short}-{i}"
            nodes.append(build_node(name, group.product, group.gpus_per_node, zone))
    return nodes


def create_nodes(api: KubeClient, nodes: Iterable[dict[str, Any]]) -> list[str]:
    """Create nodes and return their names. The API server keeps a Node's status on create (as
    for a kubelet registering), so capacity and allocatable need no second request."""
    return [api.create(node)["metadata"]["name"] for node in nodes]
