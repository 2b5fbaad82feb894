"""Prefix-aware replica choice against round-robin, on two real engine replicas.

    .venv/bin/python bench/router_prefix.py [--tenants 4] [--requests 16] [--prefix-words 500]
                                            [--kv-mib 96] [--order random|rotation]

Two `kvfleet serve` replicas (the embedded SmolLM2, prefix cache on, 1 thread each) behind a
real `kvfleet router --config`, once with `--pick affinity` (the default: load, then
rendezvous hashing of tenant and prompt prefix) and once with `--pick round-robin`, each run on
fresh engines. The workload is multi-tenant and shared-prefix: each tenant has its own long
system prompt that all its requests share, followed by a short question; tenants arrive in a
seeded random order (`--order rotation`: strictly in turn), two requests in flight, 1 output
token each. Prints the prefix-cache hit rate (the engines'
own counters: prompt tokens found cached / looked up) and TTFT p50 / p90 of both runs and the
ratios; writes `bench/out/router_prefix.png` (TTFT CDFs).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import latency_plot
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from engine_server import free_port, running_kvfleet, running_server  # noqa: E402

REVISION = "e" * 64
KEY = "sk-bench-0123456789abcdef0123"
WORDS = ("cluster", "node", "pod", "replica", "tenant", "quota", "budget", "token", "cache",
         "prefix", "block", "model", "revision", "canary", "shadow", "rollout", "latency",
         "throughput", "scheduler", "batch")


def workload(tenants: int, requests: int, prefix_words: int, order: str = "random"
             ) -> list[tuple[str, str]]:
    """Each tenant's `requests` questions under its own long prefix. `random`: tenants arrive
    in a seeded random order (as independent clients do); `rotation`: strictly in turn, t0 t1
    ... t0 t1 ..., a lock-step that round-robin over an even number of replicas happens to
    partition perfectly (every tenant always lands on the same replica)."""
    rng = random.Random(0)
    prompts = {f"t{i}": " ".join(rng.choice(WORDS) for _ in range(prefix_words))
               for i in range(tenants)}
    sequence = []
    for r in range(requests):
        for tenant, prefix in prompts.items():
            sequence.append((tenant, f"{prefix}\nQuestion {r}: which word comes first?"))
    if order == "random":
        rng.shuffle(sequence)
    return sequence


async def run(url: str, order: list[tuple[str, str]]) -> list[float]:
    ttfts: list[float] = []
    queue = list(order)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            tenant, prompt = queue.pop(0)
            started = time.perf_counter()
            resp = await client.post(url, headers={"authorization": f"Bearer {KEY}-{tenant}"},
                                     json={"model": "pool", "max_tokens": 1,
                                           "messages": [{"role": "system", "content": prompt}]})
            resp.raise_for_status()
            ttfts.append(time.perf_counter() - started)

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(worker(client), worker(client))
    return ttfts


def counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("kvfleet_engine_prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("kvfleet_engine_prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def one_policy(policy: str, order: list[tuple[str, str]], tenants: int, kv_mib: int
               ) -> tuple[list[float], float]:
    flags = ("--kv-cache-memory-mib", str(kv_mib))
    with running_server(*flags, torch_threads=1) as a, \
            running_server(*flags, torch_threads=1) as b, \
            tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as tmp:
        config = Path(tmp) / "router.yaml"
        config.write_text(yaml.safe_dump({
            "pools": [{"name": "pool", "status": {"servingRevision": REVISION},
                       "endpoints": {REVISION: [a.base_url[7:], b.base_url[7:]]}}],
            "tenants": [{"tenant": f"t{i}", "keys": [f"{KEY}-t{i}"], "quota": {}}
                        for i in range(tenants)]}))
        port = free_port()
        with running_kvfleet("router", "--config", str(config), "--port", str(port),
                             "--metrics-port", str(free_port()), "--pick", policy,
                             "--log-level", "warning", port=port, ready_timeout=60):
            time.sleep(0.5)
            before = counters([a.base_url, b.base_url])
            ttfts = asyncio.run(run(f"http://127.0.0.1:{port}/v1/chat/completions", order))
            after = counters([a.base_url, b.base_url])
    hit_rate = (after[0] - before[0]) / max(1.0, after[1] - before[1])
    return ttfts, hit_rate


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16, help="per tenant")
    parser.add_argument("--prefix-words", type=int, default=500)
    parser.add_argument("--order", choices=["random", "rotation"], default="random",
                        help="tenants' arrival order (see workload())")
    parser.add_argument("--kv-mib", type=int, default=96,
                        help="each replica's KV cache (SmolLM2: ~46 KB a token)")
    args = parser.parse_args()
    order = workload(args.tenants, args.requests, args.prefix_words, args.order)
    results = {}
    for policy in ("affinity", "round-robin"):
        print(f"{policy}: {len(order)} requests ...", flush=True)
        results[policy] = one_policy(policy, order, args.tenants, args.kv_mib)
    (aff, aff_hits), (rr, rr_hits) = results["affinity"], results["round-robin"]
    print(f"{'':12s} {'hit rate':>9s} {'TTFT p50':>9s} {'TTFT p90':>9s}")
    for name, (ttfts, hits) in results.items():
        print(f"{name:12s} {hits:9.1%} {pct(ttfts, .5) * 1e3:7.0f}ms {pct(ttfts, .9) * 1e3:7.0f}ms")
    print(f"affinity - round-robin: hit rate {aff_hits - rr_hits:+.1%}; TTFT p50 "
          f"{pct(aff, .5) / pct(rr, .5):.2f}x, p90 {pct(aff, .9) / pct(rr, .9):.2f}x")
    plot(results)
    return 0


def plot(results: dict[str, tuple[list[float], float]]) -> None:
    latency_plot.write_cdfs(
        [(f"{name} (prefix-cache hit rate {hits:.0%})", [t * 1e3 for t in ttfts], "-")
         for name, (ttfts, hits) in results.items()],
        "TTFT (ms, log)", "Replica choice on 2 real replicas: prefix affinity vs round-robin",
        "router_prefix.png")


if __name__ == "__main__":
    raise SystemExit(main())
