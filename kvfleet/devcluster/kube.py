"""A small, synchronous Kubernetes API client over httpx: enough for the harness, the local pod
runner and the e2e tests, without the weight of a generated client.

It reads the kubeconfigs the harness writes and the common shapes of real ones (CA and client
certificate as files or inline data, bearer tokens); exec credential plugins are not supported.
"""

from __future__ import annotations

import atexit
import base64
import json
import ssl
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from kvfleet.devcluster.errors import DevClusterError, KubeApiError

JsonObj = dict[str, Any]
T = TypeVar("T")

# (group/version prefix, plural) per kind the harness and tests touch.
_RESOURCES: dict[str, tuple[str, str, bool]] = {
    "Pod": ("/api/v1", "pods", True),
    "Node": ("/api/v1", "nodes", False),
    "Event": ("/api/v1", "events", True),
    "Namespace": ("/api/v1", "namespaces", False),
    "Service": ("/api/v1", "services", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "Secret": ("/api/v1", "secrets", True),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "ReplicaSet": ("/apis/apps/v1", "replicasets", True),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases", True),
    "StatefulSet": ("/apis/apps/v1", "statefulsets", True),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets", True),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", "endpointslices", True),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies", True),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "CustomResourceDefinition": (
        "/apis/apiextensions.k8s.io/v1",
        "customresourcedefinitions",
        False,
    ),
    "ValidatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingwebhookconfigurations",
        False,
    ),
    "MutatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1",
        "mutatingwebhookconfigurations",
        False,
    ),
    # kvfleet's own resources (group kvfleet.io, see DESIGN.md).
    "ModelArtifact": ("/apis/kvfleet.io/v1alpha1", "modelartifacts", True),
    "ServingPool": ("/apis/kvfleet.io/v1alpha1", "servingpools", True),
    "TenantQuota": ("/apis/kvfleet.io/v1alpha1", "tenantquotas", True),
    "Rollout": ("/apis/kvfleet.io/v1alpha1", "rollouts", True),
}


@dataclass(frozen=True)
class KubeConfig:
    """What a client needs from a kubeconfig: the server and how to trust and log in to it."""

    server: str
    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    token: str | None = None
    insecure: bool = False

    @classmethod
    def load(cls, path: Path) -> KubeConfig:
        """Parse the current context of a kubeconfig file; inline data goes to temp files."""
        try:
            doc = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise DevClusterError(f"cannot read kubeconfig {path}: {exc}") from exc
        current = doc.get("current-context")
        contexts = {c["name"]: c["context"] for c in doc.get("contexts") or []}
        if current not in contexts:
            raise DevClusterError(f"{path}: current-context {current!r} is not in contexts")
        ctx = contexts[current]
        cluster = {c["name"]: c["cluster"] for c in doc.get("clusters") or []}[ctx["cluster"]]
        user = {u["name"]: u["user"] for u in doc.get("users") or []}.get(ctx.get("user"), {})
        if "exec" in user or "auth-provider" in user:
            raise DevClusterError(
                f"{path}: user {ctx.get('user')!r} uses a credential plugin, which this client "
                "does not run; use a kubeconfig with a client certificate or a token"
            )

        def material(file_key: str, data_key: str, entry: Mapping[str, Any]) -> Path | None:
            if entry.get(file_key):
                return (path.parent / str(entry[file_key])).resolve()
            if entry.get(data_key):
                # ssl loads certificates only from files; removed when the interpreter exits.
                with tempfile.NamedTemporaryFile("wb", delete=False, suffix=".pem") as tmp:
                    tmp.write(base64.b64decode(entry[data_key]))
                atexit.register(Path(tmp.name).unlink, missing_ok=True)
                return Path(tmp.name)
            return None

        return cls(
            server=str(cluster["server"]).rstrip("/"),
            ca_file=material("certificate-authority", "certificate-authority-data", cluster),
            client_cert=material("client-certificate", "client-certificate-data", user),
            client_key=material("client-key", "client-key-data", user),
            token=user.get("token"),
            insecure=bool(cluster.get("insecure-skip-tls-verify")),
        )

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.client_cert and self.client_key:
            ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        return ctx


def resource_path(kind: str, namespace: str | None = None, name: str | None = None) -> str:
    try:
        prefix, plural, namespaced = _RESOURCES[kind]
    except KeyError:
        raise DevClusterError(f"kind {kind!r} is not known to kvfleet.devcluster.kube") from None
    path = prefix
    if namespaced and namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    return f"{path}/{name}" if name else path


class KubeClient:
    """JSON requests to one API server; every non-2xx answer raises KubeApiError."""

    def __init__(self, config: KubeConfig, timeout: float = 30.0) -> None:
        self.config = config
        headers = {"Accept": "application/json"}
        if config.token:
            headers["Authorization"] = f"Bearer {config.token}"
        self._http = httpx.Client(
            base_url=config.server, verify=config.ssl_context(), headers=headers, timeout=timeout
        )

    def close(self) -> None:
        self._http.close()

    def request(
        self,
        method: str,
        path: str,
        body: object | None = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> JsonObj:
        content = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type} if content is not None else {}
        resp = self._http.request(method, path, content=content, params=params, headers=headers)
        if resp.status_code >= 400:
            try:
                status = resp.json()
                reason, message = status.get("reason", ""), status.get("message", resp.text)
            except ValueError:
                reason, message = "", resp.text
            raise KubeApiError(method, path, resp.status_code, reason, message)
        if not resp.content:
            return {}
        data: JsonObj = resp.json()
        return data

    def get_raw(self, path: str) -> httpx.Response:
        return self._http.get(path)

    # Typed conveniences over `request`.
    def get(self, kind: str, name: str, namespace: str | None = None) -> JsonObj:
        return self.request("GET", resource_path(kind, namespace, name))

    def get_or_none(self, kind: str, name: str, namespace: str | None = None) -> JsonObj | None:
        try:
            return self.get(kind, name, namespace)
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str = "",
        field_selector: str = "",
    ) -> list[JsonObj]:
        params = {
            k: v
            for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector))
            if v
        }
        items: list[JsonObj] = self.request(
            "GET", resource_path(kind, namespace), params=params
        ).get("items", [])
        return items

    def create(self, obj: JsonObj) -> JsonObj:
        namespace = obj.get("metadata", {}).get("namespace")
        return self.request("POST", resource_path(obj["kind"], namespace), obj)

    def merge_patch(
        self,
        kind: str,
        name: str,
        patch: JsonObj,
        namespace: str | None = None,
        *,
        subresource: str = "",
    ) -> JsonObj:
        path = resource_path(kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def delete(
        self,
        kind: str,
        name: str,
        namespace: str | None = None,
        *,
        grace_period_seconds: int | None = None,
    ) -> None:
        body = None
        if grace_period_seconds is not None:
            body = {
                "kind": "DeleteOptions",
                "apiVersion": "v1",
                "gracePeriodSeconds": grace_period_seconds,
            }
        try:
            self.request("DELETE", resource_path(kind, namespace, name), body)
        except KubeApiError as exc:
            if exc.status != 404:
                raise

    def wait_for(
        self, what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.25
    ) -> T:
        """Poll `probe` until it returns an object; TimeoutError names `what` otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            result = probe()
            if result is not None:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(interval)


def condition_true(obj: Mapping[str, Any], cond_type: str) -> bool:
    conditions = obj.get("status", {}).get("conditions") or []
    return any(c.get("type") == cond_type and c.get("status") == "True" for c in conditions)
