"""Tenant fairness and priorities on a real engine.

- A 10:1 flood from one tenant raises the other tenant's TTFT p95 by at most 2x compared
  with the same victim traffic running alone.
- Under a continuous stream of high-priority requests, a low-priority request still finishes
  (aging), and later than the high-priority ones were served.

"10:1" is the offered request rate: the flooding tenant sends ten times as many requests per
second as the victim (Poisson arrivals, mixed output lengths), more than the engine can
serve. The engine runs with a CPU-sized batch (`--max-num-seqs 16`: on a CPU a step's time
grows with its batch) and a per-tenant concurrency limit below it (`--max-in-flight-per-tenant
8`), so the flood's excess gets 429 + Retry-After while the victim's requests are admitted,
ordered by weighted token share, and see at most 2x their TTFT p95.

The victim's prompts are document-sized (283-296 tokens) and never repeat, so neither run is
helped by the prefix cache. With short prompts the check measures step granularity, not
fairness: a newcomer always waits out the step already running, which on a CPU is as long as
a short request's whole prefill, where on a GPU a step is a few milliseconds. Measured on
2 slow cores: ten-token prompts gave ratios 2.13-2.54; ~140-token prompts with a per-tenant
limit of 12 gave 1.27-1.63, and 2.05 once in a full CI run; these settings 1.26-1.31.
The engine runs one torch thread: this test's own load generator and the server's HTTP loop
need the second core.
Budget: ~1 min on 2 CPU cores.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Iterator

import httpx
import pytest
from engine_server import EngineServer, running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

VICTIM_REQUESTS = 10
VICTIM_GAP_S = 1.5
FLOOD_RATE = 10 / VICTIM_GAP_S
VICTIM_PROMPT_WORDS = 260


@pytest.fixture(scope="module")
def server() -> Iterator[EngineServer]:
    # One torch thread: the load generator and the server's HTTP loop need the other core; a
    # second intra-op thread would stall every matmul waiting for a core they hold.
    with running_server("--max-num-seqs", "16", "--max-in-flight-per-tenant", "8",
                        torch_threads=1) as s:
        yield s


async def ttft(client: httpx.AsyncClient, tenant: str, prompt: str, max_tokens: int,
               priority: int = 0) -> float | None:
    """Client-side TTFT of one streamed request; None if it was refused with 429."""
    started = time.monotonic()
    first: float | None = None
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "priority": priority}
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"x-kvfleet-tenant": tenant}) as r:
        if r.status_code == 429:
            assert "retry-after" in r.headers
            return None
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - started
    assert first is not None
    return first


WORDS = ("river", "mountain", "lantern", "copper", "meadow", "harbor", "violet", "thunder",
         "orchard", "glacier", "saddle", "pepper", "canyon", "marble", "falcon", "ribbon",
         "cedar", "lagoon", "ember", "quartz")


def victim_prompt(i: int) -> str:
    rng = random.Random(i)
    words = " ".join(rng.choice(WORDS) for _ in range(VICTIM_PROMPT_WORDS))
    return f"Document {i}: {words}. Summarize document {i} in one line."


async def victim_run(client: httpx.AsyncClient, first_doc: int) -> list[float]:
    async def one(i: int) -> float:
        await asyncio.sleep(i * VICTIM_GAP_S)
        first = await ttft(client, "victim", victim_prompt(first_doc + i), 8)
        assert first is not None, "the victim was refused"
        return first

    return list(await asyncio.gather(*(one(i) for i in range(VICTIM_REQUESTS))))


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


async def measure(base_url: str) -> tuple[list[float], list[float], int, int, int]:
    limits = httpx.Limits(max_connections=1000)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        alone = await victim_run(client, 0)
        rng = random.Random(3)
        flood: list[asyncio.Future[float | None]] = []
        stop = asyncio.Event()

        async def arrivals() -> None:
            i = 0
            while not stop.is_set():
                flood.append(asyncio.ensure_future(ttft(
                    client, "flood", f"Flood {i}: write a sentence about rivers.",
                    rng.randint(8, 24))))
                i += 1
                await asyncio.sleep(rng.expovariate(FLOOD_RATE))

        source = asyncio.ensure_future(arrivals())
        await asyncio.sleep(2.0)  # let the flood fill the engine and its queue
        flooded = await victim_run(client, VICTIM_REQUESTS)
        stop.set()
        await source
        num_sent = len(flood)
        num_done = sum(1 for f in flood if f.done() and f.result() is not None)
        num_refused = sum(1 for f in flood if f.done() and f.result() is None)
        for f in flood:
            f.cancel()  # hang up on the rest: the engine cancels them
        await asyncio.gather(*flood, return_exceptions=True)
        return alone, flooded, num_sent, num_done, num_refused


def test_flood_does_not_raise_the_other_tenants_ttft_p95_beyond_2x(server: EngineServer
                                                                    ) -> None:
    alone, flooded, num_sent, num_done, num_refused = asyncio.run(measure(server.base_url))
    print(f"victim TTFT p95 alone {p95(alone):.3f}s, under flood {p95(flooded):.3f}s "
          f"(ratio {p95(flooded) / p95(alone):.2f}); flood requests sent {num_sent}, "
          f"finished {num_done}, refused {num_refused}")
    assert num_sent >= 8 * VICTIM_REQUESTS  # about 10:1 by request rate
    assert num_refused > 0  # more than the engine could serve: the flood was shed
    assert p95(flooded) <= 2 * p95(alone)
    assert server.wait_idle()["kvfleet_engine_kv_cache_usage_ratio"] == 0


@pytest.fixture(scope="module")
def narrow_server() -> Iterator[EngineServer]:
    # Few slots, so high-priority work is always queued; aging of 0.5 s per level.
    with running_server("--max-num-seqs", "2", "--priority-aging-seconds", "0.5") as s:
        yield s


async def priority_run(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=180) as client:
        stop = asyncio.Event()

        async def high(w: int) -> None:
            i = 0
            while not stop.is_set():
                await ttft(client, "t", f"Urgent {w}-{i}: say yes.", 8, priority=-5)
                i += 1

        workers = [asyncio.ensure_future(high(w)) for w in range(6)]
        await asyncio.sleep(1.0)
        await ttft(client, "t", "Background job: say no.", 8, priority=5)
        stop.set()
        await asyncio.gather(*workers)


def test_low_priority_waits_for_high_priority_but_never_starves(narrow_server: EngineServer
                                                                  ) -> None:
    # Without aging the urgent stream would hold it back for good (the stream stops only when
    # it finishes): the wait would end at this timeout.
    asyncio.run(asyncio.wait_for(priority_run(narrow_server.base_url), timeout=150))
    log = [json.loads(line) for line in narrow_server.log_lines()
           if '"request_finished"' in line and '"tenant":"t"' in line]
    low = [r for r in log if r["priority"] == 5]
    high = [r for r in log if r["priority"] == -5]
    assert len(low) == 1 and low[0]["finish_reason"] == "length"
    # It never starves: 10 levels at 0.5 s each lift it to the urgent level within 5 s of
    # waiting, then it takes the next free slot (20 s of slack for a loaded host).
    assert low[0]["queue_s"] < 10 * 0.5 + 20, low[0]
    # It was made to wait: it queued longer than the typical high-priority request, and
    # high-priority requests that arrived after it were served before it.
    assert low[0]["queue_s"] > statistics.median(r["queue_s"] for r in high)
    later_but_first = [r for r in high if r["arrival_time"] > low[0]["arrival_time"]
                       and r["arrival_time"] + r["queue_s"]
                       < low[0]["arrival_time"] + low[0]["queue_s"]]
    assert later_but_first
