"""Reading the objects a decision depends on from the apiserver (GET only).

A small async client over httpx with the process's credentials (kvfleet.kube.credentials:
--kubeconfig, $KUBECONFIG or the in-cluster service account, tokens kept current): a 401
reloads them and the read is sent once more.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from kvfleet.kube.credentials import Credentials
from kvfleet.kube.resources import path_of
from kvfleet.webhooks.admission import FetchError


class ObjectReader:
    """GET kvfleet objects; None for 404, FetchError for anything else."""

    def __init__(self, credentials: Credentials, timeout_s: float = 3.0) -> None:
        self.credentials = credentials
        self._timeout_s = timeout_s
        self._client = self._connect()

    def _connect(self) -> httpx.AsyncClient:
        self._tls = self.credentials.tls_generation
        return httpx.AsyncClient(base_url=self.credentials.server,
                                 verify=self.credentials.ssl_context(), timeout=self._timeout_s)

    async def _get(self, url: str) -> httpx.Response:
        for attempt in (1, 2):
            if self._tls != self.credentials.tls_generation:  # a renewed client certificate
                await self._client.aclose()
                self._client = self._connect()
            generation = self.credentials.generation
            response = await self._client.get(url, headers=self.credentials.headers())
            if response.status_code != 401 or attempt == 2:
                break
            await asyncio.to_thread(self.credentials.reload, generation)  # a rotated token
        return response

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            response = await self._get(path_of(kind, namespace, name))
        except httpx.HTTPError as error:
            raise FetchError(f"reading {kind} {namespace}/{name}: {error}") from error
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise FetchError(
                f"reading {kind} {namespace}/{name}: HTTP {response.status_code} "
                f"{response.text[:200]}"
            )
        data: dict[str, Any] = response.json()
        return data

    async def close(self) -> None:
        await self._client.aclose()
