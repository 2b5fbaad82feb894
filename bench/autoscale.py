"""Autoscaling on the dev cluster: one autoscaled pool of real engines (the local node's four
"GPUs"), the router pod, the harness's Prometheus and the operator, under a stepped and then a
spiky load of streaming clients.

Printed per phase: the autoscaler's decisions (its `Scaled` events), the replicas asked for
and Ready, oscillations (the count turning back within the scale-down window), SLO attainment
(requests whose time to first token is within the pool's TTFT SLO) and failed requests.
Written: bench/out/autoscale.png (replicas asked for and Ready, and clients, over time; each
request's TTFT against the SLO).

    .venv/bin/python bench/autoscale.py                 # ~10 min on 2 cores
    .venv/bin/python bench/autoscale.py --quick         # shorter phases, ~6 min
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvfleet.devcluster.cluster import ClusterOptions, DevCluster  # noqa: E402
from kvfleet.devcluster.demo import (  # noqa: E402
    POOL,
    TENANT_KEY,
    install_crds,
    local_pool,
    router_on_node,
    smollm2_revision,
    tenant,
)
from kvfleet.devcluster.kube import KubeClient  # noqa: E402
from kvfleet.devcluster.processes import ManagedProcess  # noqa: E402

NAMESPACE = "bench-autoscale"
INTERVAL_S = 5
DOWN_WINDOW_S = 30
TTFT_SLO_S = 1.5  # the demo pool's spec.slos.ttftP95Seconds
MAX_CLIENTS = 8
AUTOSCALING = {"minReplicas": 1, "maxReplicas": 3, "targetLoad": 2.0,
               "scaleDownStabilizationSeconds": DOWN_WINDOW_S, "sloScaling": True}


@dataclass
class Run:
    started: float = field(default_factory=time.monotonic)
    clients: int = 0  # streaming now
    # (sent at, TTFT or None, answered whole)
    requests: list[tuple[float, float | None, bool]] = field(default_factory=list)
    # (at, replicas asked for, Ready, clients)
    replicas: list[tuple[float, int, int, int]] = field(default_factory=list)
    phases: list[tuple[str, float, float]] = field(default_factory=list)  # name, from, to
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def now(self) -> float:
        return time.monotonic() - self.started


def client(run: Run, url: str, index: int) -> None:
    """Streams one answer after another while `index` is under the clients wanted."""
    body = {"model": POOL, "max_tokens": 32, "stream": True,
            "messages": [{"role": "user", "content": f"Tell me about lighthouse {index}."}]}
    with httpx.Client(timeout=300) as http:
        while not run.stop.is_set():
            if index >= run.clients:
                time.sleep(0.2)
                continue
            sent, ttft, ok = run.now(), None, False
            try:
                with http.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {TENANT_KEY}"}) as resp:
                    for line in resp.iter_lines():
                        if ttft is None and line.startswith("data: {") and '"content"' in line:
                            ttft = run.now() - sent
                        if line == "data: [DONE]":
                            ok = resp.status_code == 200
            except httpx.HTTPError:
                ok = False
            with run.lock:
                run.requests.append((sent, ttft, ok))


def sample(run: Run, kube: KubeClient) -> None:
    while not run.stop.is_set():
        pool = kube.get("ServingPool", POOL, NAMESPACE)
        status = pool.get("status") or {}
        run.replicas.append((run.now(), int(pool["spec"]["replicas"]),
                             int(status.get("readyReplicas", 0)), run.clients))
        run.stop.wait(1.0)


def drive(run: Run, name: str, schedule: list[tuple[float, int]]) -> None:
    """Hold each (seconds, clients) of the schedule in turn."""
    began = run.now()
    print(f"[autoscale] {name}: {schedule}", flush=True)
    for seconds, clients in schedule:
        run.clients = clients
        time.sleep(seconds)
    run.phases.append((name, began, run.now()))


def oscillations(series: list[tuple[float, int, int, int]]) -> int:
    """Times the asked-for count turned back within the scale-down window of its last move."""
    moves: list[tuple[float, int]] = []  # (time, +1 or -1)
    for (_, a, _, _), (t, b, _, _) in itertools.pairwise(series):
        if b != a:
            moves.append((t, 1 if b > a else -1))
    return sum(1 for (t0, d0), (t1, d1) in itertools.pairwise(moves)
               if d1 != d0 and t1 - t0 < DOWN_WINDOW_S)


def report(run: Run, kube: KubeClient) -> None:
    events = [e for e in kube.list("Event", NAMESPACE) if e.get("reason") == "Scaled"]
    print(f"\n[autoscale] {len(events)} decisions:")
    for event in sorted(events, key=lambda e: str(e.get("firstTimestamp") or "")):
        print(f"  {event.get('firstTimestamp')}  {event['message']}")
    print("\n| phase | requests | failed | TTFT ≤ SLO | TTFT p95 s | replicas asked | "
          "replicas Ready | oscillations |")
    print("|---|---|---|---|---|---|---|---|")
    for name, begin, end in run.phases:
        done = [r for r in run.requests if begin <= r[0] < end]
        ttfts = sorted(r[1] for r in done if r[1] is not None)
        within = sum(t <= TTFT_SLO_S for t in ttfts) / max(len(ttfts), 1)
        p95 = ttfts[int(0.95 * (len(ttfts) - 1))] if ttfts else float("nan")
        series = [s for s in run.replicas if begin <= s[0] < end]
        asked = sorted({s[1] for s in series})
        ready = sorted({s[2] for s in series})
        print(f"| {name} | {len(done)} | {sum(not r[2] for r in done)} | {within:.1%} | "
              f"{p95:.2f} | {asked[0]}-{asked[-1]} | {ready[0]}-{ready[-1]} | "
              f"{oscillations(series)} |")


def plot(run: Run) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    t = [s[0] for s in run.replicas]
    top.step(t, [s[1] for s in run.replicas], where="post", label="replicas asked for")
    top.step(t, [s[2] for s in run.replicas], where="post", label="replicas Ready")
    top.step(t, [s[3] for s in run.replicas], where="post", label="clients streaming",
             alpha=0.5, linestyle="--")
    for name, begin, _ in run.phases:
        top.axvline(begin, color="grey", alpha=0.3)
        top.text(begin + 2, MAX_CLIENTS - 0.5, name, fontsize=8)
    top.set_ylabel("count")
    top.legend(fontsize=8, loc="upper right")
    top.grid(alpha=0.3)
    good = [(r[0], r[1]) for r in run.requests if r[1] is not None and r[2]]
    bad = [r[0] for r in run.requests if not r[2]]
    bottom.scatter([g[0] for g in good], [g[1] for g in good], s=4, label="TTFT")
    if bad:
        bottom.scatter(bad, [TTFT_SLO_S] * len(bad), s=12, marker="x", color="red",
                       label="failed")
    bottom.axhline(TTFT_SLO_S, color="red", alpha=0.4, label="TTFT SLO")
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds")
    bottom.set_ylabel("time to first token (s)")
    bottom.legend(fontsize=8, loc="upper right")
    bottom.grid(alpha=0.3)
    fig.suptitle("Autoscaling: a stepped, then a spiky load (SmolLM2, local engines)")
    fig.tight_layout()
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    path = out / "autoscale.png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases")
    args = parser.parse_args()
    k = 0.6 if args.quick else 1.0
    stepped = [(45 * k, 1), (75 * k, 4), (75 * k, 8), (45 * k, 2), (75 * k, 0)]
    spiky = [(10, 8), (25 * k, 1)] * 4 + [(60 * k, 1)]
    with DevCluster(ClusterOptions(node_groups=())) as cluster:
        kube = cluster.api
        assert cluster.prometheus is not None
        install_crds(kube)
        kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        cluster.processes.append(ManagedProcess(
            "operator", [sys.executable, "-m", "kvfleet", "operator", "--all-namespaces",
                         "--standalone", "--metrics-port", "0",
                         "--autoscale-interval", str(INTERVAL_S)],
            cluster.workdir / "operator.log",
            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
                 "KVFLEET_PROMETHEUS_URL": cluster.prometheus.url}))
        kube.create(smollm2_revision("smol", 40, NAMESPACE))
        tenant(kube, NAMESPACE)
        pool = local_pool(POOL, "smol", NAMESPACE)
        pool["spec"]["autoscaling"] = AUTOSCALING
        kube.create(pool)
        print("[autoscale] waiting for the first replica and the router", flush=True)
        kube.wait_for("the first replica Ready", lambda: int((kube.get(
            "ServingPool", POOL, NAMESPACE).get("status") or {}).get("readyReplicas", 0))
            or None, 300)
        url = router_on_node(kube, NAMESPACE, cluster.local_node_names[0])
        run = Run()
        threads = [threading.Thread(target=client, args=(run, url, i), daemon=True)
                   for i in range(MAX_CLIENTS)]
        threads.append(threading.Thread(target=sample, args=(run, kube), daemon=True))
        for thread in threads:
            thread.start()
        try:
            drive(run, "stepped", stepped)
            drive(run, "spiky", spiky)
        finally:
            run.stop.set()
            for thread in threads:
                thread.join(300)
        report(run, kube)
        plot(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
