"""What a hung Redis costs the router's admissions, side by side with a healthy one.

    .venv/bin/python bench/redis_hang.py [--rate 50] [--seconds 10]

The fast fake engine of `router_overhead.py`, a real `kvfleet router --config --redis` process
and a real redis-server. The same open-loop client (Poisson arrivals at `--rate`, streamed
chats) runs three phases in one process's life: Redis healthy; redis-server stopped by
SIGSTOP (a hung node: connections open, no answer), measured from the moment it stops, so the
requests in flight when it hung are in it; and Redis continued (SIGCONT), the breaker closing
at its next PING. Prints per phase the first-byte latency p50/p99/max and what the hang adds
to the healthy phase's p99 (the target: at most 100 ms, the router's `--redis-timeout`), and
how many requests got anything but a 200. Writes `bench/out/redis_hang.png` (CDFs).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import latency_plot
import router_overhead as ro
import yaml

ROOT = Path(__file__).resolve().parents[1]


async def _one(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
               out: list[tuple[float, int]]) -> None:
    body = {"model": "pool", "stream": True, "max_tokens": 16,
            "messages": [{"role": "user", "content": "hello"}]}
    sent = time.perf_counter()
    async with session.post(url, json=body, headers=headers) as resp:
        first = None
        async for _ in resp.content.iter_any():
            first = first or time.perf_counter() - sent
        out.append((first or time.perf_counter() - sent, resp.status))


async def _load(url: str, headers: dict[str, str], rate: float, seconds: float
                ) -> list[tuple[float, int]]:
    """Poisson arrivals at `rate` for `seconds`: (first byte s, HTTP status) of each."""
    out: list[tuple[float, int]] = []
    rng = random.Random(0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks, start = [], time.perf_counter()
        at = start
        while at - start < seconds:
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(_one(session, url, headers, out)))
        await asyncio.gather(*tasks)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    up_port, redis_port, port = ro.free_port(), ro.free_port(), ro.free_port()
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as tmp:
        config = Path(tmp) / "router.yaml"
        config.write_text(yaml.safe_dump({
            "pools": [{"name": "pool", "status": {"servingRevision": ro.REVISION},
                       "endpoints": {ro.REVISION: [f"127.0.0.1:{up_port}"]}}],
            "tenants": [{"tenant": "bench", "keys": [ro.KEY], "quota": ro.QUOTA}]}))
        redis = ro.start_redis(redis_port, tmp)
        procs = [redis, subprocess.Popen([sys.executable, str(ROOT / "bench/router_overhead.py"),
                                          "--upstream", str(up_port)])]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvfleet", "router", "--config", str(config), "--port",
             str(port), "--metrics-port", str(ro.free_port()), "--log-level", "error", "--redis",
             f"redis://127.0.0.1:{redis_port}/0"], cwd=ROOT))
        try:
            ro.wait_http(f"http://127.0.0.1:{up_port}/metrics")
            ro.wait_http(f"http://127.0.0.1:{port}/health")
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            auth = {"authorization": f"Bearer {ro.KEY}"}
            asyncio.run(_load(url, auth, args.rate, 1.0))  # warm up
            phases: dict[str, list[float]] = {}
            for phase, sig in (("healthy", None), ("hung (SIGSTOP)", signal.SIGSTOP),
                               ("continued", signal.SIGCONT)):
                if sig is not None:
                    redis.send_signal(sig)
                started = time.perf_counter()
                runs = asyncio.run(_load(url, auth, args.rate, args.seconds))
                phases[phase] = [first * 1e3 for first, _ in runs]
                failed = sum(1 for _, status in runs if status != 200)
                ms = phases[phase]
                print(f"{phase:>15}: {len(ms)} requests in {time.perf_counter() - started:.1f} s"
                      f" | first byte p50 {ro.pct(ms, .5):6.2f} p99 {ro.pct(ms, .99):6.2f} "
                      f"max {max(ms):7.2f} ms | not 200: {failed}", flush=True)
            added = ro.pct(phases["hung (SIGSTOP)"], .99) - ro.pct(phases["healthy"], .99)
            print(f"the hang adds {added:+.1f} ms to the first-byte p99 at {args.rate:.0f}/s "
                  "(target: at most +100 ms)")
            latency_plot.write_cdfs(
                [(name, ms, style) for (name, ms), style in
                 zip(phases.items(), ("-", "--", ":"), strict=True)],
                "time to first byte (ms, log)",
                f"First byte through the router at {args.rate:.0f}/s: Redis healthy, hung, back",
                "redis_hang.png")
        finally:
            redis.send_signal(signal.SIGCONT)
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
