"""The router's install manifests for one namespace, as data: ServiceAccount, Role and
RoleBinding with exactly the verbs `cluster.ClusterSource` uses, a Deployment of two replicas and
the Service clients are pointed at. `deploy/router/router.yaml` is generated from
`build_manifests()` (`kvfleet router --print-manifests`) and a unit test fails when they differ.

RBAC cannot filter by label: the router may read every Secret of its namespace, though it lists
only those labelled `kvfleet.io/tenant` or `kvfleet.io/router-token-for`. Keep other Secrets of
value out of a namespace that runs a router, or run it in one of its own with `-A` (a
ClusterRole of the same rules).
"""

from __future__ import annotations

from typing import Any

from kvfleet.api.labels import ROUTER_APP

NAME = ROUTER_APP
PORT = 8080
# /metrics, on a port of its own: the Service exposes PORT only, and the series (per pool and
# revision) are no client's to read (the chart's NetworkPolicy admits only Prometheus here).
METRICS_PORT = 9091
WATCH = ["get", "list", "watch"]
LABELS = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/component": "router"}


def role_rules() -> list[dict[str, Any]]:
    return [
        {"apiGroups": ["kvfleet.io"], "resources": ["servingpools", "tenantquotas"],
         "verbs": [*WATCH]},
        {"apiGroups": ["kvfleet.io"], "resources": ["tenantquotas/status"], "verbs": ["patch"]},
        # Engine pods (endpoints by revision) and the router's own replicas (its quota share).
        {"apiGroups": [""], "resources": ["pods"], "verbs": [*WATCH]},
        # API keys and each pool's engine token.
        {"apiGroups": [""], "resources": ["secrets"], "verbs": [*WATCH]},
        # Who owns an engine pod: only pods of the pool's own Deployments get its traffic.
        {"apiGroups": ["apps"], "resources": ["deployments", "replicasets"], "verbs": [*WATCH]},
    ]


def build_manifests(namespace: str, image: str = "kvfleet:0.1.0",
                    redis_secret: str | None = None) -> list[dict[str, Any]]:
    """`redis_secret`: the Secret whose key `url` holds the shared quota ledger's URL (as the
    chart's `router.redis.urlSecret`); without it each replica enforces its 1/N share."""
    def meta() -> dict[str, Any]:  # a fresh copy each time: YAML gets no anchors
        return {"name": NAME, "namespace": namespace, "labels": dict(LABELS)}

    container = {
        "name": "router",
        "image": image,
        # Bound to the pod IP, as the engines are; `command` is the image's entrypoint, spelled
        # out so a runner without images (the dev cluster's local nodes) runs it too.
        "command": ["kvfleet"],
        "args": ["router", "-n", namespace, "--host", "$(POD_IP)", "--port", str(PORT),
                 "--metrics-port", str(METRICS_PORT)],
        # POD_NAME: the replica's name in the TenantQuotas' router reports.
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                # POD_NAMESPACE: where its replicas are (the only router pods it counts).
                {"name": "POD_NAMESPACE",
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                # From the Secret, not an argument: the URL may hold a password (not in ps).
                *([{"name": "KVFLEET_REDIS_URL", "valueFrom": {"secretKeyRef": {
                    "name": redis_secret, "key": "url"}}}] if redis_secret else [])],
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "500m", "memory": "256Mi"},
                      "limits": {"memory": "1Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta()},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(),
         "rules": role_rules()},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta(),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NAME},
         "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(), "spec": {
            "replicas": 2,
            "selector": {"matchLabels": dict(LABELS)},
            "template": {
                "metadata": {"labels": dict(LABELS), "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                    "prometheus.io/path": "/metrics"}},
                "spec": {"serviceAccountName": NAME, "containers": [container],
                         "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}},
            },
        }},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(), "spec": {
            "selector": dict(LABELS),
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        }},
    ]
