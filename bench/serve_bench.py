"""Serving benchmark in the spirit of `vllm bench serve`, kvfleet vs an HF transformers baseline.

One run, same machine, same arrivals for both servers:

1. mixed-length workload: gamma-distributed arrivals (Poisson when --burstiness 1) at each
   rate in --rates, input lengths log-uniform, output lengths uniform (ignore_eos, so every
   request generates exactly its output length); against `kvfleet serve` and against
   `bench/hf_baseline_server.py` (HF `generate`, static batches or one at a time);
2. shared-prefix workload: 1k-token prompts sharing their first 90%, sent one at a time to
   two kvfleet servers, prefix caching on and off, which take them in blocks in turns.

Reports TTFT, TPOT, ITL, E2E p50/p95/p99, request and output throughput, and goodput (requests
meeting TTFT <= --slo-ttft and TPOT <= --slo-tpot, per second of the run); prints the goodput
ratio kvfleet / baseline and the shared-prefix TTFT p50 ratio cache on / off; writes a JSON
with every number and a PNG (latency CDFs, goodput vs rate).

    .venv/bin/python bench/serve_bench.py                  # defaults sized for a small CPU box
    .venv/bin/python bench/serve_bench.py --rates 1,2,4 --num-requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOKEN_ID_RANGE = (1000, 40000)  # ordinary vocabulary tokens of SmolLM2 (no special tokens)


@dataclass(frozen=True)
class Job:
    arrival: float  # seconds after the start of the run
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class Result:
    ok: bool
    ttft: float = math.nan
    e2e: float = math.nan
    tpot: float = math.nan
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0


# -- workloads ---------------------------------------------------------------------------------


def arrivals(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Gamma inter-arrival times with mean 1/rate; shape = burstiness (1 = Poisson)."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def random_tokens(n: int, rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(*TOKEN_ID_RANGE) for _ in range(n))


def mixed_workload(n: int, rate: float, args: argparse.Namespace) -> list[Job]:
    rng = random.Random(args.seed)  # same seed for every server: identical requests
    times = arrivals(n, rate, args.burstiness, rng)
    lo, hi = args.input_len
    return [Job(t, random_tokens(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))), rng),
                rng.randint(*args.output_len)) for t in times]


def shared_prefix_workload(n: int, prompt_len: int, shared: float, seed: int) -> list[Job]:
    rng = random.Random(seed)
    prefix = random_tokens(int(prompt_len * shared), rng)
    return [Job(0.0, prefix + random_tokens(prompt_len - len(prefix), rng), 8)
            for _ in range(n)]


# -- client ------------------------------------------------------------------------------------


class HTTPStatusError(Exception):
    pass


T = TypeVar("T")
Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]
# Idle keep-alive connections per event loop (each `asyncio.run` has its own) and server.
_idle: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, int],
                                                                list[Connection]]] = \
    weakref.WeakKeyDictionary()


def _idle_connections(host: str, port: int) -> list[Connection]:
    return _idle.setdefault(asyncio.get_running_loop(), {}).setdefault((host, port), [])


async def close_idle_connections() -> None:
    """Close the running loop's kept-alive connections (before the loop ends)."""
    for idle in _idle.pop(asyncio.get_running_loop(), {}).values():
        for _reader, writer in idle:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def run_client(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`, closing the connections it kept alive before its loop ends."""
    async def closing() -> T:
        try:
            return await main
        finally:
            await close_idle_connections()

    return asyncio.run(closing())


async def stream_lines(base_url: str, path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
    """POST `body` as JSON and yield the response body's lines as they arrive.

    A minimal HTTP/1.1 client (chunked or sized bodies) rather than httpx or aiohttp: on a
    2-core box that the servers share, httpx added ~11 ms before a request reached the server
    and ~8 ms before its first token was seen (measured against a raw-socket client in one
    run), the same on every server, which pulls ratios toward 1. Connections are kept alive
    and reused, as a router or an SDK's connection pool does: a new connection per request
    cost 4-10 ms of connect and accept before the server saw the request (measured)."""
    host, _, port_text = base_url.removeprefix("http://").partition(":")
    port = int(port_text or 80)
    payload = json.dumps(body).encode()
    request = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    idle = _idle_connections(host, port)
    while True:
        reused = bool(idle)
        reader, writer = idle.pop() if reused else await asyncio.open_connection(host, port)
        try:
            writer.write(request)
            status_line = await reader.readline()
        except ConnectionError:
            if not reused:
                raise
            status_line = b""
        if status_line or not reused:
            break
        # The server closed this idle connection (its keep-alive timeout); so it did the
        # others idle as long: start afresh.
        writer.close()
        for _reader, stale in idle:
            stale.close()
        idle.clear()
    reusable = False
    try:
        status = int(status_line.split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        if status != 200:
            raise HTTPStatusError(status)
        chunked = headers.get("transfer-encoding") == "chunked"
        remaining = int(headers.get("content-length", -1))
        pending = b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await reader.readline()  # the CRLF ending the (empty) trailer
                    break
                data = await reader.readexactly(size)
                await reader.readexactly(2)  # the CRLF after a chunk
            elif remaining >= 0:
                if remaining == 0:
                    break
                data = await reader.read(min(remaining, 65536))
                if not data:
                    raise asyncio.IncompleteReadError(pending, remaining)
                remaining -= len(data)
            else:  # delimited by the server closing the connection
                data = await reader.read(65536)
                if not data:
                    break
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r")
        if pending:
            yield pending
        reusable = (chunked or remaining == 0) and headers.get("connection") != "close"
    finally:
        if reusable:
            idle.append((reader, writer))
        else:  # an error, an unread body, or a reader that stopped early
            writer.close()


async def send(base_url: str, job: Job) -> Result:
    started = time.monotonic()
    token_times: list[float] = []
    usage_tokens = 0
    body = {"prompt": list(job.prompt), "max_tokens": job.max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    try:
        async for line in stream_lines(base_url, "/v1/completions", body):
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"][0].get("text"):
                token_times.append(time.monotonic())
            if event.get("usage"):
                usage_tokens = event["usage"]["completion_tokens"]
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError, HTTPStatusError):
        return Result(ok=False)
    if not token_times:
        return Result(ok=False)
    end = time.monotonic()
    n = usage_tokens or len(token_times)
    return Result(
        ok=True, ttft=token_times[0] - started, e2e=end - started,
        tpot=(token_times[-1] - token_times[0]) / (n - 1) if n > 1 else math.nan,
        itls=[b - a for a, b in itertools.pairwise(token_times)],
        output_tokens=n)


async def run_jobs(base_url: str, jobs: Sequence[Job], sequential: bool = False,
                   grace_s: float = math.inf) -> tuple[list[Result], float]:
    """Send `jobs` at their arrival times (or one after another); requests still running
    `grace_s` after the last arrival are abandoned and count as failed."""
    start = time.monotonic()
    if sequential:
        return [await send(base_url, job) for job in jobs], time.monotonic() - start

    async def at(job: Job) -> Result:
        await asyncio.sleep(max(0.0, start + job.arrival - time.monotonic()))
        return await send(base_url, job)

    tasks = [asyncio.ensure_future(at(j)) for j in jobs]
    cap = max(j.arrival for j in jobs) + grace_s
    await asyncio.wait(tasks, timeout=None if math.isinf(cap) else cap)
    for task in tasks:
        task.cancel()  # hang up on what is left: the server cancels it
    await asyncio.gather(*tasks, return_exceptions=True)
    duration = time.monotonic() - start
    return [t.result() if not t.cancelled() else Result(ok=False) for t in tasks], duration


# -- statistics --------------------------------------------------------------------------------


def percentiles(values: Sequence[float]) -> dict[str, float]:
    clean = sorted(v for v in values if not math.isnan(v))
    if not clean:
        return {"p50": math.nan, "p95": math.nan, "p99": math.nan}

    def q(p: float) -> float:
        return clean[min(len(clean) - 1, math.ceil(p * len(clean)) - 1)]

    return {"p50": q(0.50), "p95": q(0.95), "p99": q(0.99)}


def summarize(results: list[Result], duration: float, args: argparse.Namespace
              ) -> dict[str, Any]:
    ok = [r for r in results if r.ok]

    def goodput(slo_ttft: float, slo_tpot: float) -> float:
        good = [r for r in ok if r.ttft <= slo_ttft
                and (math.isnan(r.tpot) or r.tpot <= slo_tpot)]
        return len(good) / duration

    extra = {f"goodput_at_{t}s_{p}s": goodput(t, p) for t, p in args.extra_slo}
    return {**extra,
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "goodput": goodput(args.slo_ttft, args.slo_tpot),
        "ttft": percentiles([r.ttft for r in ok]), "tpot": percentiles([r.tpot for r in ok]),
        "itl": percentiles([x for r in ok for x in r.itls]),
        "e2e": percentiles([r.e2e for r in ok]),
        "raw_ttft": [r.ttft for r in ok], "raw_e2e": [r.e2e for r in ok],
        "raw_tpot": [r.tpot for r in ok],
    }


# -- servers -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def server(argv: list[str], name: str, threads: int | None, ready_path: str = "/ready"
           ) -> Iterator[str]:
    """The server `argv` (a Python module's arguments when it starts with "-m" or a script,
    else a whole command) on a free port, until its `ready_path` answers 200. `threads`:
    $OMP_NUM_THREADS (None: not set, the server decides)."""
    port = free_port()
    if argv[0] == "-m" or argv[0].endswith(".py"):
        argv = [sys.executable, *argv]
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - kept for the reader after exit
        prefix=f"serve-bench-{name}-", suffix=".log", delete=False)
    # Same torch thread count for both servers (OMP_NUM_THREADS): on a shared or small CPU,
    # OpenMP spin-waiting across more threads than free cores makes every step erratic.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen([*argv, "--port", str(port)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited; see {log.name}")
            try:
                if httpx.get(url + ready_path, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready; see {log.name}")
            time.sleep(0.5)
        print(f"[{name}] ready at {url} (log {log.name})", flush=True)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def kvfleet_argv(args: argparse.Namespace, *extra: str) -> list[str]:
    return ["-m", "kvfleet", "serve", "--max-num-seqs", str(args.max_num_seqs), *extra]


# -- the run -----------------------------------------------------------------------------------


def fmt(stats: dict[str, Any]) -> str:
    return (f"done {stats['completed']:3d} fail {stats['failed']:2d} | "
            f"TTFT p50/p95/p99 {stats['ttft']['p50']:.2f}/{stats['ttft']['p95']:.2f}/"
            f"{stats['ttft']['p99']:.2f}s | TPOT p50/p95 {stats['tpot']['p50'] * 1e3:.0f}/"
            f"{stats['tpot']['p95'] * 1e3:.0f}ms | ITL p95 {stats['itl']['p95'] * 1e3:.0f}ms | "
            f"E2E p50/p95 {stats['e2e']['p50']:.2f}/{stats['e2e']['p95']:.2f}s | "
            f"{stats['request_throughput']:.2f} req/s {stats['output_throughput']:.1f} tok/s | "
            f"goodput {stats['goodput']:.2f} req/s")


def run_mixed(args: argparse.Namespace) -> dict[str, Any]:
    """Both servers stay up; each rate runs on kvfleet then on the baseline, back to back, so
    a paired comparison sees the same machine conditions (the idle one uses no CPU)."""
    report: dict[str, Any] = {"kvfleet": {}}
    with ExitStack() as stack:
        urls = {"kvfleet": stack.enter_context(server(kvfleet_argv(args), "kvfleet",
                                                      args.threads))}
        if not args.skip_baseline:
            report["baseline"] = {}
            urls["baseline"] = stack.enter_context(server(
                ["bench/hf_baseline_server.py", "--mode", args.baseline_mode,
                 "--batch-size", str(args.baseline_batch_size)], "baseline", args.threads))
        for rate in args.rates:
            jobs = mixed_workload(args.num_requests, rate, args)
            for name, url in urls.items():
                results, duration = run_client(run_jobs(url, jobs, grace_s=args.grace))
                stats = summarize(results, duration, args)
                report[name][str(rate)] = stats
                print(f"[{name}] rate {rate:5.2f}/s: {fmt(stats)}", flush=True)
    return report


def run_shared_prefix(args: argparse.Namespace) -> dict[str, Any]:
    """Both servers stay up; they take the prompts in blocks (on, off, off, on, ... for
    --prefix-rounds), each server alone while its block runs, so a drift in this CPU's speed
    (10-20 % within minutes: its cache is shared with other machines) falls on both.

    Each block starts with a short unmeasured request. Why: the other process's copy of the
    weights has just pushed this one's out of the shared L3, and at ~100 rows a step's
    weight matmuls wait on memory: with prompts in turns, a hit right after the other server's
    request took 325 ms instead of 251 (means of 8). One engine per node never sees that."""
    jobs = shared_prefix_workload(args.prefix_requests, args.prefix_prompt_len,
                                  args.prefix_shared, args.seed)
    flags = {"cache_on": "--enable-prefix-caching", "cache_off": "--no-enable-prefix-caching"}
    with ExitStack() as stack:
        urls = {name: stack.enter_context(server(kvfleet_argv(args, flag), f"kvfleet-{name}",
                                                 args.threads))
                for name, flag in flags.items()}
        results, durations = run_client(in_blocks(urls, jobs, args.prefix_rounds))
    report: dict[str, Any] = {}
    for name in flags:
        report[name] = summarize(results[name], durations[name], args)
        print(f"[shared-prefix {name}] {fmt(report[name])}", flush=True)
    report["ttft_p50_ratio_on_off"] = (report["cache_on"]["ttft"]["p50"]
                                      / report["cache_off"]["ttft"]["p50"])
    return report


async def in_blocks(urls: dict[str, str], jobs: Sequence[Job], rounds: int
                    ) -> tuple[dict[str, list[Result]], dict[str, float]]:
    """The jobs in `rounds` blocks; every block on every server in turn (order flipped per
    round), one request at a time, after an unmeasured 16-token warm-up request."""
    results: dict[str, list[Result]] = {name: [] for name in urls}
    durations = dict.fromkeys(urls, 0.0)
    size = -(-len(jobs) // rounds)
    warm_up = Job(0.0, random_tokens(16, random.Random(-1)), 1)
    for r in range(rounds):
        for name in (list(urls) if r % 2 == 0 else list(reversed(urls))):
            await send(urls[name], warm_up)
            started = time.monotonic()
            for job in jobs[r * size:(r + 1) * size]:
                results[name].append(await send(urls[name], job))
            durations[name] += time.monotonic() - started
    return results, durations


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, good) = plt.subplots(1, 2, figsize=(12, 4.5))
    mixed = report["mixed"]
    top = max(mixed["kvfleet"], key=float)
    for name, style in (("kvfleet", "-"), ("baseline", "--")):
        if top not in mixed.get(name, {}):
            continue
        for metric in ("raw_ttft", "raw_e2e"):
            values = sorted(mixed[name][top][metric])
            ys = [(i + 1) / len(values) for i in range(len(values))]
            cdf.plot(values, ys, style, label=f"{name} {metric[4:].upper()}")
    cdf.set_xscale("log")
    cdf.set_xlabel("seconds")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title(f"latency CDF at {top} req/s")
    cdf.legend()
    extra = [key for key in mixed["kvfleet"][top] if key.startswith("goodput_at_")]
    for name, style in (("kvfleet", "o-"), ("baseline", "s--")):
        rates = sorted(mixed.get(name, {}), key=float)
        for key in ["goodput", *extra]:
            if rates:
                label = name if key == "goodput" else f"{name} {key[len('goodput_at_'):]}"
                good.plot([float(r) for r in rates], [mixed[name][r][key] for r in rates],
                          style, label=label, alpha=1.0 if key == "goodput" else 0.6)
    good.set_xlabel("offered request rate (req/s)")
    good.set_ylabel("goodput (req/s meeting the SLO)")
    good.set_title(f"goodput at TTFT<= {report['slo']['ttft']}s, "
                   f"TPOT<= {report['slo']['tpot'] * 1e3:.0f}ms")
    good.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    def floats(value: str) -> list[float]:
        return [float(x) for x in value.split(",")]

    def pair(value: str) -> tuple[int, int]:
        lo, hi = (int(x) for x in value.split(","))
        return lo, hi

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=floats, default=[0.25, 0.5, 1.0])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--input-len", type=pair, default=(32, 256), help="log-uniform lo,hi")
    p.add_argument("--output-len", type=pair, default=(16, 48), help="uniform lo,hi")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grace", type=float, default=60.0,
                   help="seconds after the last arrival before unfinished requests are "
                   "abandoned (counted as failed)")
    p.add_argument("--slo-ttft", type=float, default=1.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--extra-slo", type=lambda v: [tuple(float(x) for x in pair.split(","))
                                                  for pair in v.split(";")], default=[],
                   help="also report goodput at these SLOs: 'TTFT,TPOT;TTFT,TPOT' (seconds)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--baseline-mode", choices=["static", "sequential"], default="static")
    p.add_argument("--baseline-batch-size", type=int, default=8)
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--skip-mixed", action="store_true",
                   help="only the shared-prefix workload (no plot: it shows the mixed one)")
    p.add_argument("--prefix-requests", type=int, default=16)
    p.add_argument("--prefix-prompt-len", type=int, default=1024)
    p.add_argument("--prefix-shared", type=float, default=0.9)
    p.add_argument("--prefix-rounds", type=int, default=2,
                   help="blocks the shared-prefix prompts are split into, taken in turns")
    p.add_argument("--skip-prefix", action="store_true")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of each server (OMP_NUM_THREADS)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "serve_bench")
    args = p.parse_args(argv)
    if not 1 <= args.prefix_rounds <= args.prefix_requests:
        p.error(f"--prefix-rounds must be between 1 and --prefix-requests "
                f"({args.prefix_requests}), got {args.prefix_rounds}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v)
                                       for k, v in vars(args).items()},
                              "slo": {"ttft": args.slo_ttft, "tpot": args.slo_tpot}}
    if not args.skip_mixed:
        report["mixed"] = run_mixed(args)
    if not args.skip_mixed and not args.skip_baseline:
        best = {name: max(s["goodput"] for s in report["mixed"][name].values())
                for name in ("kvfleet", "baseline")}
        ratio = (best["kvfleet"] / best["baseline"] if best["baseline"]
                 else math.inf if best["kvfleet"] else math.nan)
        report["goodput_ratio"] = ratio
        for rate in args.rates:
            k, b = (report["mixed"][n][str(rate)]["goodput"] for n in ("kvfleet", "baseline"))
            print(f"goodput at {rate} req/s: kvfleet {k:.2f} baseline {b:.2f} "
                  f"ratio {k / b if b else math.inf:.2f}")
        print(f"GOODPUT RATIO (best over rates) kvfleet/baseline = {ratio:.2f} (target >= 4)")
        for slo_ttft, slo_tpot in args.extra_slo:
            key = f"goodput_at_{slo_ttft}s_{slo_tpot}s"
            k, b = (max(s[key] for s in report["mixed"][n].values())
                    for n in ("kvfleet", "baseline"))
            report[f"goodput_ratio_at_{slo_ttft}s_{slo_tpot}s"] = k / b if b else math.inf
            print(f"goodput at TTFT<={slo_ttft}s TPOT<={slo_tpot}s (best over rates): "
                  f"kvfleet {k:.3f} baseline {b:.3f} ratio {k / b if b else math.inf:.2f}")
    if not args.skip_prefix:
        report["shared_prefix"] = run_shared_prefix(args)
        print(f"SHARED-PREFIX TTFT p50 cache on / off = "
              f"{report['shared_prefix']['ttft_p50_ratio_on_off']:.3f} (target <= 0.15)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=1, default=str))
    if "mixed" in report:
        plot(report, Path(f"{args.out}.png"))
    print(f"wrote {args.out}.json" + (f" and {args.out}.png" if "mixed" in report else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
