"""What the router adds to a request, isolated with a fast fake engine.

    .venv/bin/python bench/router_overhead.py [--rates 50,100,200] [--seconds 10] [--chunks 16]
        [--prompt-words 1] [--pin]

A fake upstream (its own process: aiohttp, answers at once, streams `--chunks` SSE frames and
a usage frame, and serves the gauges the router scrapes and the embedded model's tokenizer,
with which the router counts each prompt) stands in for an engine. The same open-loop client
(Poisson arrivals at each rate, streaming chat requests of `--prompt-words` words) runs
against the upstream directly, through a real `kvfleet router --config` process, and through
a second one whose quota ledger is shared in a real redis-server (`--redis`), in turns at
each rate (the router not being measured is paused). The tenant's quota sets every limit
(none binding), so each request takes the whole admission.
Prints the shared ledger's script round trip alone (through kvfleet's Redis client and, when
installed, redis-py's, with the CPU each takes), then per rate and router the time to the
first byte and the gap between streamed chunks, p50/p99, direct and routed, the difference
(what the router adds), and the router's CPU time per request (from /proc). Writes
`bench/out/router_overhead.png` (first-byte latency CDFs)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import latency_plot
import yaml

from kvfleet.api.tenantquota import TenantQuotaSpec

ROOT = Path(__file__).resolve().parents[1]
REVISION = "f" * 64
KEY = "sk-bench-0123456789abcdef0123"
# Limits on every resource the ledger keeps (none binding at these rates), so each request
# takes the whole admission path: buckets, a concurrency slot, the settle.
QUOTA = {"limits": {"requestsPerMinute": 1_000_000, "inputTokensPerMinute": 100_000_000,
                    "outputTokensPerMinute": 100_000_000, "maxConcurrentRequests": 10_000}}
PROSE = ("the cluster schedules each replica on a node with a free GPU and the router "
         "sends every request to the least loaded one")
QUOTA_SPEC = TenantQuotaSpec.model_validate({"tenant": "bench", **QUOTA})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def tokenizer_json() -> str:
    """The embedded model's tokenizer, as an engine serves it: the router counts each prompt
    with it, as it does in front of real engines."""
    from kvfleet.engine.model.gguf_file import read_tokenizer_spec
    from kvfleet.engine.model.gguf_reader import GGUFFile
    from kvfleet.engine.model.loader import default_model_path
    from kvfleet.engine.tokenizer import Tokenizer

    path = default_model_path()
    return Tokenizer.from_gguf(read_tokenizer_spec(GGUFFile(path).metadata, path), path).to_json()


def upstream(port: int, chunks: int) -> None:
    from aiohttp import web

    tokenizer = tokenizer_json()

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

    async def tokenizer_file(_: web.Request) -> web.Response:
        return web.Response(text=tokenizer, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/tokenizer.json", tokenizer_file)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def one(session: object, url: str, headers: dict[str, str], prompt: str,
              out: list[tuple[float, list[float]]]) -> None:
    import aiohttp

    assert isinstance(session, aiohttp.ClientSession)
    body = {"model": "pool", "stream": True, "max_tokens": 16,
            "messages": [{"role": "user", "content": prompt}]}
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


async def load(url: str, headers: dict[str, str], rate: float, seconds: float,
               prompt: str = "hello") -> list[tuple[float, list[float]]]:
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
            tasks.append(asyncio.create_task(one(session, url, headers, prompt, out)))
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


def start_redis(port: int, tmp: str) -> subprocess.Popen[bytes]:
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed (Debian: apt-get install redis-server)")
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", tmp],
                            stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                         check=False).stdout.strip() != b"PONG":
        if time.monotonic() > deadline:
            raise SystemExit("redis-server did not start")
        time.sleep(0.05)
    return proc


async def script_latency(client: Any, n: int = 1000) -> tuple[list[float], float]:
    """One admission and its settle through the shared ledger's scripts, alone: what Redis
    adds to a request. (ms per admit, router-process CPU ms per admit and settle)."""
    from kvfleet.router.fleet_ledger import SharedLedger
    from kvfleet.router.quota import QuotaLedger

    local = QuotaLedger()
    local.set_quotas({"bench": ("bench/bench", QUOTA_SPEC)}, 0.0)
    ledger = SharedLedger(local, client, prefix="bench-latency")
    times = []
    cpu = time.process_time()
    for _ in range(n):
        start = time.perf_counter()
        reservation = await ledger.admit("bench", 20, 16, time.monotonic())
        times.append((time.perf_counter() - start) * 1e3)
        ledger.settle(reservation, 16, time.monotonic(), 20)
        await ledger.drain()
    cpu_ms = (time.process_time() - cpu) * 1e3 / n
    await client.aclose()
    return times, cpu_ms


def compare_clients(url: str) -> None:
    """The ledger's scripts through kvfleet's client and, when installed, redis-py's (the one
    it replaced), in turns; prints each one's admit latency and CPU."""
    from kvfleet.router.resp import Redis

    clients: dict[str, Any] = {"kvfleet.router.resp": lambda: Redis.from_url(url)}
    try:
        import redis.asyncio

        clients["redis-py asyncio"] = lambda: redis.asyncio.Redis.from_url(url)
    except ImportError:
        print("(redis-py not installed: kvfleet's client alone)")
    found: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in clients}
    for _ in range(3):
        for name, make in clients.items():
            times, cpu_ms = asyncio.run(script_latency(make()))
            found[name][0].extend(times)
            found[name][1].append(cpu_ms)
    for name, (times, cpus) in found.items():
        print(f"shared ledger admit via {name:20s} (script round trip, alone): p50 "
              f"{pct(times, .5):.3f} ms, p99 {pct(times, .99):.3f} ms; CPU per admit and "
              f"settle {sorted(cpus)[1]:.3f} ms (median of 3)")
    if len(found) == 2:
        (a, b) = (sorted(c)[1] for _, c in found.values())
        print(f"CPU per admit and settle, kvfleet ÷ redis-py: {a / b:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="50,100,200")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=1,
                        help="words in each request's prompt (the router tokenizes it)")
    parser.add_argument("--pin", action="store_true",
                        help="the routers on the last CPU, the client, the fake engine and "
                             "redis-server on the others: a router with a core of its own, "
                             "apart from the host's contention")
    parser.add_argument("--upstream", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.upstream:
        upstream(args.upstream, args.chunks)
        return 0
    router_cpus: set[int] | None = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--pin needs 2 CPUs or more")
        router_cpus = {cpus[-1]}
        os.sched_setaffinity(0, set(cpus[:-1]))  # this client, and the children it starts
        print(f"pinned: routers on CPU {cpus[-1]}, the rest on {cpus[:-1]}")
    up_port, redis_port = free_port(), free_port()
    ports = {"router": free_port(), "router+redis": free_port()}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as tmp:
        config = Path(tmp) / "router.yaml"
        config.write_text(yaml.safe_dump({
            "pools": [{"name": "pool", "status": {"servingRevision": REVISION},
                       "endpoints": {REVISION: [f"127.0.0.1:{up_port}"]}}],
            "tenants": [{"tenant": "bench", "keys": [KEY], "quota": QUOTA}]}))
        procs["redis"] = start_redis(redis_port, tmp)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        procs["upstream"] = subprocess.Popen([sys.executable, __file__, "--upstream",
                                              str(up_port), "--chunks", str(args.chunks)])
        for name, port in ports.items():
            extra = ["--redis", redis_url] if name == "router+redis" else []
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "kvfleet", "router", "--config", str(config), "--port",
                 str(port), "--metrics-port", str(free_port()), "--log-level", "warning",
                 *extra],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                preexec_fn=None if router_cpus is None else (
                    lambda: os.sched_setaffinity(0, router_cpus)))
        try:
            wait_http(f"http://127.0.0.1:{up_port}/metrics")
            for port in ports.values():
                wait_http(f"http://127.0.0.1:{port}/health")
            time.sleep(0.5)
            urls = {"direct": f"http://127.0.0.1:{up_port}/v1/chat/completions"} | {
                name: f"http://127.0.0.1:{port}/v1/chat/completions"
                for name, port in ports.items()}
            auth = {"authorization": f"Bearer {KEY}"}
            for name in ports:
                asyncio.run(load(urls[name], auth, 50, 1.0))  # warm up
            compare_clients(redis_url)
            words = PROSE.split()
            prompt = " ".join(random.Random(1).choice(words) for _ in range(args.prompt_words))
            results = {rate: measure(urls, auth, rate, args.seconds, procs, prompt)
                       for rate in [float(r) for r in args.rates.split(",")]}
            plot(results)
        finally:
            for proc in procs.values():
                proc.terminate()
                proc.wait(10)
    return 0


def measure(urls: dict[str, str], auth: dict[str, str], rate: float, seconds: float,
            procs: dict[str, subprocess.Popen[bytes]], prompt: str
            ) -> dict[str, list[tuple[float, list[float]]]]:
    """One rate, each target in turn; prints a row per router (added = router - direct)."""
    runs: dict[str, list[tuple[float, list[float]]]] = {}
    cpu: dict[str, float] = {}
    routers = [name for name in urls if name in procs]
    for name, url in urls.items():
        # Each target measured alone: the other router is paused (its replica scrape would
        # take the CPU this one's requests wait for).
        paused = [procs[other] for other in routers if other != name]
        for proc in paused:
            proc.send_signal(signal.SIGSTOP)
        try:
            before = cpu_seconds(procs[name].pid) if name in procs else 0.0
            runs[name] = asyncio.run(load(url, {} if name == "direct" else auth, rate, seconds,
                                          prompt))
            if name in procs:
                cpu[name] = (cpu_seconds(procs[name].pid) - before) / max(1, len(runs[name])) \
                    * 1e3
        finally:
            for proc in paused:
                proc.send_signal(signal.SIGCONT)
    first = {name: [x[0] * 1e3 for x in r] for name, r in runs.items()}
    gaps = {name: [g * 1e3 for x in r for g in x[1]] for name, r in runs.items()}
    fd = first["direct"]
    for name in cpu:
        fr = first[name]
        print(f"{rate:5.0f} {name:>12} | first byte p50 / p99 ms: direct {pct(fd, .5):5.2f} / "
              f"{pct(fd, .99):5.2f}, routed {pct(fr, .5):5.2f} / {pct(fr, .99):5.2f}, added "
              f"+{pct(fr, .5) - pct(fd, .5):5.2f} / +{pct(fr, .99) - pct(fd, .99):5.2f} | "
              f"chunk gap p50 / p99 ms {pct(gaps[name], .5):5.3f} / {pct(gaps[name], .99):5.3f}"
              f" | router CPU {cpu[name]:5.2f} ms/request", flush=True)
    return runs


def plot(results: dict[float, dict[str, list[tuple[float, list[float]]]]]) -> None:
    latency_plot.write_cdfs(
        [(f"{name} at {rate:.0f}/s", [x[0] * 1e3 for x in runs[name]], style)
         for rate, runs in results.items() for name, style in (("direct", "--"), ("router", "-"))],
        "time to first byte (ms, log)",
        "Router overhead: fake engine, direct vs through the router", "router_overhead.png")


if __name__ == "__main__":
    raise SystemExit(main())
