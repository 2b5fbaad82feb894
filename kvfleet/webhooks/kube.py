"""Reading the objects a decision depends on from the apiserver (GET and list only).

The control plane's one async client (`kvfleet.kube.api.KubeApi`: the process's credentials
from kvfleet.kube.credentials, a 401 reloads them and the read is sent once more), with a short
timeout: the apiserver waits at most the webhook's own `timeoutSeconds` for an answer.
"""

from __future__ import annotations

import aiohttp

from kvfleet.kube.api import JsonObj, KubeApi, KubeError
from kvfleet.kube.credentials import Credentials
from kvfleet.webhooks.admission import FetchError


class ObjectReader:
    """GET and list kvfleet objects; None for 404, FetchError (naming the object) for anything
    else."""

    def __init__(self, credentials: Credentials, timeout_s: float = 3.0) -> None:
        self.api = KubeApi(credentials, field_manager="kvfleet-webhook",
                           max_connections=8, timeout_seconds=timeout_s)

    async def get(self, kind: str, namespace: str, name: str) -> JsonObj | None:
        try:
            return await self.api.get(kind, namespace, name)
        except KubeError as error:
            raise FetchError(f"reading {kind} {namespace}/{name}: {error}") from error
        except (aiohttp.ClientError, TimeoutError) as error:
            raise FetchError(f"reading {kind} {namespace}/{name}: "
                             f"{type(error).__name__}: {error}") from error

    async def list(self, kind: str, namespace: str | None) -> list[JsonObj]:
        """Every `kind` in `namespace` (None: in every namespace)."""
        where = f"{kind} in {namespace or 'every namespace'}"
        try:
            return await self.api.list(kind, namespace or "")  # "": across namespaces
        except KubeError as error:
            raise FetchError(f"listing {where}: {error}") from error
        except (aiohttp.ClientError, TimeoutError) as error:
            raise FetchError(f"listing {where}: {type(error).__name__}: {error}") from error

    async def close(self) -> None:
        await self.api.close()
