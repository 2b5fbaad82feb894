"""A real Prometheus server scrapes a real engine; PromQL gives TTFT p95; promtool accepts
the exposition.

Needs the `prometheus` and `promtool` binaries (Debian package `prometheus`, or
$KVFLEET_PROMETHEUS / $KVFLEET_PROMTOOL). Budget: ~60 s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from bisect import bisect_left
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from engine_server import EngineServer, free_port, running_server

from kvfleet.devcluster import toolchain
from kvfleet.engine.metrics import LATENCY_BUCKETS

pytestmark = [pytest.mark.slow, pytest.mark.tools, pytest.mark.timeout(300)]

TTFT_P95 = ("histogram_quantile(0.95, sum by (le) "
            "(rate(kvfleet_engine_time_to_first_token_seconds_bucket[1m])))")


def binary(name: str) -> str:
    """`$KVFLEET_<NAME>`, else the harness's pinned build (e2e/tools/build.sh), else PATH.

    Debian's package is only a fallback: its prometheus lacks kubernetes_sd_configs, which the
    e2e tier needs, so the suite builds and pins its own prometheus and promtool.
    """
    path = os.environ.get(f"KVFLEET_{name.upper()}")
    if path is None:
        try:
            path = str(toolchain.locate()[name])
        except toolchain.ToolsMissingError:
            path = shutil.which(name)
    if path is None:
        message = (f"{name} not found: run e2e/tools/build.sh (or apt-get install -y "
                   f"prometheus, or set KVFLEET_{name.upper()})")
        if os.environ.get("KVFLEET_E2E_REQUIRED") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineServer]:
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def prometheus(engine: EngineServer) -> Iterator[str]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvfleet-prom-") as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: kvfleet-engine\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{engine.port}']}}]\n")
        with (Path(tmp) / "prometheus.log").open("wb") as log:
            proc = subprocess.Popen(
                [binary("prometheus"), f"--config.file={config}",
                 f"--storage.tsdb.path={tmp}/data", f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while not up(url):
                assert proc.poll() is None, (Path(tmp) / "prometheus.log").read_text()
                assert time.monotonic() < deadline, "Prometheus never scraped the engine"
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def query(url: str, promql: str) -> list[dict[str, object]]:
    try:
        r = httpx.get(url + "/api/v1/query", params={"query": promql}, timeout=10)
    except httpx.TransportError:
        return []
    result: list[dict[str, object]] = r.json()["data"]["result"]
    return result


def up(url: str) -> bool:
    return any(s["value"][1] == "1" for s in query(url, 'up{job="kvfleet-engine"}')  # type: ignore[index]
               )


def test_prometheus_scrapes_the_engine_and_computes_ttft_p95(engine: EngineServer,
                                                            prometheus: str) -> None:
    client_ttfts = []
    for i in range(8):
        started = time.monotonic()
        with httpx.stream("POST", engine.base_url + "/v1/completions", timeout=60, json={
                "prompt": f"Fact number {i}:", "max_tokens": 4, "stream": True}) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    client_ttfts.append(time.monotonic() - started)
                    break
            for _ in lines:  # read to the end of the stream
                pass
    deadline = time.monotonic() + 30
    while True:
        result = query(prometheus, TTFT_P95)
        value = float(result[0]["value"][1]) if result else float("nan")  # type: ignore[index]
        if value > 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert value > 0, f"no TTFT p95 from PromQL: {result}"
    # The server-side TTFT is at most what the client saw; the histogram estimate cannot
    # exceed the upper edge of the bucket holding the largest observation.
    upper = LATENCY_BUCKETS[min(bisect_left(LATENCY_BUCKETS, max(client_ttfts)),
                                len(LATENCY_BUCKETS) - 1)]
    assert value <= upper
    series = query(prometheus, "kvfleet_engine_requests_total")
    assert series
    for s in series:
        labels = s["metric"]
        assert isinstance(labels, dict)
        assert set(labels) <= {"__name__", "instance", "job", "model", "revision",
                               "finish_reason"}


def test_promtool_accepts_the_exposition(engine: EngineServer) -> None:
    exposition = httpx.get(engine.base_url + "/metrics", timeout=10).content
    check = subprocess.run([binary("promtool"), "check", "metrics"], input=exposition,
                           capture_output=True, timeout=60)
    output = check.stdout.decode() + check.stderr.decode()
    # The vllm:* gauges carry the names an InferencePool's endpoint picker reads; promtool's
    # style lint objects to their ':' (exit 3, lint findings only), and to nothing else.
    problems = [line for line in output.splitlines() if line.strip() and not (
        line.startswith("vllm:") and "should not contain ':'" in line)]
    assert check.returncode in (0, 3) and not problems, output
