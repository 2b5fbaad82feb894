"""HTTPS from the router to a real engine: the engine serves its pool's certificate (reloaded
when the files change), the router trusts exactly that certificate for the pool's name, and
neither plain HTTP nor a wrong certificate gets a prompt through."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from engine_server import EngineServer, free_port, running_kvfleet, running_server

from kvfleet.api.labels import engine_server_name
from kvfleet.pki import Usage, issue, make_ca, write_cert, write_cert_and_key

pytestmark = pytest.mark.slow

REVISION = "e" * 64
KEY = "sk-team-tls-0123456789abcdef"
TOKEN = "router-proof-tls-0123456789abcdef"
NAME = engine_server_name("smol", "llm")


@pytest.fixture(scope="module")
def certs() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvfleet-tls-") as tmp:
        folder = Path(tmp)
        ca = make_ca("engines of smol")
        write_cert_and_key(issue(ca, NAME, Usage.SERVER, hosts=[NAME]), folder / "tls.crt",
                           folder / "tls.key")
        write_cert(folder / "ca.crt", ca.cert)
        other = make_ca("someone else")
        write_cert(folder / "other.crt", issue(other, NAME, Usage.SERVER, hosts=[NAME]).cert)
        (folder / "token").write_text(TOKEN)
        yield folder


@pytest.fixture(scope="module")
def engine(certs: Path) -> Iterator[EngineServer]:
    with running_server("--kv-cache-memory-mib", "64", "--router-token-file",
                        str(certs / "token"), "--revision", REVISION[:12],
                        "--tls-cert-file", str(certs / "tls.crt"),
                        "--tls-key-file", str(certs / "tls.key"), torch_threads=1,
                        scheme="https") as server:
        yield server


def _router(engine: EngineServer, certs: Path, tls: dict[str, str] | None,
            tmp: Path) -> Any:
    pool: dict[str, Any] = {
        "name": "smol", "namespace": "llm",
        "status": {"servingRevision": REVISION,
                   "traffic": [{"revision": REVISION, "role": "stable", "weight": 100}]},
        "endpoints": {REVISION: [f"127.0.0.1:{engine.port}"]},
        "routerTokenFile": str(certs / "token")}
    if tls is not None:
        pool["tls"] = tls
    config = tmp / "router.yaml"
    config.write_text(yaml.safe_dump({"namespace": "llm", "pools": [pool], "tenants": [
        {"tenant": "team-tls", "keys": [KEY], "quota": {}}]}))
    port = free_port()
    return port, running_kvfleet("router", "--config", str(config), "--port", str(port),
                                 "--metrics-port", str(free_port()), port=port,
                                 ready_timeout=60)


def _chat(port: int) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                      headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "smol", "max_tokens": 3, "temperature": 0,
                            "messages": [{"role": "user", "content": "Say hi."}]})


@pytest.mark.parametrize("trust", ["tls.crt", "ca.crt"])  # pinned leaf, or its CA
def test_the_router_reaches_an_https_engine_that_shows_the_pools_certificate(
    engine: EngineServer, certs: Path, tmp_path: Path, trust: str,
) -> None:
    port, router = _router(engine, certs, {"caFile": str(certs / trust), "serverName": NAME},
                           tmp_path)
    with router:
        time.sleep(0.6)  # a first scrape of the engine's load, over HTTPS too
        answer = _chat(port)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 3
        streamed = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                              headers={"authorization": f"Bearer {KEY}"},
                              json={"model": "smol", "max_tokens": 3, "stream": True,
                                    "messages": [{"role": "user", "content": "Say hi."}]})
        assert streamed.status_code == 200 and "[DONE]" in streamed.text


@pytest.mark.parametrize("tls", [None, {"caFile": "other.crt", "serverName": NAME},
                                 {"caFile": "tls.crt", "serverName": "wrong.example"}])
def test_no_prompt_goes_out_in_the_clear_or_to_an_unproven_engine(
    engine: EngineServer, certs: Path, tmp_path: Path, tls: dict[str, str] | None,
) -> None:
    if tls is not None:
        tls = {**tls, "caFile": str(certs / tls["caFile"])}
    before = engine.metrics().get("kvfleet_engine_requests_total", 0.0)
    port, router = _router(engine, certs, tls, tmp_path)
    with router:
        answer = _chat(port)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "no_ready_replica"
    assert engine.metrics().get("kvfleet_engine_requests_total", 0.0) == before
