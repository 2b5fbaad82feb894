"""The webhook over real HTTPS with a generated CA: trusted via caBundle, refused without it."""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfleet.api.builders import make_artifact, make_pool
from kvfleet.compat import default_matrix
from kvfleet.tls import ServingCertificate, server_ssl_context
from kvfleet.webhooks.certs import make_serving_certs
from kvfleet.webhooks.server import make_app, start

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _artifacts(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    return make_artifact().obj().to_wire() if kind == "ModelArtifact" else None


def _body(pool: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u1",
            "kind": {"kind": "ServingPool"},
            "namespace": "default",
            "operation": "CREATE",
            "object": pool,
        },
    }


def test_https_review_with_real_certificate(tmp_path: Path) -> None:
    certs = make_serving_certs(tmp_path, ["127.0.0.1", "localhost"])
    port = _free_port()

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], str]:
        app = make_app(fetch=_artifacts, matrix=default_matrix())
        runner = await start(app, "127.0.0.1", port, server_ssl_context(certs.cert, certs.key))
        try:
            trusted = ssl.create_default_context(cafile=str(certs.ca_cert))
            async with httpx.AsyncClient(verify=trusted) as client:
                url = f"https://127.0.0.1:{port}/validate"
                ok = (await client.post(url, json=_body(make_pool().data()))).json()
                bad_pool = make_pool().set("spec.gpu.memory", "16Gi").data()
                denied = (await client.post(url, json=_body(bad_pool))).json()
            async with httpx.AsyncClient() as untrusting:  # system CAs only
                try:
                    await untrusting.get(f"https://127.0.0.1:{port}/healthz")
                    verdict = "accepted"
                except httpx.ConnectError as error:
                    verdict = str(error)
            return ok, denied, verdict
        finally:
            await runner.cleanup()

    ok, denied, verdict = asyncio.run(scenario())
    assert ok["response"]["allowed"] is True
    assert denied["response"]["allowed"] is False
    assert (
        "spec.gpu: ModelArtifact qwen3-8b does not fit" in denied["response"]["status"]["message"]
    )
    assert "CERTIFICATE_VERIFY_FAILED" in verdict


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path: Path) -> None:
    """cert-manager renews the Secret, the kubelet swaps the files: the next connection gets
    the new certificate (trusted by the new CA only); a half-written pair is not loaded."""
    old = make_serving_certs(tmp_path / "old", ["127.0.0.1"])
    new = make_serving_certs(tmp_path / "new", ["127.0.0.1"])
    served = tmp_path / "served"
    served.mkdir()
    cert, key = served / "tls.crt", served / "tls.key"
    cert.write_bytes(old.cert.read_bytes())
    key.write_bytes(old.key.read_bytes())
    port = _free_port()

    async def healthz(ca: Path) -> str:
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(ca))) as c:
            try:
                return (await c.get(f"https://127.0.0.1:{port}/healthz")).text.split()[0]
            except httpx.ConnectError as error:
                return "CERTIFICATE_VERIFY_FAILED" if "CERTIFICATE_VERIFY_FAILED" in str(
                    error) else str(error)

    async def scenario() -> list[str]:
        certificate = ServingCertificate(cert, key)
        app = make_app(fetch=_artifacts, matrix=default_matrix())
        runner = await start(app, "127.0.0.1", port, certificate.context)
        seen = []
        try:
            seen.append(await healthz(old.ca_cert))
            assert certificate.reload_if_changed() is False  # nothing changed
            cert.write_bytes(new.cert.read_bytes())  # the key not yet: a pair mid-write
            assert certificate.reload_if_changed() is False
            seen.append(await healthz(old.ca_cert))  # the old pair serves meanwhile
            key.write_bytes(new.key.read_bytes())
            assert certificate.reload_if_changed() is True
            seen.append(await healthz(new.ca_cert))
            seen.append(await healthz(old.ca_cert))
        finally:
            await runner.cleanup()
        return seen

    assert asyncio.run(scenario()) == ["ok", "ok", "ok", "CERTIFICATE_VERIFY_FAILED"]
