"""A small, synchronous Kubernetes API client over httpx: enough for the harness, the local pod
runner and the e2e tests, without the weight of a generated client.

Credentials and the kind -> path table are the control plane's own (kvfleet.kube.credentials,
kvfleet.kube.resources): any kubeconfig kubectl reads works here, exec plugins included. The
processes kvfleet ships (operator, router, webhook) share the async `kvfleet.kube.api.KubeApi`;
this one exists because the harness and the tests are synchronous.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Generator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx

from kvfleet.devcluster.errors import DevClusterError, KubeApiError
from kvfleet.kube.credentials import Credentials, CredentialsError
from kvfleet.kube.resources import UnknownKind, path_of

JsonObj = dict[str, Any]
T = TypeVar("T")


def connect(kubeconfig: Path, timeout: float = 30.0) -> KubeClient:
    """A client for the current context of `kubeconfig`."""
    try:
        return KubeClient(Credentials(kubeconfig), timeout)
    except CredentialsError as exc:
        raise DevClusterError(str(exc)) from exc


def resource_path(kind: str, namespace: str | None = None, name: str | None = None) -> str:
    try:
        return path_of(kind, namespace, name)
    except UnknownKind as exc:
        raise DevClusterError(str(exc)) from None


class KubeClient:
    """JSON requests to one API server; every non-2xx answer raises KubeApiError."""

    def __init__(self, credentials: Credentials, timeout: float = 30.0) -> None:
        self.credentials = credentials
        self._timeout = timeout
        self._http = self._connect()

    def _connect(self) -> httpx.Client:
        self._tls = self.credentials.tls_generation
        return httpx.Client(base_url=self.credentials.server, timeout=self._timeout,
                            verify=self.credentials.ssl_context(),
                            headers={"Accept": "application/json"})

    def _send(self, method: str, path: str, headers: Mapping[str, str] | None = None,
              **kwargs: Any) -> httpx.Response:
        """One request; a 401 reloads the credentials (a rotated token) and sends it again."""
        for attempt in (1, 2):
            if self._tls != self.credentials.tls_generation:  # a renewed client certificate
                self._http.close()
                self._http = self._connect()
            generation = self.credentials.generation
            resp = self._http.request(method, path,
                                      headers={**(headers or {}), **self.credentials.headers()},
                                      **kwargs)
            if resp.status_code != 401 or attempt == 2:
                break
            self.credentials.reload(generation)
        return resp

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
        resp = self._send(method, path, content=content, params=params, headers=headers)
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

    def watch(self, path: str, resource_version: str, timeout_s: int = 60
              ) -> Generator[JsonObj, None, None]:
        """The watch events of the collection at `path` from `resource_version` on, with
        bookmarks, until the server ends the watch (after `timeout_s`). A 410 (history
        compacted) comes as an ERROR event, as the API sends it: list again."""
        params = {"watch": "1", "resourceVersion": resource_version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_s)}
        with self._http.stream(
            "GET", path, params=params, headers=self.credentials.headers(),
            timeout=httpx.Timeout(self._timeout, read=timeout_s + self._timeout),
        ) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise KubeApiError("GET", path, resp.status_code, "", resp.text)
            for line in resp.iter_lines():
                if line:
                    yield json.loads(line)

    def get_raw(self, path: str) -> httpx.Response:
        return self._send("GET", path)

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
