"""A real redis-server on a free loopback port, for the shared quota ledger's tests; stopped
and started again at will (an outage), its data in memory only."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from engine_server import free_port


class RedisServer:
    def __init__(self, *options: str) -> None:
        self.options = options  # more redis-server options (`--requirepass`, ...)
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not installed (Debian: apt-get install redis-server)")
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="kvfleet-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir.name, *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        # (a server with a password answers NOAUTH: it is up too)
        while subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                             check=False).stdout.strip().split(b" ")[0] not in (b"PONG",
                                                                                b"NOAUTH"):
            assert time.monotonic() < deadline and self.process.poll() is None, \
                "redis-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


@contextmanager
def running_redis(*options: str) -> Iterator[RedisServer]:
    server = RedisServer(*options)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        server._dir.cleanup()
