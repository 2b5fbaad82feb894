"""Reading the objects a decision depends on from the apiserver (GET only).

A small async client over httpx: the current context of a kubeconfig (CA and client
certificate as files or inline data, or a bearer token) or the in-cluster service account.
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvfleet.api import GROUP, KINDS, VERSION
from kvfleet.webhooks.admission import FetchError

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
PLURALS = {kind: cls.crd.plural for kind, cls in KINDS.items()}


@dataclass(frozen=True)
class Credentials:
    server: str
    ssl_context: ssl.SSLContext
    token: str | None = None


def _material(entry: dict[str, Any], key: str, base: Path) -> bytes | None:
    """`key-data` (base64) or the file `key` names, relative to the kubeconfig."""
    if entry.get(f"{key}-data"):
        return base64.b64decode(str(entry[f"{key}-data"]))
    if entry.get(key):
        return (base / str(entry[key])).read_bytes()
    return None


def load_kubeconfig(path: Path) -> Credentials:
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    current = config.get("current-context")
    context = next(c["context"] for c in config["contexts"] if c["name"] == current)
    cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
    user: dict[str, Any] = next(
        (u["user"] for u in config.get("users", []) if u["name"] == context.get("user")), {}
    )
    base = path.parent
    ca = _material(cluster, "certificate-authority", base)
    # A kubeconfig CA replaces the system trust store, as in kubectl: the cluster CA only.
    ctx = ssl.create_default_context(cadata=ca.decode()) if ca else ssl.create_default_context()
    cert = _material(user, "client-certificate", base)
    key = _material(user, "client-key", base)
    if cert is not None and key is not None:
        # ssl loads a certificate chain only from files: a private temp dir, removed at once.
        with tempfile.TemporaryDirectory() as tmp:
            cert_path, key_path = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
            cert_path.write_bytes(cert)
            key_path.touch(mode=0o600)
            key_path.write_bytes(key)
            ctx.load_cert_chain(cert_path, key_path)
    return Credentials(cluster["server"], ctx, user.get("token"))


def in_cluster() -> Credentials:
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    ctx = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
    token = (SERVICE_ACCOUNT / "token").read_text().strip()
    return Credentials(f"https://{host}:{port}", ctx, token)


def credentials(kubeconfig: Path | None) -> Credentials:
    """Explicit kubeconfig, else $KUBECONFIG, else in-cluster."""
    if kubeconfig is None and os.environ.get("KUBECONFIG"):
        kubeconfig = Path(os.environ["KUBECONFIG"].split(os.pathsep)[0])
    return load_kubeconfig(kubeconfig) if kubeconfig is not None else in_cluster()


class ObjectReader:
    """GET kvfleet objects; None for 404, FetchError for anything else."""

    def __init__(self, creds: Credentials, timeout_s: float = 3.0) -> None:
        headers = {"Authorization": f"Bearer {creds.token}"} if creds.token else {}
        self._client = httpx.AsyncClient(
            base_url=creds.server, verify=creds.ssl_context, headers=headers, timeout=timeout_s
        )

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        url = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURALS[kind]}/{name}"
        try:
            response = await self._client.get(url)
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
