"""The webhook's apiserver reads: 404 is None, anything else a FetchError naming the object.
(Its credentials are the shared loader's: tests/unit/test_kube_credentials.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp_fakes import serving
from kubeconfig_fakes import write_kubeconfig

import kvfleet.compat
import kvfleet.webhooks
from kvfleet.kube.credentials import Credentials
from kvfleet.webhooks.kube import ObjectReader


def test_unreachable_apiserver_is_a_fetch_error(tmp_path: Path) -> None:
    creds = Credentials(write_kubeconfig(tmp_path / "kc", {}, {"token": "x"},
                                         server="https://127.0.0.1:9"))

    async def scenario() -> None:
        reader = ObjectReader(creds, timeout_s=1)
        try:
            await reader.get("ModelArtifact", "default", "x")
        finally:
            await reader.close()

    with pytest.raises(kvfleet.webhooks.FetchError, match="reading ModelArtifact default/x"):
        asyncio.run(scenario())


def test_not_found_is_none_and_errors_raise(tmp_path: Path) -> None:
    async def handle(request: web.Request) -> web.StreamResponse:
        assert request.headers["Authorization"] == "Bearer x"
        if request.path.endswith("/servingpools/missing"):
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        if request.path.endswith("/servingpools/forbidden"):
            return web.json_response({"kind": "Status", "message": "forbidden"}, status=403)
        return web.json_response({"kind": "ServingPool"})

    async def scenario() -> tuple[object, object]:
        app = web.Application()
        app.router.add_get("/{tail:.*}", handle)
        async with serving(app) as port:
            reader = ObjectReader(Credentials(write_kubeconfig(
                tmp_path / "kc", {}, {"token": "x"}, server=f"http://127.0.0.1:{port}")))
            try:
                missing = await reader.get("ServingPool", "ns", "missing")
                found = await reader.get("ServingPool", "ns", "there")
                with pytest.raises(kvfleet.webhooks.FetchError, match=r"reading ServingPool "
                                   r"ns/forbidden: .*HTTP 403: forbidden"):
                    await reader.get("ServingPool", "ns", "forbidden")
                return missing, found
            finally:
                await reader.close()

    assert asyncio.run(scenario()) == (None, {"kind": "ServingPool"})


@pytest.mark.parametrize("module", [kvfleet.webhooks, kvfleet.compat], ids=lambda m: m.__name__)
def test_public_surface_is_complete(module: object) -> None:
    for name in module.__all__:  # type: ignore[attr-defined]
        assert hasattr(module, name), name
