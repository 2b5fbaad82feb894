"""Storm: 200 concurrent streams against a real engine, half of them hanging up at random
points. Afterwards nothing runs or waits and the KV block pool is entirely free.

Budget: ~60 s on 2 CPU cores (max_tokens 16).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator

import httpx
import pytest
from engine_server import EngineServer, running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_STREAMS = 200
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server() -> Iterator[EngineServer]:
    with running_server("--max-num-seqs", "64") as s:
        yield s


async def one_stream(client: httpx.AsyncClient, index: int, hang_up_after: int | None
                     ) -> list[dict[str, object]]:
    body = {"prompt": f"Request {index}: tell me about the number {index * 7}.",
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    events: list[dict[str, object]] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        if hang_up_after == 0:
            return events
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if hang_up_after is not None and len(events) >= hang_up_after:
                    return events  # leaving the context closes the connection mid-stream
    return events


async def storm(base_url: str) -> list[list[dict[str, object]]]:
    rng = random.Random(7)
    plan = [rng.randrange(0, MAX_TOKENS) if i % 2 else None for i in range(NUM_STREAMS)]
    limits = httpx.Limits(max_connections=NUM_STREAMS + 10)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=240) as client:
        return await asyncio.gather(*(one_stream(client, i, hang_up)
                                      for i, hang_up in enumerate(plan)))


def test_storm_with_random_disconnects_leaves_nothing_running_and_all_blocks_free(
        server: EngineServer) -> None:
    before = server.metrics()
    results = asyncio.run(storm(server.base_url))
    complete = results[0::2]
    for events in complete:
        assert [e["seq"] for e in events] == list(range(len(events)))
        assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS  # type: ignore[index]
    after = server.wait_idle(timeout=30)
    assert after["kvfleet_engine_requests_running"] == 0
    assert after["kvfleet_engine_requests_waiting"] == 0
    assert after["kvfleet_engine_kv_cache_usage_ratio"] == 0
    finished = (after["kvfleet_engine_requests_total"]
                - before["kvfleet_engine_requests_total"])
    assert finished == NUM_STREAMS
    log = [json.loads(line) for line in server.log_lines() if '"request_finished"' in line]
    reasons = [line["finish_reason"] for line in log[-NUM_STREAMS:]]
    assert reasons.count("cancelled") >= NUM_STREAMS // 4  # most hang-ups beat the last token
    assert set(reasons) <= {"length", "cancelled"}
    # And the engine still serves.
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200
