"""Where each kind lives in the API: the one kind -> path table of every kvfleet client.

kvfleet's own kinds come from their pydantic models (kvfleet.api), so a new kind or plural is
known here without an edit.
"""

from __future__ import annotations

from typing import NamedTuple

from kvfleet.api import GROUP, KINDS, VERSION


class Resource(NamedTuple):
    prefix: str  # /api/v1 or /apis/<group>/<version>
    plural: str
    namespaced: bool = True


RESOURCES: dict[str, Resource] = {
    "Pod": Resource("/api/v1", "pods"),
    "Node": Resource("/api/v1", "nodes", False),
    "Event": Resource("/api/v1", "events"),
    "Namespace": Resource("/api/v1", "namespaces", False),
    "Service": Resource("/api/v1", "services"),
    "ConfigMap": Resource("/api/v1", "configmaps"),
    "Secret": Resource("/api/v1", "secrets"),
    "ServiceAccount": Resource("/api/v1", "serviceaccounts"),
    "Deployment": Resource("/apis/apps/v1", "deployments"),
    "ReplicaSet": Resource("/apis/apps/v1", "replicasets"),
    "StatefulSet": Resource("/apis/apps/v1", "statefulsets"),
    "PriorityClass": Resource("/apis/scheduling.k8s.io/v1", "priorityclasses", False),
    "PersistentVolumeClaim": Resource("/api/v1", "persistentvolumeclaims"),
    "Lease": Resource("/apis/coordination.k8s.io/v1", "leases"),
    "PodDisruptionBudget": Resource("/apis/policy/v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": Resource("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    "EndpointSlice": Resource("/apis/discovery.k8s.io/v1", "endpointslices"),
    "NetworkPolicy": Resource("/apis/networking.k8s.io/v1", "networkpolicies"),
    "Role": Resource("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": Resource("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "ClusterRole": Resource("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": Resource("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings",
                                   False),
    "CustomResourceDefinition": Resource("/apis/apiextensions.k8s.io/v1",
                                         "customresourcedefinitions", False),
    "ValidatingWebhookConfiguration": Resource("/apis/admissionregistration.k8s.io/v1",
                                               "validatingwebhookconfigurations", False),
    "MutatingWebhookConfiguration": Resource("/apis/admissionregistration.k8s.io/v1",
                                             "mutatingwebhookconfigurations", False),
    **{kind: Resource(f"/apis/{GROUP}/{VERSION}", model.crd.plural)
       for kind, model in KINDS.items()},
}


class UnknownKind(KeyError):
    def __str__(self) -> str:
        return f"kind {self.args[0]!r} is not in kvfleet.kube.resources.RESOURCES; add it there"


def _resource(kind: str) -> Resource:
    try:
        return RESOURCES[kind]
    except KeyError:
        raise UnknownKind(kind) from None


def path_of(kind: str, namespace: str | None = None, name: str | None = None) -> str:
    """The object's path, or its collection's without `name`; a namespaced kind without
    `namespace` is the collection across all namespaces."""
    prefix, plural, namespaced = _resource(kind)
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespaced and namespace else \
        f"{prefix}/{plural}"
    return f"{path}/{name}" if name else path


def api_version_of(kind: str) -> str:
    """`apps/v1` for a Deployment, `v1` for a Service: what list items leave out."""
    return _resource(kind).prefix.removeprefix("/apis/").removeprefix("/api/")
