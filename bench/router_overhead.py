"""What the router adds to a request, isolated with a fast fake engine.

    .venv/bin/python bench/router_overhead.py [--rates 50,100,200] [--seconds 10] [--chunks 16]

A fake upstream (its own process: aiohttp, answers at once, streams `--chunks` SSE frames and
a usage frame, and serves the gauges the router scrapes) stands in for an engine. The same
open-loop client (Poisson arrivals at each rate, streaming chat requests) runs against the
upstream directly and through a real `kvfleet router --config` process, in turns at each rate.
Prints, per rate, the time to the first byte and the gap between streamed chunks, p50/p99,
direct and via the router, the difference (what the router adds), and the router's CPU time
per request (from /proc). Writes `bench/out/router_overhead.png` (first-byte latency CDFs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import latency_plot
import yaml

ROOT = Path(__file__).resolve().parents[1]
REVISION = "f" * 64
KEY = "sk-bench-0123456789abcdef0123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def upstream(port: int, chunks: int) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"id": "x", "choices": [{"message": {"content": "hi"}}],
                                      "usage": {"prompt_tokens": 5, "completion_tokens": 1}})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(chunks):
            frame = {"id": "x", "seq": i, "choices": [{"delta": {"content": "tok"}}]}
            await resp.write(f"id: {i}\ndata: {json.dumps(frame)}\n\n".encode())
        last = {"id": "x", "choices": [{"delta": {}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": chunks}}
        await resp.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="kvfleet_engine_requests_waiting 0\n"
                                 "kvfleet_engine_requests_running 0\n"
                                 "kvfleet_engine_kv_cache_usage_ratio 0\n")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def one(session: object, url: str, headers: dict[str, str], start: float,
              out: list[tuple[float, list[float]]]) -> None:
    import aiohttp

    assert isinstance(session, aiohttp.ClientSession)
    body = {"model": "pool", "stream": True, "max_tokens": 16,
            "messages": [{"role": "user", "content": "hello"}]}
    sent = time.perf_counter()
    async with session.post(url, json=body, headers=headers) as resp:
        first = None
        gaps: list[float] = []
        last = sent
        async for _ in resp.content.iter_any():
            now = time.perf_counter()
            if first is None:
                first = now - sent
            else:
                gaps.append(now - last)
            last = now
    out.append((first or 0.0, gaps))


async def load(url: str, headers: dict[str, str], rate: float, seconds: float
               ) -> list[tuple[float, list[float]]]:
    import aiohttp

    out: list[tuple[float, list[float]]] = []
    rng = random.Random(0)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = []
        start = time.perf_counter()
        at = start
        while at - start < seconds:
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session, url, headers, at, out)))
        await asyncio.gather(*tasks)
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http(url: str, timeout: float = 30) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer in {timeout} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="50,100,200")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--upstream", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.upstream:
        upstream(args.upstream, args.chunks)
        return 0
    up_port, router_port = free_port(), free_port()
    procs = []
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as tmp:
        config = Path(tmp) / "router.yaml"
        config.write_text(yaml.safe_dump({
            "pools": [{"name": "pool", "status": {"servingRevision": REVISION},
                       "endpoints": {REVISION: [f"127.0.0.1:{up_port}"]}}],
            "tenants": [{"tenant": "bench", "keys": [KEY], "quota": {}}]}))
        procs.append(subprocess.Popen([sys.executable, __file__, "--upstream", str(up_port),
                                       "--chunks", str(args.chunks)]))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvfleet", "router", "--config", str(config), "--port",
             str(router_port), "--log-level", "warning"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}))
        try:
            wait_http(f"http://127.0.0.1:{up_port}/metrics")
            wait_http(f"http://127.0.0.1:{router_port}/health")
            time.sleep(0.5)
            direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
            routed = f"http://127.0.0.1:{router_port}/v1/chat/completions"
            auth = {"authorization": f"Bearer {KEY}"}
            asyncio.run(load(routed, auth, 50, 1.0))  # warm up both
            results: dict[float, dict[str, list[tuple[float, list[float]]]]] = {}
            print(f"{'rate':>5} | first byte p50 / p99 ms: direct, router, added | "
                  f"chunk gap p50 / p99 ms: direct, router | router CPU ms/request")
            for rate in [float(r) for r in args.rates.split(",")]:
                d = asyncio.run(load(direct, {}, rate, args.seconds))
                cpu0 = cpu_seconds(procs[1].pid)
                r = asyncio.run(load(routed, auth, rate, args.seconds))
                cpu = (cpu_seconds(procs[1].pid) - cpu0) / max(1, len(r)) * 1e3
                results[rate] = {"direct": d, "router": r}
                fd, fr = [x[0] * 1e3 for x in d], [x[0] * 1e3 for x in r]
                gd = [g * 1e3 for x in d for g in x[1]]
                gr = [g * 1e3 for x in r for g in x[1]]
                print(f"{rate:5.0f} | {pct(fd, .5):6.2f} / {pct(fd, .99):6.2f}, "
                      f"{pct(fr, .5):6.2f} / {pct(fr, .99):6.2f}, "
                      f"+{pct(fr, .5) - pct(fd, .5):5.2f} / +{pct(fr, .99) - pct(fd, .99):5.2f} | "
                      f"{pct(gd, .5):5.3f} / {pct(gd, .99):5.3f}, "
                      f"{pct(gr, .5):5.3f} / {pct(gr, .99):5.3f} | {cpu:5.2f}", flush=True)
            plot(results)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    return 0


def plot(results: dict[float, dict[str, list[tuple[float, list[float]]]]]) -> None:
    latency_plot.write_cdfs(
        [(f"{name} at {rate:.0f}/s", [x[0] * 1e3 for x in runs[name]], style)
         for rate, runs in results.items() for name, style in (("direct", "--"), ("router", "-"))],
        "time to first byte (ms, log)",
        "Router overhead: fake engine, direct vs through the router", "router_overhead.png")


if __name__ == "__main__":
    raise SystemExit(main())
