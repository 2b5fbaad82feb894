"""The server process over a fake core: LOADING → READY, SIGTERM drain, exit 0.

Budget: ~10 s (one subprocess; no model).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvfleet.engine.runtime import in_own_thread

HERE = Path(__file__).parent
ROOT = HERE.parent.parent

_SERVER = """
import asyncio, sys, time
sys.path.insert(0, {here!r})
from server_fakes import FakeCore, chat_template, make_engine
from kvfleet.engine.request_log import configure_json_logging
from kvfleet.engine.runtime import LoadedEngine, RuntimeOptions, run_server

def load():
    time.sleep(1.0)  # long enough for the test to see LOADING
    engine, _ = make_engine(FakeCore(step_seconds=0.01))
    return LoadedEngine(engine, chat_template(), (1, 2, 3))

configure_json_logging()
sys.exit(asyncio.run(run_server(load, RuntimeOptions(port={port}, grace_seconds=0.5))))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_loading_ready_then_sigterm_drains_and_exits_zero() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER.format(here=str(HERE), port=port)], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        states: list[str] = []
        with httpx.Client(base_url=base, timeout=5) as client:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    health = client.get("/health")
                except httpx.TransportError:
                    time.sleep(0.02)
                    continue
                states.append(health.json()["state"])
                ready = client.get("/ready")
                if ready.status_code == 200:
                    break
                assert ready.json()["ready"] is False
                time.sleep(0.02)
            # Loading can finish between a poll's /health and its /ready: look once more.
            states.append(client.get("/health").json()["state"])
            assert states[0] == "LOADING" and states[-1] in ("WARMING", "READY")
            assert client.get("/ready").status_code == 200

            results: dict[str, list[dict[str, object]]] = {}

            def stream(name: str, max_tokens: int) -> None:
                body = {"prompt": "abc", "max_tokens": max_tokens, "stream": True}
                # One client per thread: httpx clients are not shared across threads.
                with httpx.Client(base_url=base, timeout=10) as own, \
                        own.stream("POST", "/v1/completions", json=body) as r:
                    results[name] = [json.loads(line[6:]) for line in r.iter_lines()
                                     if line.startswith("data: {")]

            threads = [threading.Thread(target=stream, args=("short", 20)),
                       threading.Thread(target=stream, args=("long", 1000 // 5))]
            for t in threads:
                t.start()
            for _ in range(500):  # both requests admitted before the signal
                metrics = client.get("/metrics").text
                if 'kvfleet_engine_requests_running{model="fake-model",' \
                   'revision="sha256:fake"} 2.0' in metrics:
                    break
                time.sleep(0.01)
            else:
                pytest.fail("the two streams were never both admitted")
            proc.send_signal(signal.SIGTERM)
            # Draining: readiness fails while the admitted streams are still being served.
            deadline = time.monotonic() + 5
            while client.get("/ready").status_code != 503:
                assert time.monotonic() < deadline, "/ready still answers 200 after SIGTERM"
                time.sleep(0.01)
            for t in threads:
                t.join(10)
        finals = {name: events[-1] for name, events in results.items()}
        assert finals["short"]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
        assert finals["long"]["choices"][0]["finish_reason"] == "cancelled"  # type: ignore[index]
        assert proc.wait(10) == 0
        logs = [json.loads(line) for line in proc.stderr.read().splitlines()  # type: ignore[union-attr]
                if line.startswith("{")]
        events = [line.get("event") for line in logs]
        assert "drain_start" in events and "drain_done" in events
        assert sum(1 for line in logs if line.get("event") == "request_finished") == 3
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        print("server stderr:\n" + (proc.stderr.read() if proc.stderr else ""))
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_loading_runs_on_a_thread_that_ends_with_it() -> None:
    """Not an executor thread that stays: a thread that ran torch's parallel regions keeps an
    OpenMP worker team while it lives, which slowed every later engine step (runtime.py)."""
    seen: list[threading.Thread] = []

    def load() -> str:
        seen.append(threading.current_thread())
        return "loaded"

    def broken() -> str:
        raise ValueError("corrupt GGUF")

    async def main() -> None:
        assert await in_own_thread(load, "kvfleet-load") == "loaded"
        with pytest.raises(ValueError, match="corrupt GGUF"):
            await in_own_thread(broken, "kvfleet-load")

    asyncio.run(main())
    (thread,) = seen
    assert thread is not threading.main_thread() and thread.name == "kvfleet-load"
    thread.join(5)
    assert not thread.is_alive()
