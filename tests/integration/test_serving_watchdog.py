"""The engine watchdog on a real `kvfleet serve`: its engine thread hangs mid-request (the
`stall_after` fault: as a stuck kernel or a deadlock would), and within `--stall-seconds` the
client's stream ends with finish_reason error instead of waiting for ever, /health and /ready
answer 503 with the reason (the kubelet's liveness probe restarts such a pod; routers stop
sending to a pod that is not Ready), and a new request is refused."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from engine_server import free_port, running_kvfleet

from kvfleet.engine.faults import FAULTS_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REVISION = "d" * 64


def test_a_hung_engine_thread_fails_the_probes_and_ends_the_stream_with_an_error() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_kvfleet("serve", "--port", str(port), "--revision", REVISION,
                         "--stall-seconds", "2", port=port,
                         env={FAULTS_ENV: f"{REVISION[:12]}:stall_after=5",
                              "OMP_NUM_THREADS": "2"}):
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        started = time.monotonic()
        events = []
        # A plain completion that ignores EOS, so nothing but the hang can end it within the
        # 5 steps: a chat answer can end early (a CI run once saw the chat form of this stream
        # end with finish_reason stop after one content chunk, cause not found).
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "max_tokens": 200, "stream": True, "ignore_eos": True,
                "prompt": "Count to fifty: 1, 2, 3,"}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        waited = time.monotonic() - started
        assert waited < 20, f"the stream hung for {waited:.0f} s"
        reasons = [c.get("finish_reason") for e in events for c in e.get("choices", [])]
        assert "error" in reasons, events[-2:]  # the engine's error end, as for a failed step
        health = httpx.get(url + "/health", timeout=10)
        ready = httpx.get(url + "/ready", timeout=10)
        assert (health.status_code, ready.status_code) == (503, 503)
        assert "no engine step finished in" in health.json()["reason"]
        refused = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert refused.status_code == 503, refused.text
