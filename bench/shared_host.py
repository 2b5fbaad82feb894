"""Engines sharing one host's CPUs: the threads each one runs, side by side in one run.

    .venv/bin/python bench/shared_host.py [--engines 2] [--seconds 20] [--clients 4]

A node runs several engine pods (two revisions in a rollout, replicas packed onto one node);
each pod gets a share of the CPUs (limits.cpu). `--engines` `kvfleet serve` processes start
together, each with `--clients` closed-loop clients sending short chat requests (`--max-tokens`
tokens each), in three layouts taken in turns:

  every-core    `--cpu-threads <host cores>` each: a thread per core of the host, what torch
                starts with and what the engine ran before it sized its threads: more
                threads than the engines get between them
  share         `--cpu-threads <host cores / engines>` each, on any CPU: the thread count a
                CFS quota (limits.cpu) now gives the engine, without the quota's throttling
  pinned        each engine pinned (taskset) to its own host cores / engines CPUs, nothing
                asked: the engine sizes its threads from its affinity, as on the dev cluster,
                whose pod runner pins a container with limits.cpu

Prints requests and output tokens per second over all engines for each layout and the ratio
to every-core. A single engine alone with every core is the yardstick for the total.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack

import httpx
from serve_bench import server


def load(urls: list[str], clients: int, seconds: float, max_tokens: int) -> tuple[int, int]:
    """Closed-loop clients on every URL for `seconds`: (requests, output tokens) answered."""
    done = [0, 0]
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(url: str, index: int) -> None:
        with httpx.Client(timeout=120) as http:
            i = 0
            while time.monotonic() < stop_at:
                answer = http.post(url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"Say hello {index}-{i}"}],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
                answer.raise_for_status()
                with lock:
                    done[0] += 1
                    done[1] += answer.json()["usage"]["completion_tokens"]
                i += 1

    threads = [threading.Thread(target=client, args=(url, n))
               for url in urls for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return done[0], done[1]


def layout(name: str, engine: int, engines: int, cpus: list[int]) -> list[str]:
    """The command of engine number `engine` in `name`."""
    share = max(1, len(cpus) // engines)
    argv = [sys.executable, "-m", "kvfleet", "serve", "--max-num-seqs", "64"]
    if name == "every-core":
        return [*argv, f"--cpu-threads={len(cpus)}"]
    if name == "share":
        return [*argv, f"--cpu-threads={share}"]
    mine = [cpus[(engine * share + i) % len(cpus)] for i in range(share)]
    return ["taskset", "-c", ",".join(map(str, mine)), *argv]


def run(name: str, engines: int, args: argparse.Namespace, cpus: list[int]) -> tuple[int, int]:
    with ExitStack() as stack:
        urls = []
        for engine in range(engines):
            urls.append(stack.enter_context(server(
                layout(name, engine, engines, cpus), f"{name}-{engine}", None)))
        load(urls, args.clients, 3, args.max_tokens)  # warm every engine first
        return load(urls, args.clients, args.seconds, args.max_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--clients", type=int, default=4, help="closed-loop clients per engine")
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    print(f"{len(cpus)} CPUs, {args.engines} engines, {args.clients} clients each, "
          f"{args.max_tokens} output tokens a request, {args.seconds:g} s a layout", flush=True)
    results = {}
    alone = run("every-core", 1, args, cpus)
    print(f"one engine alone, every core: {alone[0] / args.seconds:.1f} req/s "
          f"{alone[1] / args.seconds:.1f} tok/s", flush=True)
    for name in ("every-core", "share", "pinned"):
        results[name] = run(name, args.engines, args, cpus)
        print(f"{name:>10}: {results[name][0] / args.seconds:.1f} req/s "
              f"{results[name][1] / args.seconds:.1f} tok/s over {args.engines} engines",
              flush=True)
    base = results["every-core"][1] or 1
    for name in ("share", "pinned"):
        print(f"{name} / every-core output tokens: {results[name][1] / base:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
