"""The control plane's async Kubernetes client (operator and router): the few verbs they need.

In the operator, kopf watches and keeps its own session; this client does the reads and writes
of a reconcile (server-side apply of owned objects, status patches, events) and the informers'
lists and watches. Both take their credentials from one `Credentials` (kvfleet.kube.credentials:
the `kubernetes` package's loaders, tokens kept current), and this client counts every request
so the operator can report apiserver requests per reconcile.

KubeError            a request failed (status code, the server's message, the path)
"""

from __future__ import annotations

import asyncio
import codecs
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from kvfleet.kube.credentials import Credentials, CredentialsError
from kvfleet.kube.resources import api_version_of, path_of

__all__ = ["JsonObj", "KubeApi", "KubeError", "api_version_of", "login", "path_of"]

JsonObj = dict[str, Any]


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


def login(field_manager: str, who: str) -> KubeApi:
    """A client with the process's credentials (kvfleet.kube.credentials: $KUBECONFIG, the
    pod's service account, ~/.kube/config). Raises SystemExit naming `who` when there are
    none or they cannot be read."""
    try:
        credentials = Credentials()
    except CredentialsError as error:
        raise SystemExit(f"{who}: {error}") from None
    return KubeApi(credentials, field_manager=field_manager)


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
        credentials: Credentials,
        on_request: Callable[[str], None] | None = None,
        *,
        field_manager: str = "kvfleet-operator",
        max_connections: int = 32,
        timeout_seconds: float = 30.0,
    ) -> None:
        self._field_manager = field_manager
        self.credentials = credentials
        self._on_request = on_request
        self._max_connections = max_connections
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._session: aiohttp.ClientSession | None = None
        self._session_tls = -1
        self._retired: list[aiohttp.ClientSession] = []

    def _client(self) -> aiohttp.ClientSession:
        # Created on first use, inside the running loop (aiohttp requires it), and again when
        # the TLS material changed (a renewed client certificate). The old session may still
        # carry a watch: it is closed with this client, not now.
        if self._session is None or self._session_tls != self.credentials.tls_generation:
            if self._session is not None:
                self._retired.append(self._session)
            self._session_tls = self.credentials.tls_generation
            self._session = aiohttp.ClientSession(
                base_url=self.credentials.server,
                headers={"Accept": "application/json"},
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(
                    ssl=self.credentials.ssl_context(), limit=self._max_connections
                ),
            )
        return self._session

    async def close(self) -> None:
        for session in [*self._retired, *([self._session] if self._session else [])]:
            await session.close()
        self._retired, self._session = [], None

    async def _open(self, method: str, path: str, *, params: dict[str, str] | None = None,
                    data: bytes | None = None, headers: dict[str, str] | None = None,
                    timeout: aiohttp.ClientTimeout | None = None) -> aiohttp.ClientResponse:
        """The response (the caller releases it). A 401 reloads the credentials (a rotated
        token) and the request is sent once more."""
        for attempt in (1, 2):
            generation = self.credentials.generation
            sent = {**(headers or {}), **self.credentials.headers()}
            extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
            response = await self._client().request(
                method, path, params=params, data=data, headers=sent, **extra)
            if response.status != 401 or attempt == 2:
                return response
            response.release()
            # Off the loop: reloading may run an exec credential plugin.
            await asyncio.to_thread(self.credentials.reload, generation)
        raise AssertionError("unreachable")

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
        async with await self._open(method, path, params=params, data=content,
                                    headers=headers) as response:
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
        path = path_of(kind, namespace)
        async with await self._open("GET", path, params=params) as response:
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
        path = path_of(kind, namespace)
        idle = float(params.get("timeoutSeconds", "300")) + 60
        timeout = aiohttp.ClientTimeout(total=None, sock_read=idle)
        async with await self._open("GET", path, params=params, timeout=timeout) as response:
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
