"""One active operator among replicas: `kvfleet operator --leader-elect`.

Before kopf starts, the process waits to hold the Lease (`kvfleet.kube.lease`), answering its
liveness endpoint meanwhile so the kubelet does not restart a healthy standby. While it leads,
a thread renews the Lease; when leadership cannot be vouched for, the process exits at once
(status 1) and its Deployment starts it again as a standby: exiting is the one way to be sure
no reconcile of the old leader overlaps the new one's. A clean stop releases the Lease.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from kvfleet.kube.api import login
from kvfleet.kube.lease import LeaderElector
from kvfleet.operator import naming

log = logging.getLogger(__name__)

LEASE_NAME = "kvfleet-operator"
LOST_EXIT_CODE = 1


def identity() -> str:
    """The pod's name where the Downward API gives it, else host and pid."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


class _Alive(BaseHTTPRequestHandler):
    path_ok = "/healthz"

    def do_GET(self) -> None:
        ok = urlsplit(self.path).path == self.path_ok
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(b"standing by for the leader lease\n" if ok else b"")

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def _standby_liveness(endpoint: str | None) -> Iterator[None]:
    """kopf's liveness endpoint is served only once kopf runs; answer it until then."""
    if not endpoint:
        yield
        return
    url = urlsplit(endpoint)
    handler = type("Alive", (_Alive,), {"path_ok": url.path or "/"})
    server = ThreadingHTTPServer((url.hostname or "0.0.0.0", url.port or 80), handler)
    thread = threading.Thread(target=server.serve_forever, name="standby-liveness",
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


class Leadership:
    """The Lease held from a thread of its own (kopf owns the main thread's event loop)."""

    def __init__(self, namespace: str, name: str = LEASE_NAME, *,
                 duration_seconds: int = 15, renew_seconds: float = 5) -> None:
        self.namespace, self.name = namespace, name
        self.duration_seconds, self.renew_seconds = duration_seconds, renew_seconds
        self.identity = identity()
        self._leading = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="leader-lease", daemon=True)
        self._failure: BaseException | None = None

    def acquire(self, liveness: str | None) -> None:
        """Block until this process leads."""
        with _standby_liveness(liveness):
            self._thread.start()
            while not self._leading.wait(1):
                if not self._thread.is_alive():
                    raise SystemExit(f"kvfleet operator: leader election stopped: "
                                     f"{self._failure}")

    def release(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by acquire(), or fatal while leading
            self._failure = exc
            if self._leading.is_set():
                self._lost(f"leader election failed: {exc}")

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        api = login(naming.FIELD_MANAGER, "kvfleet operator")
        elector = LeaderElector(api, self.namespace, self.name, self.identity,
                                duration_seconds=self.duration_seconds,
                                renew_seconds=self.renew_seconds)
        try:
            await elector.acquire()
            self._leading.set()
            holding = asyncio.create_task(elector.hold(self._lost))
            stopping = asyncio.create_task(self._stop.wait())
            await asyncio.wait({holding, stopping}, return_when=asyncio.FIRST_COMPLETED)
            holding.cancel()
            await elector.release()
        finally:
            await api.close()

    def _lost(self, reason: str) -> None:
        log.error("%s: leadership lost (%s); exiting so that only the new leader reconciles",
                  self.identity, reason)
        logging.shutdown()
        os._exit(LOST_EXIT_CODE)
