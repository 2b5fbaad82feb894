"""One credential loader for every client (kvfleet.kube.credentials): kubeconfig shapes, the
in-cluster service account, exec plugins, tokens that rotate; and each of the three clients
(operator/router aiohttp, webhook httpx, dev-cluster httpx) sending a refused request again with
the rotated token."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import ssl
import stat
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from kubeconfig_fakes import write_kubeconfig

from kvfleet.devcluster.errors import DevClusterError, KubeApiError
from kvfleet.devcluster.kube import KubeClient, connect
from kvfleet.devcluster.pki import create_pki
from kvfleet.kube.api import KubeApi, login
from kvfleet.kube.credentials import Credentials, CredentialsError
from kvfleet.kube.resources import UnknownKind, api_version_of, path_of
from kvfleet.operator.handlers import connection_info
from kvfleet.webhooks.kube import ObjectReader


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _left_in_tmp() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("kvfleet-credentials-*"))


@pytest.fixture(autouse=True)
def _no_ambient_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_inline_ca_and_client_certificate_stay_in_memory(tmp_path: Path) -> None:
    pki = create_pki(tmp_path / "pki", "10.0.0.1")
    before = _left_in_tmp()
    creds = Credentials(write_kubeconfig(tmp_path / "kc", {
        "certificate-authority-data": _b64(pki.ca.cert)}, {
        "client-certificate-data": _b64(pki.admin.cert),
        "client-key-data": _b64(pki.admin.key)}))  # fmt: skip
    context = creds.ssl_context()
    assert creds.server == "https://127.0.0.1:6443" and creds.authorization() is None
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert [c["subject"] for c in context.get_ca_certs()] == [
        ((("commonName", "kvfleet-dev-ca"),),)]
    assert creds.tls.key == pki.admin.key.read_bytes()
    # The package wrote the inline data to files for ssl: none of them, nor their folder, is left.
    assert _left_in_tmp() == before
    info = connection_info(creds)
    assert info.certificate_data == pki.admin.cert.read_bytes() and info.token is None
    assert info.as_ssl_context().get_ca_certs() == context.get_ca_certs()


def test_relative_ca_file_token_and_the_kopf_view(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pki = create_pki(tmp_path, "10.0.0.1")
    path = write_kubeconfig(tmp_path / "kc", {"certificate-authority": "ca.crt"}, {"token": "t0k"})
    monkeypatch.setenv("KUBECONFIG", str(path))
    creds = Credentials()
    assert creds.source == f"kubeconfig {path}"
    assert creds.authorization() == "Bearer t0k"
    assert creds.tls.ca == pki.ca.cert.read_bytes()
    assert connection_info(creds).as_http_headers() == {"Authorization": "Bearer t0k"}


def test_basic_auth_and_insecure(tmp_path: Path) -> None:
    creds = Credentials(write_kubeconfig(tmp_path / "kc", {"insecure-skip-tls-verify": True},
                                    {"username": "admin", "password": "pw"}))
    assert creds.authorization() == "Basic " + base64.b64encode(b"admin:pw").decode()
    assert creds.ssl_context().verify_mode == ssl.CERT_NONE
    assert connection_info(creds).as_http_headers()["Authorization"] == creds.authorization()


def test_token_file_is_read_again_on_reload_once_per_generation(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first")
    creds = Credentials(write_kubeconfig(tmp_path / "kc", {}, {"tokenFile": str(token)}))
    assert creds.authorization() == "Bearer first"
    token.write_text("second")
    seen = creds.generation
    creds.reload(seen)
    assert creds.authorization() == "Bearer second"
    token.write_text("third")
    creds.reload(seen)  # a second request refused with the same old token: no second reload
    assert creds.authorization() == "Bearer second"
    assert creds.tls_generation == 1  # same TLS material: clients keep their connections


def test_exec_plugin_token_is_fetched_again_when_it_expires(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import json, pathlib, datetime\n"
        f"calls = pathlib.Path({str(calls)!r})\n"
        "n = len(calls.read_text()) if calls.exists() else 0\n"
        "calls.write_text('x' * (n + 1))\n"
        # The first token is already inside the 5-minute skew the package refreshes within.
        "expiry = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=1 if n == 0 "
        "else 60)\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': "
        "'ExecCredential', 'status': {'token': f'exec-{n}', 'expirationTimestamp': "
        "expiry.strftime('%Y-%m-%dT%H:%M:%SZ')}}))\n")
    creds = Credentials(write_kubeconfig(tmp_path / "kc", {}, {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable,
        "args": [str(plugin)], "interactiveMode": "Never"}}))  # fmt: skip
    assert creds.authorization() == "Bearer exec-1"  # the first expired at once: run again
    assert creds.authorization() == "Bearer exec-1"  # valid for an hour: not run again
    assert len(calls.read_text()) == 2


def test_in_cluster_service_account_token_rotation(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pki = create_pki(tmp_path / "pki", "10.0.0.1")
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "ca.crt").write_bytes(pki.ca.cert.read_bytes())
    (account / "token").write_text("sa-1")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    creds = Credentials(service_account=account)
    assert creds.server == "https://10.96.0.1:443"
    assert creds.source == f"service account {account}"
    assert creds.authorization() == "bearer sa-1"
    (account / "token").write_text("sa-2")  # the kubelet rotated it
    import kubernetes.config.incluster_config as incluster

    class Later(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Later:  # type: ignore[override]
            return datetime.now(tz) + timedelta(seconds=61)  # type: ignore[return-value]

    monkeypatch.setattr(incluster.datetime, "datetime", Later)
    assert creds.authorization() == "bearer sa-2"  # re-read each minute


def test_no_credentials_and_unreadable_ones_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CredentialsError, match=r"no credentials: run in a pod .* set KUBECONFIG"):
        Credentials()
    with pytest.raises(SystemExit, match="kvfleet router: no credentials"):
        login("kvfleet-router", "kvfleet router")
    broken = tmp_path / "broken"
    broken.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config",
                                      "current-context": "gone", "contexts": []}))
    with pytest.raises(CredentialsError, match=f"kubeconfig {broken}"):
        Credentials(broken)
    with pytest.raises(DevClusterError, match=str(tmp_path / "missing")):
        connect(tmp_path / "missing")


def test_one_table_of_resources() -> None:
    assert path_of("ServingPool", "ns", "a") == \
        "/apis/kvfleet.io/v1alpha1/namespaces/ns/servingpools/a"
    assert path_of("Pod") == "/api/v1/pods"  # across namespaces
    assert path_of("Node", "ignored", "n1") == "/api/v1/nodes/n1"  # cluster-scoped
    assert api_version_of("Deployment") == "apps/v1" and api_version_of("TenantQuota") == \
        "kvfleet.io/v1alpha1"
    with pytest.raises(UnknownKind, match=r"'Gadget' is not in kvfleet\.kube\.resources"):
        path_of("Gadget")


# --- the three clients against an apiserver that accepts only the current token -------------

class RotatingApiserver:
    """Accepts `Bearer <token file's content>` and answers a ServingPool; counts requests."""

    def __init__(self, token: Path) -> None:
        self.token = token
        self.seen: list[str] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != f"Bearer {self.token.read_text()}":
            return web.json_response({"kind": "Status", "code": 401,
                                      "message": "Unauthorized"}, status=401)
        return web.json_response({"kind": "ServingPool", "metadata": {"name": "a"}})


@contextlib.contextmanager
def _serving(handle: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Iterator[int]:
    """An HTTP server on its own thread answering every request with `handle`; its port."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture
def rotating(tmp_path: Path) -> Iterator[tuple[RotatingApiserver, Path]]:
    token = tmp_path / "token"
    token.write_text("old")
    server = RotatingApiserver(token)
    with _serving(server.handle) as port:
        # The client's own copy of the token (as a pod reads its projected token file).
        mine = tmp_path / "client-token"
        mine.write_text("old")
        yield server, write_kubeconfig(tmp_path / "kc", {}, {"tokenFile": str(mine)},
                                       server=f"http://127.0.0.1:{port}")


def _rotate(server: RotatingApiserver, kubeconfig: Path) -> None:
    """The old token is revoked at the apiserver; the client's token file has the new one."""
    server.token.write_text("new")
    (kubeconfig.parent / "client-token").write_text("new")


def test_operator_client_sends_a_refused_request_again_with_the_rotated_token(
        rotating: tuple[RotatingApiserver, Path]) -> None:
    server, kubeconfig = rotating

    creds = Credentials(kubeconfig)

    async def scenario() -> list[Any]:
        api = KubeApi(creds)
        try:
            first = await api.get("ServingPool", "ns", "a")
            _rotate(server, kubeconfig)
            # Several requests refused at once reload the credentials once.
            return [first, *await asyncio.gather(*(api.get("ServingPool", "ns", "a")
                                                  for _ in range(4)))]
        finally:
            await api.close()

    answers = asyncio.run(scenario())
    assert [a["kind"] for a in answers] == ["ServingPool"] * 5
    assert server.seen.count("Bearer new") == 4 and creds.generation == 2  # one reload


def test_webhook_reader_sends_a_refused_read_again_with_the_rotated_token(
        rotating: tuple[RotatingApiserver, Path]) -> None:
    server, kubeconfig = rotating

    async def scenario() -> tuple[Any, Any]:
        reader = ObjectReader(Credentials(kubeconfig))
        try:
            first = await reader.get("ServingPool", "ns", "a")
            _rotate(server, kubeconfig)
            return first, await reader.get("ServingPool", "ns", "a")
        finally:
            await reader.close()

    first, second = asyncio.run(scenario())
    assert first == second and server.seen == ["Bearer old", "Bearer old", "Bearer new"]


def test_dev_cluster_client_sends_a_refused_request_again_with_the_rotated_token(
        rotating: tuple[RotatingApiserver, Path]) -> None:
    server, kubeconfig = rotating
    client = KubeClient(Credentials(kubeconfig))
    try:
        assert client.get("ServingPool", "a", "ns")["kind"] == "ServingPool"
        _rotate(server, kubeconfig)
        assert client.get("ServingPool", "a", "ns")["kind"] == "ServingPool"
    finally:
        client.close()
    assert server.seen == ["Bearer old", "Bearer old", "Bearer new"]


def test_a_token_that_stays_refused_is_an_error_after_one_retry(
        rotating: tuple[RotatingApiserver, Path]) -> None:
    server, kubeconfig = rotating
    server.token.write_text("revoked-and-not-replaced")
    client = KubeClient(Credentials(kubeconfig))
    try:
        with pytest.raises(Exception, match="401"):
            client.get("ServingPool", "a", "ns")
    finally:
        client.close()
    assert len(server.seen) == 2


def test_the_private_folder_is_0700_and_gone_after(tmp_path: Path) -> None:
    from kvfleet.kube.credentials import private_folder

    with private_folder() as folder:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert not folder.exists()


def test_harness_client_watch_yields_events_across_chunks_and_raises_on_a_refusal(
        tmp_path: Path) -> None:
    """`KubeClient.watch` (the benchmarks' pool watch): lines cut anywhere between chunks,
    bookmarks passed on, and a watch the server refuses (410: list again) an error."""
    events = [{"type": "ADDED", "object": {"metadata": {"name": "a", "resourceVersion": "5"}}},
              {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "6"}}},
              {"type": "MODIFIED", "object": {"metadata": {"name": "a", "resourceVersion": "7"},
                                              "blob": "x" * 100_000}}]
    payload = b"".join(json.dumps(e).encode() + b"\n" for e in events)

    async def handle(request: web.Request) -> web.StreamResponse:
        assert request.query["watch"] == "1" and request.query["allowWatchBookmarks"] == "true"
        if request.query["resourceVersion"] == "1":
            return web.json_response({"kind": "Status", "code": 410, "reason": "Expired"},
                                     status=410)
        response = web.StreamResponse()
        await response.prepare(request)
        for start in range(0, len(payload), 4099):
            await response.write(payload[start:start + 4099])
        await response.write_eof()
        return response

    with _serving(handle) as port:
        kubeconfig = write_kubeconfig(tmp_path / "kc", {}, {"token": "t"},
                                      server=f"http://127.0.0.1:{port}")
        client = connect(kubeconfig)
        path = "/apis/kvfleet.io/v1alpha1/namespaces/ns/servingpools"
        assert list(client.watch(path, "4")) == events
        with pytest.raises(KubeApiError) as refused:
            list(client.watch(path, "1"))
        assert refused.value.status == 410
        client.close()
