"""Start a real `kvfleet serve` process (real SmolLM2 engine) for integration tests.

`running_server(*flags)` picks a free loopback port, waits for `/ready` (the model loads and
warms up), and always stops the process: SIGTERM, then SIGKILL if it does not exit in time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class EngineServer:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    def log_lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def metrics(self) -> dict[str, float]:
        """Unlabelled-sum view of /metrics: sample name -> value summed over label sets."""
        text = httpx.get(self.base_url + "/metrics", timeout=10, verify=False).text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["kvfleet_engine_requests_running"] == 0
                    and m["kvfleet_engine_requests_waiting"] == 0
                    and m["kvfleet_engine_kv_cache_usage_ratio"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


@contextmanager
def running_kvfleet(*argv: str, port: int, ready_timeout: float = 180.0,
                    env: dict[str, str] | None = None, scheme: str = "http"
                    ) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """`kvfleet <argv>` as a process until its /ready answers 200 on `port`; always stopped
    (SIGTERM, then SIGKILL). Yields the process and its log file."""
    with tempfile.TemporaryDirectory(prefix=f"kvfleet-{argv[0]}-") as tmp:
        log_path = Path(tmp) / f"{argv[0]}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "kvfleet", *argv], cwd=ROOT, stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})

        def tail() -> str:
            return "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])

        try:
            deadline = time.monotonic() + ready_timeout
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"kvfleet {argv[0]} exited with {process.returncode}:\n"
                                       + tail())
                try:
                    url = f"{scheme}://127.0.0.1:{port}/ready"
                    if httpx.get(url, timeout=2, verify=False).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvfleet {argv[0]} not ready in time:\n" + tail())
                time.sleep(0.2)
            yield process, log_path
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)


@contextmanager
def running_server(*flags: str, ready_timeout: float = 180.0,
                   torch_threads: int = 2, scheme: str = "http") -> Iterator[EngineServer]:
    port = free_port()
    with running_kvfleet("serve", "--port", str(port), *flags, port=port,
                         ready_timeout=ready_timeout, scheme=scheme,
                         env={"OMP_NUM_THREADS": str(torch_threads)}) as (process, log_path):
        yield EngineServer(f"{scheme}://127.0.0.1:{port}", process, log_path)
