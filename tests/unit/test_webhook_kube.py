"""Reading kubeconfigs for the webhook's apiserver reads: inline data, files, tokens."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import httpx
import pytest
import yaml

import kvfleet.compat
import kvfleet.webhooks
from kvfleet.webhooks.certs import make_serving_certs
from kvfleet.webhooks.kube import PLURALS, ObjectReader, credentials, load_kubeconfig


def _kubeconfig(path: Path, cluster: dict[str, str], user: dict[str, str]) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443", **cluster}}],
        "users": [{"name": "u", "user": user}],
    }))  # fmt: skip
    return path


def test_inline_ca_and_client_certificate(tmp_path: Path) -> None:
    certs = make_serving_certs(tmp_path / "pki", ["127.0.0.1"])
    data = {
        "certificate-authority-data": base64.b64encode(certs.ca_cert.read_bytes()).decode(),
    }
    user = {
        "client-certificate-data": base64.b64encode(certs.cert.read_bytes()).decode(),
        "client-key-data": base64.b64encode(certs.key.read_bytes()).decode(),
    }
    creds = load_kubeconfig(_kubeconfig(tmp_path / "kc", data, user))
    assert creds.server == "https://127.0.0.1:6443" and creds.token is None
    assert creds.ssl_context.get_ca_certs()[0]["subject"] == (
        (("commonName", "kvfleet-webhook-ca"),),
    )


def test_relative_ca_file_and_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    certs = make_serving_certs(tmp_path, ["localhost"])
    path = _kubeconfig(tmp_path / "kc", {"certificate-authority": "ca.crt"}, {"token": "t0k"})
    monkeypatch.setenv("KUBECONFIG", str(path))
    creds = credentials(None)
    assert creds.token == "t0k"
    assert len(creds.ssl_context.get_ca_certs()) == 1
    assert certs.ca_cert.exists()


def test_unreachable_apiserver_is_a_fetch_error(tmp_path: Path) -> None:
    path = _kubeconfig(tmp_path / "kc", {}, {"token": "x"})
    creds = load_kubeconfig(path)
    creds = type(creds)("https://127.0.0.1:9", creds.ssl_context, creds.token)

    async def scenario() -> None:
        reader = ObjectReader(creds, timeout_s=1)
        try:
            await reader.get("ModelArtifact", "default", "x")
        finally:
            await reader.close()

    with pytest.raises(kvfleet.webhooks.FetchError, match="reading ModelArtifact default/x"):
        asyncio.run(scenario())


def test_not_found_is_none_and_errors_raise() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["Authorization"] == "Bearer x"
        if request.url.path.endswith("/servingpools/missing"):
            return httpx.Response(404, json={})
        if request.url.path.endswith("/servingpools/forbidden"):
            return httpx.Response(403, text="forbidden")
        return httpx.Response(200, json={"kind": "ServingPool"})

    async def scenario() -> tuple[object, object]:
        reader = ObjectReader.__new__(ObjectReader)
        reader._client = httpx.AsyncClient(
            base_url="https://api", transport=httpx.MockTransport(handler),
            headers={"Authorization": "Bearer x"},
        )  # fmt: skip
        try:
            missing = await reader.get("ServingPool", "ns", "missing")
            found = await reader.get("ServingPool", "ns", "there")
            with pytest.raises(kvfleet.webhooks.FetchError, match="HTTP 403 forbidden"):
                await reader.get("ServingPool", "ns", "forbidden")
            return missing, found
        finally:
            await reader.close()

    assert asyncio.run(scenario()) == (None, {"kind": "ServingPool"})
    assert PLURALS["TenantQuota"] == "tenantquotas"


@pytest.mark.parametrize("module", [kvfleet.webhooks, kvfleet.compat], ids=lambda m: m.__name__)
def test_public_surface_is_complete(module: object) -> None:
    for name in module.__all__:  # type: ignore[attr-defined]
        assert hasattr(module, name), name
