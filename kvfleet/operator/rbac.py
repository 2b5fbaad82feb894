"""The operator's RBAC, as data: exactly the verbs its reconcilers and kopf's watches use.

`deploy/operator/rbac.yaml` is generated from `install_rbac()` (`kvfleet operator --print-rbac`:
the namespace, then `build_rbac()`, so `kubectl apply -f` of the file works on a bare cluster)
and a unit test fails when they differ, so the file is never edited by hand. The e2e tests run
the operator as this ServiceAccount and compare the dev cluster's audit log with these rules:
nothing used is missing, nothing granted goes unused (but for the reasons listed there).
The operator reads through watches (informers, kopf), never by GET, and runs `--standalone`
or `--leader-elect` (kopf peering would need the kopf.dev peering resources besides).
"""

from __future__ import annotations

from typing import Any

NAME = "kvfleet-operator"
WATCH = ["list", "watch"]


def cluster_role_rules() -> list[dict[str, Any]]:
    return [
        # kopf watches the kinds it handles; it stores its progress in the annotations of
        # artifacts and Rollouts (pools reach the operator as plain events: changes.py). A
        # pool is patched only by the autoscaler, its spec.replicas.
        {
            "apiGroups": ["kvfleet.io"],
            "resources": ["servingpools", "modelartifacts", "rollouts"],
            "verbs": [*WATCH, "patch"],
        },
        {
            "apiGroups": ["kvfleet.io"],
            "resources": ["servingpools/status", "modelartifacts/status", "rollouts/status"],
            "verbs": ["patch"],
        },
        # Owned children: server-side apply is a patch (and a create when the object is new);
        # a retired revision's Deployment is deleted, the rest goes with its owner (GC).
        {
            "apiGroups": ["apps"],
            "resources": ["deployments"],
            "verbs": [*WATCH, "create", "patch", "delete"],
        },
        {
            "apiGroups": [""],
            "resources": ["services"],
            "verbs": [*WATCH, "create", "patch"],
        },
        # Each pool's router token (the operator writes it once; engines mount it).
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "verbs": [*WATCH, "create", "patch"],
        },
        {
            "apiGroups": ["networking.k8s.io"],
            "resources": ["networkpolicies"],
            "verbs": [*WATCH, "create", "patch"],
        },
        {
            "apiGroups": ["policy"],
            "resources": ["poddisruptionbudgets"],
            "verbs": [*WATCH, "create", "patch"],
        },
        # Pod conditions explain why replicas are not ready; a change there triggers the pool.
        {"apiGroups": [""], "resources": ["pods"], "verbs": WATCH},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        # kopf resolves `--namespace` globs against the live namespaces.
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": WATCH},
    ]


def permissions(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """Every (apiGroup, resource, verb) the rules grant, e.g. ("apps", "deployments", "patch")."""
    return {(group, resource, verb) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def lease_role_rules() -> list[dict[str, Any]]:
    """`--leader-elect`: the Lease in the operator's own namespace (a Role, not cluster-wide)."""
    return [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
             "verbs": ["get", "create", "update"]}]


def build_rbac(namespace: str = "kvfleet-system") -> list[dict[str, Any]]:
    """ServiceAccount, ClusterRole and ClusterRoleBinding for a cluster-wide operator, and the
    Role for its leader Lease."""
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": NAME, "namespace": namespace},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": NAME},
            "rules": cluster_role_rules(),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": NAME},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": NAME,
            },
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": f"{NAME}-leader", "namespace": namespace},
            "rules": lease_role_rules(),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": f"{NAME}-leader", "namespace": namespace},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": f"{NAME}-leader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}],
        },
    ]


def install_rbac(namespace: str = "kvfleet-system") -> list[dict[str, Any]]:
    """What `kubectl apply -f deploy/operator/rbac.yaml` needs on a bare cluster: the
    namespace the ServiceAccount and its Role live in, then the RBAC."""
    return [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
            *build_rbac(namespace)]
