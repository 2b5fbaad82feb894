"""Soak: minutes of mixed, misbehaving load on one real `kvfleet serve` (the embedded SmolLM2),
then a check that the server is back where it started. Not in CI (it takes minutes).

    .venv/bin/python bench/soak.py [--seconds 120] [--warmup-seconds 90] [--concurrency 8]

Each client loop picks, at random, one of:

- stream     a streamed chat read to its end;
- leave      a stream the client drops after a few chunks (the engine must cancel it);
- deadline   a stream with a 0.3-0.8 s deadline (ends with finish_reason "deadline");
- too-long   a prompt over the context window (400 saying so; never admitted);
- retry      an idempotent request (Idempotency-Key) dropped after a chunk and sent again:
             the retry must replay the same request (same x-request-id, same text), never
             generate twice.

Afterwards, once the server is idle:

- KV blocks in use and requests running/waiting are back to zero;
- every admitted request finished exactly once: the engine's finished-request counter grew by
  exactly the number of requests it admitted (each retry pair counts once);
- resident memory is within --rss-slack-mb of its level after warm-up, and open file
  descriptors are back to theirs (connections closed, nothing leaked).

Prints the figures and exits 1 when a check fails. A plot of RSS and open descriptors over
the run goes to bench/out/soak.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from engine_server import EngineServer, running_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1"
KINDS = ("stream", "leave", "deadline", "too-long", "retry")
WEIGHTS = (4, 2, 2, 1, 2)
WORDS = ("fleet", "rollout", "canary", "token", "cache", "replica", "quota", "tenant", "node")


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)  # kind/outcome -> count
    admitted: int = 0  # requests the engine must have finished once each
    problems: list[str] = field(default_factory=list)
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, rss, fds)


def _proc_stats(pid: int) -> tuple[int, int]:
    """(resident bytes, open file descriptors) of `pid`, from /proc."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def _finished(server: EngineServer) -> dict[str, float]:
    """kvfleet_engine_requests_total by finish reason."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvfleet_engine_requests_total":
                reason = sample.labels.get("finish_reason", "")
                found[reason] = found.get(reason, 0.0) + sample.value
    return found


def _body(rng: random.Random, max_tokens: int, words: int = 0) -> dict[str, Any]:
    text = " ".join(rng.choice(WORDS) for _ in range(words or rng.randint(5, 40)))
    return {"model": MODEL, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": f"Tell me about {text}."}]}


async def _stream(client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str],
                  stop_after: int | None = None) -> tuple[int, str, str, str | None]:
    """(status, x-request-id, text, finish_reason); with `stop_after`, the connection is
    dropped after that many content chunks."""
    text, reason, chunks = "", None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, "", response.text, None
        request_id = response.headers.get("x-request-id", "")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice.get("delta", {}).get("content") or ""
            reason = choice.get("finish_reason") or reason
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                break  # leaving the block closes the connection mid-stream
    return 200, request_id, text, reason


async def _one(kind: str, rng: random.Random, base: str, tally: Tally) -> None:
    # Each request on its own connection: a dropped stream must not be reused.
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        if kind == "stream":
            status, _, _, reason = await _stream(client, _body(rng, rng.randint(8, 32)), {})
            tally.admitted += status == 200
            ok = status == 200 and reason in ("stop", "length")
        elif kind == "leave":
            status, _, _, _ = await _stream(client, _body(rng, 64), {}, stop_after=2)
            tally.admitted += status == 200
            ok = status == 200
        elif kind == "deadline":
            deadline = f"{rng.uniform(0.3, 0.8):.2f}"
            status, _, _, reason = await _stream(
                client, _body(rng, 200), {"x-kvfleet-deadline-seconds": deadline})
            tally.admitted += status == 200
            ok = status == 200 and reason in ("deadline", "stop", "length")
        elif kind == "too-long":
            status, _, text, _ = await _stream(client, _body(rng, 8, words=4000), {})
            ok = status == 400 and "the prompt has" in text
        else:  # retry
            key = {"Idempotency-Key": uuid.uuid4().hex}
            body = _body(rng, rng.randint(8, 24))
            status, first_id, _, _ = await _stream(client, body, key, stop_after=1)
            tally.admitted += status == 200
            async with httpx.AsyncClient(base_url=base, timeout=120) as again:
                status2, second_id, text, reason = await _stream(again, body, key)
                _, third_id, text3, _ = await _stream(again, body, key)
            ok = (status == status2 == 200 and first_id == second_id == third_id
                  and text == text3 and reason in ("stop", "length"))
            if not ok:
                tally.problems.append(f"retry: ids {first_id}/{second_id}/{third_id}, "
                                      f"texts equal {text == text3}, reason {reason}")
    tally.outcomes[f"{kind}/{'ok' if ok else 'unexpected'}"] += 1
    if not ok and kind != "retry":
        tally.problems.append(f"{kind}: status {status}")


async def _load(base: str, seconds: float, concurrency: int, seed: int, pid: int,
                tally: Tally) -> None:
    end = time.monotonic() + seconds
    started = time.monotonic()

    async def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < end:
            await _one(rng.choices(KINDS, WEIGHTS)[0], rng, base, tally)

    async def sampler() -> None:
        while time.monotonic() < end:
            rss, fds = _proc_stats(pid)
            tally.samples.append((time.monotonic() - started, rss, fds))
            done = sum(tally.outcomes.values())
            print(f"\r  {time.monotonic() - started:5.0f} s  {done} requests  "
                  f"RSS {rss / 2**20:.0f} MiB  fds {fds}", end="", flush=True)
            await asyncio.sleep(2)

    await asyncio.gather(sampler(), *(worker(i) for i in range(concurrency)))
    print()


def _plot(tally: Tally, baseline: tuple[int, int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s[0] for s in tally.samples]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    top.plot(t, [s[1] / 2**20 for s in tally.samples])
    top.axhline(baseline[0] / 2**20, linestyle="--", color="grey", label="after warm-up")
    top.set_ylabel("RSS (MiB)")
    top.legend()
    bottom.plot(t, [s[2] for s in tally.samples])
    bottom.axhline(baseline[1], linestyle="--", color="grey")
    bottom.set_ylabel("open fds")
    bottom.set_xlabel("seconds of load")
    fig.suptitle("kvfleet serve under the soak load")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup-seconds", type=float, default=90,
                        help="the same load first, unmeasured: the allocator and caches grow "
                        "to their working size (about 80 s here) before the baseline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-slack-mb", type=float, default=64,
                        help="how far above its warm-up level RSS may end (allocator slack)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "soak.png")
    args = parser.parse_args(argv)
    print("starting kvfleet serve (model load and warm-up)...", flush=True)
    with running_server("--max-model-len", "512") as server:
        pid = server.process.pid
        # The same mix, unmeasured, so allocator pools and caches reach their working size
        # before the baseline is taken (RSS climbs ~75 MiB over the first ~80 s, then holds).
        print(f"warm-up: {args.warmup_seconds:.0f} s", flush=True)
        warm = Tally()
        asyncio.run(_load(server.base_url, args.warmup_seconds, args.concurrency, args.seed + 1,
                          pid, warm))
        server.wait_idle(60)
        baseline, finished_before = _proc_stats(pid), _finished(server)
        tally = Tally()
        print(f"load: {args.seconds:.0f} s, {args.concurrency} clients", flush=True)
        asyncio.run(_load(server.base_url, args.seconds, args.concurrency, args.seed, pid,
                          tally))
        idle = server.wait_idle(60)
        time.sleep(1)  # closed connections leave the server's descriptor table
        after, finished_after = _proc_stats(pid), _finished(server)
    finished = {r: finished_after.get(r, 0) - finished_before.get(r, 0) for r in finished_after}
    total = sum(finished.values())
    checks = {
        "KV blocks in use back to 0": idle["kvfleet_engine_kv_cache_usage_ratio"] == 0,
        "no request running or waiting": idle["kvfleet_engine_requests_running"] == 0
        and idle["kvfleet_engine_requests_waiting"] == 0,
        f"every admitted request finished once ({tally.admitted} admitted, {total:.0f} "
        "finished)": total == tally.admitted,
        f"RSS within {args.rss_slack_mb:.0f} MiB of warm-up ({baseline[0] / 2**20:.0f} -> "
        f"{after[0] / 2**20:.0f} MiB)": after[0] - baseline[0] <= args.rss_slack_mb * 2**20,
        f"open fds back to their level ({baseline[1]} -> {after[1]})": after[1] <= baseline[1],
        "every request answered as expected": not tally.problems,
    }
    print(f"requests: {dict(sorted(tally.outcomes.items()))}")
    print(f"finished by reason: { {r: int(v) for r, v in sorted(finished.items()) if v} }")
    peak = max((s[1] for s in tally.samples), default=0)
    print(f"RSS peak under load {peak / 2**20:.0f} MiB")
    for problem in tally.problems[:10]:
        print(f"  problem: {problem}")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    _plot(tally, baseline, args.out)
    print(f"plot: {args.out}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
