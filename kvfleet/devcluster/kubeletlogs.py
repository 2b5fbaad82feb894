"""The local pod runner's kubelet log endpoint, so `kubectl logs` works on local pods.

`kubectl logs` asks the apiserver, which asks the node's kubelet: HTTPS to the node's address
(the apiserver runs with `--kubelet-preferred-address-types=InternalIP`, 127.0.0.1 for local
nodes) on `status.daemonEndpoints.kubeletEndpoint.Port`, path
`/containerLogs/<namespace>/<pod>/<container>`. This server answers that path from the
container's log file, with `tailLines`, `limitBytes` and `follow`. It listens on loopback only
and, like a kubelet the apiserver is not configured to verify, serves a self-signed
certificate made at start (kept in the runner's folder, 0600).
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from kvfleet.pki import Usage, issue, make_ca, write_cert_and_key

log = logging.getLogger(__name__)

LogPath = Callable[[str, str, str], Path]  # (namespace, pod, container) -> its log file
FOLLOW_POLL_SECONDS = 0.2


def _tail(data: bytes, lines: int) -> bytes:
    if lines <= 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


class KubeletLogServer:
    """`GET /containerLogs/{namespace}/{pod}/{container}` over HTTPS on 127.0.0.1."""

    def __init__(self, folder: Path, log_path: LogPath, alive: Callable[[str, str], bool]
                 ) -> None:
        ca = make_ca("kvfleet-local-kubelet", days=30)
        cert, key = folder / "kubelet.crt", folder / "kubelet.key"
        folder.mkdir(parents=True, exist_ok=True)
        write_cert_and_key(issue(ca, "kvfleet-local-kubelet", Usage.SERVER, hosts=["127.0.0.1"],
                                 days=30), cert, key)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server._answer(self)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("kubelet logs: " + format, *args)

        self._log_path, self._alive = log_path, alive
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="local-kubelet-logs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def _answer(self, request: BaseHTTPRequestHandler) -> None:
        url = urlsplit(request.path)
        parts = url.path.strip("/").split("/")
        if len(parts) != 4 or parts[0] != "containerLogs":
            request.send_error(404, "only /containerLogs/<namespace>/<pod>/<container>")
            return
        namespace, pod, container = parts[1:]
        path = self._log_path(namespace, pod, container)
        if not path.exists():
            request.send_error(404, f"no log for container {container} of pod {namespace}/{pod}")
            return
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        data = path.read_bytes()
        if "tailLines" in query:
            data = _tail(data, int(query["tailLines"]))
        if "limitBytes" in query:
            data = data[:int(query["limitBytes"])]
        follow = query.get("follow") == "true"
        request.send_response(200)
        request.send_header("Content-Type", "text/plain")
        if not follow:
            request.send_header("Content-Length", str(len(data)))
            request.end_headers()
            request.wfile.write(data)
            return
        request.end_headers()
        try:
            request.wfile.write(data)
            request.wfile.flush()
            offset = path.stat().st_size
            while self._alive(namespace, pod):  # until the pod goes or the client leaves
                time.sleep(FOLLOW_POLL_SECONDS)
                with path.open("rb") as stream:
                    stream.seek(offset)
                    more = stream.read()
                if more:
                    offset += len(more)
                    request.wfile.write(more)
                    request.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            pass
