"""The control plane's async Kubernetes client (operator and router): the few verbs they need.

In the operator, kopf watches and keeps its own session; this client does the reads and writes
of a reconcile (server-side apply of owned objects, status patches, events) and the informers'
lists and watches. It is built from a `kopf.ConnectionInfo` (the one kopf logged in with, or
`kopf.login_via_*`'s for the router), so there is one source of credentials, and it counts every
request so the operator can report apiserver requests per reconcile.

KubeError            a request failed (status code, the server's message, the path)
"""

from __future__ import annotations

import base64
import codecs
import json
import os
import shutil
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

JsonObj = dict[str, Any]

# kind -> (API prefix, plural); the kinds the operator and the router read or write.
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Secret": ("/api/v1", "secrets"),
    "Service": ("/api/v1", "services"),
    "Pod": ("/api/v1", "pods"),
    "Event": ("/api/v1", "events"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "ServingPool": ("/apis/kvfleet.io/v1alpha1", "servingpools"),
    "ModelArtifact": ("/apis/kvfleet.io/v1alpha1", "modelartifacts"),
    "Rollout": ("/apis/kvfleet.io/v1alpha1", "rollouts"),
    "TenantQuota": ("/apis/kvfleet.io/v1alpha1", "tenantquotas"),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
}


class KubeError(RuntimeError):
    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status

    @property
    def gone(self) -> bool:
        """The object or its namespace is going away: there is nothing left to reconcile."""
        return self.status == 404 or (self.status == 403 and "being terminated" in str(self))

    @property
    def retryable(self) -> bool:
        return self.status in (409, 429) or self.status >= 500


def api_version_of(kind: str) -> str:
    """`apps/v1` for a Deployment, `v1` for a Service: what list items leave out."""
    prefix, _ = RESOURCES[kind]
    return prefix.removeprefix("/apis/").removeprefix("/api/")


def cluster_path_of(kind: str) -> str:
    """The collection of a namespaced kind across all namespaces."""
    prefix, plural = RESOURCES[kind]
    return f"{prefix}/{plural}"


def path_of(kind: str, namespace: str, name: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def _material(path: Any, data: Any, folder: Path, name: str) -> str | None:
    """A file path for PEM material given inline (base64) or as a path."""
    if path:
        return os.fsdecode(path)
    if not data:
        return None
    raw = data.encode() if isinstance(data, str) else data
    target = folder / name
    target.write_bytes(base64.b64decode(raw))
    target.chmod(0o600)
    return str(target)


@dataclass(frozen=True)
class Connection:
    """Where and how to reach the apiserver."""

    server: str
    ssl_context: ssl.SSLContext
    headers: dict[str, str]
    auth: aiohttp.BasicAuth | None = None


def connection_from_kopf(info: Any) -> Connection:
    """The `kopf.ConnectionInfo` kopf logged in with (certificate, token or basic auth)."""
    folder = Path(tempfile.mkdtemp(prefix="kvfleet-operator-"))
    try:
        context = _ssl_context(info, folder)
    finally:
        # The context holds the CA and key in memory: no copy of a key stays on disk.
        shutil.rmtree(folder, ignore_errors=True)
    headers = {"Accept": "application/json"}
    if info.token:
        headers["Authorization"] = f"Bearer {info.token}"
    auth = aiohttp.BasicAuth(info.username, info.password or "") if info.username else None
    return Connection(info.server.rstrip("/"), context, headers, auth)


def _ssl_context(info: Any, folder: Path) -> ssl.SSLContext:
    ca = _material(info.ca_path, info.ca_data, folder, "ca.crt")
    # With a cluster CA, trust only it (as kubectl does); without one, the system's.
    context = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
    cert = _material(info.certificate_path, info.certificate_data, folder, "client.crt")
    key = _material(info.private_key_path, info.private_key_data, folder, "client.key")
    if cert is not None:
        context.load_cert_chain(cert, key)
    if info.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def login(field_manager: str, who: str) -> KubeApi:
    """A client with kopf's credentials: the pod's service account, else $KUBECONFIG (or
    ~/.kube/config). Raises SystemExit naming `who` when there are none."""
    import kopf

    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
        settings=settings)
    if info is None:
        raise SystemExit(f"{who}: no credentials: run in a pod with a service account, or set "
                         "KUBECONFIG")
    return KubeApi(connection_from_kopf(info), field_manager=field_manager)


def _error(method: str, path: str, status: int, raw: bytes) -> KubeError:
    text = raw.decode(errors="replace")
    try:
        message = str(json.loads(text).get("message", text))
    except (ValueError, AttributeError):
        message = text
    return KubeError(method, path, status, message[:2000])


class KubeApi:
    """Typed verbs over one aiohttp session; `on_request(verb)` is called for every request.

    aiohttp rather than httpx: under a burst of hundreds of queued requests httpx's pool spent
    most of the operator's CPU re-scanning its connections (measured with bench/operator_scale).
    """

    def __init__(
        self,
        connection: Connection,
        on_request: Callable[[str], None] | None = None,
        *,
        field_manager: str = "kvfleet-operator",
        max_connections: int = 32,
        timeout_seconds: float = 30.0,
    ) -> None:
        self._field_manager = field_manager
        self._connection = connection
        self._on_request = on_request
        self._max_connections = max_connections
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Created on first use, inside the running loop (aiohttp requires it).
        if self._session is None:
            self._session = aiohttp.ClientSession(
                base_url=self._connection.server,
                headers=self._connection.headers,
                auth=self._connection.auth,
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(
                    ssl=self._connection.ssl_context, limit=self._max_connections
                ),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _send(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        missing_ok: bool = False,
    ) -> JsonObj | None:
        if self._on_request is not None:
            self._on_request(method)
        content = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type} if body is not None else None
        async with self._client().request(
            method, path, params=params, data=content, headers=headers
        ) as response:
            status, raw = response.status, await response.read()
        if status == 404 and missing_ok:
            return None
        if status >= 400:
            raise _error(method, path, status, raw)
        result: JsonObj = json.loads(raw) if raw else {}
        return result

    async def get(self, kind: str, namespace: str, name: str) -> JsonObj | None:
        return await self._send("GET", path_of(kind, namespace, name), missing_ok=True)

    async def list(self, kind: str, namespace: str, selector: str | None = None) -> list[JsonObj]:
        params = {"labelSelector": selector} if selector else None
        found = await self._send("GET", path_of(kind, namespace), params=params)
        items: list[JsonObj] = (found or {}).get("items", [])
        return items

    async def list_page(self, kind: str, params: dict[str, str],
                        namespace: str | None = None) -> JsonObj:
        """One page of a list, cluster-wide or in `namespace` (an informer's; not counted as
        a reconcile's)."""
        path = cluster_path_of(kind) if namespace is None else path_of(kind, namespace)
        async with self._client().get(path, params=params) as response:
            status, raw = response.status, await response.read()
        if status >= 400:
            raise _error("GET", path, status, raw)
        page: JsonObj = json.loads(raw)
        return page

    async def watch(self, kind: str, params: dict[str, str],
                    namespace: str | None = None) -> AsyncIterator[JsonObj]:
        """The events of a watch, cluster-wide or in `namespace`, one JSON object per line,
        until the server ends it (`timeoutSeconds`); no total timeout, but a silent connection
        is dropped."""
        path = cluster_path_of(kind) if namespace is None else path_of(kind, namespace)
        idle = float(params.get("timeoutSeconds", "300")) + 60
        timeout = aiohttp.ClientTimeout(total=None, sock_read=idle)
        async with self._client().get(path, params=params, timeout=timeout) as response:
            if response.status >= 400:
                raise _error("GET", path, response.status, await response.read())
            # Objects can be larger than aiohttp's line limit: split the chunks ourselves.
            decoder, pending = codecs.getincrementaldecoder("utf-8")(), ""
            async for chunk in response.content.iter_any():
                pending += decoder.decode(chunk)
                *lines, pending = pending.split("\n")
                for line in lines:
                    if line.strip():
                        event: JsonObj = json.loads(line)
                        yield event

    async def apply(self, obj: JsonObj) -> JsonObj:
        """Server-side apply: create or restore the fields the operator owns (force: the
        operator wins conflicts over its own fields, e.g. against `kubectl scale`)."""
        meta = obj["metadata"]
        result = await self._send(
            "PATCH",
            path_of(obj["kind"], meta["namespace"], meta["name"]),
            params={"fieldManager": self._field_manager, "force": "true"},
            body=obj,
            content_type="application/apply-patch+yaml",
        )
        return result or {}

    async def delete(self, kind: str, namespace: str, name: str, uid: str | None) -> None:
        body: JsonObj = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "propagationPolicy": "Background",
        }
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        await self._send("DELETE", path_of(kind, namespace, name), body=body, missing_ok=True)

    async def patch_status(self, kind: str, namespace: str, name: str, status: JsonObj) -> JsonObj:
        """Merge-patch the status subresource; the object as the apiserver stored it."""
        result = await self._send(
            "PATCH",
            path_of(kind, namespace, name) + "/status",
            body={"status": status},
            content_type="application/merge-patch+json",
        )
        return result or {}

    async def patch(self, kind: str, namespace: str, name: str, patch: JsonObj) -> JsonObj:
        """Merge-patch the object (e.g. an annotation); the object as stored."""
        result = await self._send("PATCH", path_of(kind, namespace, name), body=patch,
                                  content_type="application/merge-patch+json")
        return result or {}

    async def replace(self, path: str, obj: JsonObj) -> JsonObj:
        """PUT the whole object; its metadata.resourceVersion makes it conditional (409 when
        someone wrote in between)."""
        result = await self._send("PUT", path, body=obj)
        return result or {}

    async def create(self, obj: JsonObj) -> None:
        await self._send("POST", path_of(obj["kind"], obj["metadata"]["namespace"]), body=obj)
