"""Operator scale benchmark: N ServingPools over 2N fake GPU nodes on the real control plane.

For each N (default 10 and 100; `--pools 10 100 1000` for the full run) a fresh harness cluster
(etcd, kube-apiserver, controller-manager, scheduler, KWOK) gets 2N single-GPU L4 KWOK nodes,
one ModelArtifact and N one-replica ServingPools, with `kvfleet operator` running as a
subprocess. KWOK's node leases are longer at large N (`node_lease_seconds_for`: ~20
renewals/s), with a matching controller-manager node-monitor grace period. Measured per N:

  converge_s            first pool created -> every pool Available=True
  operator_done_s       first pool created -> the operator has applied every Deployment (its own
                        part; the rest is controller-manager, scheduler and KWOK)
  reconcile p50/p95     histogram_quantile over the operator's own duration histogram
  requests/reconcile    operator apiserver requests / reconciles during convergence (and the
                        GETs among them: reads come from the watch-fed cache); the watches'
                        own lists and streams (kopf's and the informers') are not counted
  steady req/reconcile  the same over one drift interval after convergence (writes must be 0)
  rss_mb                operator peak resident memory (and, while it runs, RSS over time)
  apiserver write p95   the apiserver's own time for the operator's writes (its
                        apiserver_request_duration_seconds: applies and pool status patches)
  loop lag p95/p99      how late the operator's event loop ran a 0.25 s timer: its own stalls
  full GCs, full GC s   the operator's generation-2 collections, and the seconds they stopped it
  the per-pool ratios against the smallest N, which show whether cost grows linearly

With `--autoscale` every pool has spec.autoscaling and the operator reads its signals every
`--autoscale-interval` from an in-process stand-in for Prometheus (each pool's one engine runs
one request; the real Prometheus and engines are e2e/test_autoscale_e2e.py's). Right after the
creates, while the burst's reconciles queue, one pool's load steps to 6 running requests
(3 replicas at targetLoad 2). Also measured then:

  step_s                the load step -> that pool's Deployment asks for 3 replicas (the
                        decision and its reconcile, ahead of the burst in the urgent lane)
  queries/interval      Prometheus queries the operator sent per autoscaling interval (1: one
                        query for the whole fleet)
  urgent queue p95      the urgent lane's wait for a reconcile slot (the burst's: queue p95)

    .venv/bin/python bench/operator_scale.py --pools 10 100          # ~3 min on 2 cores
    .venv/bin/python bench/operator_scale.py --pools 10 100 1000     # the issue's full run
    .venv/bin/python bench/operator_scale.py --pools 1000 5000 --autoscale

Pools Available are counted from one watch, not a LIST a second (at 5,000 pools a 10.7 MB
LIST loaded the apiserver being measured). Where the operator's memory goes:
KVFLEET_BENCH_MALLOCSTATS=DIR records pymalloc's and glibc's shares and a census of objects by
type every KVFLEET_BENCH_TRACEMALLOC_TICK s, without tracing; KVFLEET_BENCH_TRACEMALLOC=DIR
traces (KVFLEET_BENCH_TRACEMALLOC_FRAMES deep) and dumps snapshots; KVFLEET_BENCH_PROFILE=DIR
runs cProfile.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvfleet.api.builders import make_artifact, make_pool  # noqa: E402
from kvfleet.api.labels import POOL_LABEL  # noqa: E402
from kvfleet.devcluster import cluster as devcluster_module  # noqa: E402
from kvfleet.devcluster import fleet  # noqa: E402
from kvfleet.devcluster.cluster import (  # noqa: E402
    ClusterOptions,
    DevCluster,
    node_lease_seconds_for,
)
from kvfleet.devcluster.errors import KubeApiError  # noqa: E402
from kvfleet.devcluster.kube import KubeClient  # noqa: E402
from kvfleet.kube.api import path_of  # noqa: E402

NAMESPACE = "bench"
# Every pool has a ClusterIP Service; the harness's /24 service range holds only 254 of them,
# so the benchmark's clusters get a /16 (an allocation range only: no traffic goes there).
BENCH_SERVICE_CIDR = "10.0.0.0/16"


def _die_with_parent() -> None:
    """In the child: SIGTERM when the parent dies, so a killed run leaves no operator behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


@dataclass
class Result:
    pools: int
    nodes: int
    available: int  # pools Available at the end (== pools unless the run timed out)
    converge_s: float
    operator_done_s: float
    rss_mb: float
    operator_cpu_s: float
    # From the operator's metrics (`_result`):
    reconciles: int = 0
    reconcile_p50_s: float = float("nan")
    reconcile_p95_s: float = float("nan")
    queue_p95_s: float = float("nan")  # waiting for a reconcile slot, outside the duration
    requests_per_reconcile: float = float("nan")
    gets_per_reconcile: float = float("nan")
    requests_per_pool: float = float("nan")
    steady_p50_s: float = float("nan")
    steady_p95_s: float = float("nan")
    steady_requests_per_reconcile: float = float("nan")
    steady_writes: int = 0
    step_s: float = float("nan")
    queries_per_interval: float = float("nan")
    urgent_queue_p95_s: float = float("nan")
    # Where a slow reconcile's time went: the apiserver's own time for the operator's writes,
    # and the operator's event loop running late (its own CPU, not the apiserver).
    apiserver_write_p95_s: float = float("nan")
    loop_lag_p95_s: float = float("nan")
    loop_lag_p99_s: float = float("nan")
    gc_full_s: float = float("nan")  # the operator's full (generation 2) collections: seconds
    gc_full_count: int = 0


STEP_POOL, STEP_LOAD, STEP_REPLICAS = "pool-0000", 6.0, 3
AUTOSCALING = {"minReplicas": 1, "maxReplicas": 4, "targetLoad": 2.0}


class FakePrometheus:
    """The answer to the autoscaler's fleet query, from memory: per pool one engine pod
    running `loads[pool]` requests, and a router reporting it. Counts those queries."""

    def __init__(self, pools: list[str]) -> None:
        self.loads = dict.fromkeys(pools, 1.0)
        self.queries = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                query = self.rfile.read(int(self.headers.get("content-length", 0)))
                # The autoscaler's query (the operator's other one, KV blocks, finds nothing).
                signals = b"kvfleet_router_held_requests" in query
                fake.queries += signals
                body = json.dumps(fake.answer() if signals else {
                    "status": "success", "data": {"resultType": "vector", "result": []}}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self) -> dict[str, object]:
        now = time.time()
        rows: list[dict[str, object]] = []

        def row(labels: dict[str, str], value: float) -> None:
            rows.append({"metric": {"namespace": NAMESPACE, **labels},
                         "value": [now, str(value)]})

        for pool, load in list(self.loads.items()):
            engine = {"kvfleet_io_pool": pool, "pod": f"{pool}-0"}
            row({**engine, "__name__": "kvfleet_engine_requests_running"}, load)
            row({**engine, "__name__": "kvfleet_engine_requests_waiting"}, 0.0)
            row({**engine, "__name__": "kvfleet_engine_kv_cache_usage_ratio"}, 0.1)
            row({"kvfleet_io_pool": pool, "signal": "engines_at"}, now)
            row({"pool": pool, "signal": "routers_at"}, now)
            row({"pool": pool, "signal": "last_request"}, now)
        return {"status": "success", "data": {"resultType": "vector", "result": rows}}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _step_to_deployment(kube: KubeClient, fake: FakePrometheus, timeout_s: float) -> float:
    """Step one pool's load; seconds until its Deployment asks for the replicas it needs."""
    fake.loads[STEP_POOL] = STEP_LOAD
    started = time.monotonic()
    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments?labelSelector={POOL_LABEL}%3D"
    while time.monotonic() - started < timeout_s:
        items = kube.request("GET", path + STEP_POOL).get("items") or []
        if any(d["spec"].get("replicas") == STEP_REPLICAS for d in items):
            return time.monotonic() - started
        time.sleep(0.25)
    return float("nan")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _scrape(port: int) -> dict[str, float]:
    """Operator metrics as {'name{labels}': value} (the text format, no client library)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvfleet_operator_"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def _total(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(prefix))


def _quantile(
    samples: dict[str, float], q: float, metric: str = "reconcile_duration_seconds",
    lane: str | None = None, kind: str | None = "ServingPool",
) -> float:
    """PromQL histogram_quantile over the ServingPool buckets of an operator histogram (of
    one lane, for the queue wait; of no kind, for the loop lag)."""
    prefix = (f"kvfleet_operator_{metric}_bucket{{" + (f'kind="{kind}",' if kind else "")
              + (f'lane="{lane}",' if lane else "") + 'le="')
    return _histogram_quantile(
        ((float(k[len(prefix):-2]), v) for k, v in samples.items() if k.startswith(prefix)), q)


def _histogram_quantile(buckets_: Iterable[tuple[float, float]], q: float) -> float:
    """histogram_quantile over (upper bound, cumulative count) pairs (+Inf as inf)."""
    buckets = sorted(buckets_)
    total = buckets[-1][1] if buckets else 0
    if total == 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = upper, count
    return lower


# The operator's writes as the apiserver timed them: its applies (nobody else in the
# benchmark applies) and the pools' status patches.
_OPERATOR_WRITES = re.compile(
    r'apiserver_request_duration_seconds_bucket\{(?=[^}]*verb="APPLY"|[^}]*resource='
    r'"servingpools",[^}]*subresource="status",[^}]*verb="PATCH")[^}]*le="([^"]+)"\} (\S+)')


def _apiserver_writes(kube: KubeClient) -> dict[float, float]:
    """Cumulative counts by upper bound of the operator's writes in the apiserver's own
    request-duration histogram (summed over kinds)."""
    counts: dict[float, float] = {}
    for bound, value in _OPERATOR_WRITES.findall(kube.get_raw("/metrics").text):
        counts[float(bound)] = counts.get(float(bound), 0.0) + float(value)
    return counts


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _is_available(pool: dict[str, Any]) -> bool:
    return any(c["type"] == "Available" and c["status"] == "True"
               for c in (pool.get("status") or {}).get("conditions", []))


def _available(kube: KubeClient) -> int:
    pools = kube.request("GET", path_of("ServingPool", NAMESPACE)).get("items", [])
    return sum(1 for p in pools if _is_available(p))


class AvailableWatch:
    """How many pools are Available, from one watch of the bench's ServingPools.

    Polling a LIST once a second loaded the very apiserver the operator is measured against:
    at 5,000 pools each LIST was 10.7 MB of JSON, took 1.7-3.5 s on the saturated apiserver
    and 0.5 s of this process's CPU to parse, back to back. A watch sends each change once.
    """

    def __init__(self, kube: KubeClient) -> None:
        self._kube = KubeClient(kube.credentials)  # (its own connection, for this thread)
        self._available: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def count(self) -> int:
        if not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError("the watch of the pools died (its traceback is above)")
        return len(self._available)

    def close(self) -> None:
        self._stop.set()
        self._kube.close()

    def _run(self) -> None:
        path = path_of("ServingPool", NAMESPACE)
        while not self._stop.is_set():
            try:
                listing = self._kube.request("GET", path)
                self._available = {p["metadata"]["name"] for p in listing.get("items", [])
                                   if _is_available(p)}
                version = listing["metadata"]["resourceVersion"]
                while not self._stop.is_set():
                    for event in self._kube.watch(path, version):
                        if event["type"] == "ERROR":  # 410: compacted, list again
                            raise KubeApiError("WATCH", path, 410, "Expired", str(event))
                        obj = event["object"]
                        version = obj["metadata"]["resourceVersion"]
                        if event["type"] == "BOOKMARK":
                            continue
                        name = obj["metadata"]["name"]
                        if event["type"] != "DELETED" and _is_available(obj):
                            self._available.add(name)
                        else:
                            self._available.discard(name)
            except (KubeApiError, httpx.HTTPError, ValueError) as error:
                if not self._stop.is_set():  # (said each time: a count that froze says why)
                    print(f"pool watch: {error}; listing again", flush=True)
                    self._stop.wait(1)


def run_one(
    num_pools: int, nodes_per_pool: int, drift_s: float, timeout_s: float, max_concurrent: int,
    autoscale_s: float | None = None,
) -> Result:
    num_nodes = nodes_per_pool * num_pools
    options = ClusterOptions(
        node_groups=(fleet.NodeGroup(fleet.L4, count=num_nodes, gpus_per_node=1),),
        local_nodes=0,
        prometheus=False,
        startup_timeout=max(90.0, num_nodes * 0.2),
        # 2,000 nodes renewing Kubernetes' 40 s leases (200 renewals/s) fell behind on the
        # shared 2 cores and the node controller marked nodes NotReady mid-run; longer leases
        # (and, with them, a longer node-monitor grace period) keep ~20 renewals/s at any N.
        node_lease_seconds=node_lease_seconds_for(num_nodes),
    )
    print(
        f"[{num_pools} pools] starting cluster with {num_nodes} KWOK L4 nodes "
        f"(node lease {options.node_lease_seconds} s)",
        flush=True,
    )
    with DevCluster(options) as cluster:
        kube = cluster.api
        _apply_crds(kube)
        kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        port = _free_port()
        log = (cluster.workdir / "operator.log").open("wb")
        names = [f"pool-{i:04d}" for i in range(num_pools)]
        fake = FakePrometheus(names) if autoscale_s is not None else None
        autoscaling = [] if fake is None else [
            "--prometheus-url", fake.url, "--autoscale-interval", str(autoscale_s)]
        operator = subprocess.Popen(
            [sys.executable, *_profiler(num_pools), *_module(), "operator", "-A",
             "--standalone", "--quiet", "--metrics-port", str(port),
             "--metrics-address", "127.0.0.1",
             "--drift-interval", str(drift_s),
             "--max-concurrent-reconciles", str(max_concurrent), *autoscaling],
            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONPATH": str(ROOT)},
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        sampler = ProcessSampler(operator.pid)
        closing: list[Callable[[], None]] = [sampler.close]
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    before = _scrape(port)
                    break
                except OSError:
                    if time.monotonic() > deadline or operator.poll() is not None:
                        tail = (cluster.workdir / "operator.log").read_text()[-3000:]
                        raise RuntimeError(f"operator did not start:\n{tail}") from None
                    time.sleep(0.5)
            artifact = make_artifact("qwen3-8b", NAMESPACE).data()
            kube.request("POST", path_of("ModelArtifact", NAMESPACE), artifact)
            pools = [make_pool(name, "qwen3-8b", NAMESPACE).data() for name in names]
            if fake is not None:
                for p in pools:
                    p["spec"]["autoscaling"] = AUTOSCALING
            watch = AvailableWatch(kube)
            closing.append(watch.close)
            writes_before = _apiserver_writes(kube)
            started = time.monotonic()
            with ThreadPoolExecutor(8) as pool_exec:
                list(pool_exec.map(
                    lambda p: kube.request("POST", path_of("ServingPool", NAMESPACE), p), pools
                ))  # fmt: skip
            print(f"[{num_pools} pools] created in {time.monotonic() - started:.1f}s", flush=True)
            step_s, queries_per_interval = float("nan"), float("nan")
            if fake is not None and autoscale_s is not None:
                # The step, while the burst's reconciles queue (the creates just returned).
                asked_from, queries_from = time.monotonic(), fake.queries
                step_s = _step_to_deployment(kube, fake, 10 * autoscale_s)
                print(f"[{num_pools} pools] load step on {STEP_POOL} -> its Deployment at "
                      f"{STEP_REPLICAS} replicas in {step_s:.1f} s "
                      f"({watch.count()} pools Available meanwhile)", flush=True)
            operator_done = _wait_available(num_pools, watch, port, started, timeout_s, sampler)
            converge = time.monotonic() - started
            if fake is not None and autoscale_s is not None:
                intervals = (time.monotonic() - asked_from) / autoscale_s
                queries_per_interval = (fake.queries - queries_from) / max(intervals, 1e-9)
            num_available = _available(kube)  # (the watch's count, checked once)
            if operator_done != operator_done:  # NaN: not seen before the end
                operator_done = converge
            converged = _scrape(port)
            writes_after = _apiserver_writes(kube)
            steady: dict[str, float] = {}  # no steady state to measure after a timeout
            if num_available == num_pools:
                time.sleep(drift_s + 5)  # one drift tick over every pool
                steady = _delta(_scrape(port), converged)
        finally:
            for close in closing:
                close()
            if fake is not None:
                fake.close()
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(30)
            except subprocess.TimeoutExpired:
                operator.kill()
                operator.wait(10)
            log.close()
    return _result(
        Result(pools=num_pools, nodes=num_nodes, available=num_available,
               converge_s=round(converge, 2), operator_done_s=round(operator_done, 2),
               rss_mb=round(sampler.peak / 2**20, 1), operator_cpu_s=round(sampler.cpu_s, 1),
               step_s=round(step_s, 2), queries_per_interval=round(queries_per_interval, 2),
               apiserver_write_p95_s=round(_histogram_quantile(
                   ((b, v - writes_before.get(b, 0.0)) for b, v in writes_after.items()),
                   0.95), 4)),
        _delta(converged, before), steady)


class ProcessSampler:
    """The operator's resident memory (now, and its peak and when) and CPU seconds, sampled
    every 0.5 s on a thread of its own."""

    def __init__(self, pid: int) -> None:
        self.current = self.peak = 0
        self.peak_at, self.cpu_s = 0.0, 0.0
        self._process = psutil.Process(pid)
        self._born = time.monotonic()
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.current = self._process.memory_info().rss
                if self.current > self.peak:
                    self.peak, self.peak_at = self.current, time.monotonic() - self._born
                times = self._process.cpu_times()
                self.cpu_s = times.user + times.system
            except psutil.Error:
                return
            self._stop.wait(0.5)


def _wait_available(num_pools: int, watch: AvailableWatch, port: int, started: float,
                    timeout_s: float, sampler: ProcessSampler) -> float:
    """Until every pool is Available or `timeout_s` passed, with progress every 10 s; when
    the operator had applied every Deployment (s after `started`; NaN: not seen)."""
    last_print = last_scrape = 0.0
    deployments = 0  # the operator's Deployments applied so far
    operator_done = float("nan")
    while (done := watch.count()) < num_pools:
        now = time.monotonic()
        # Scraped every 5 s, as a busy Prometheus would: at 5,000 pools /metrics is 0.8 MB of
        # the operator's CPU.
        if operator_done != operator_done and now - last_scrape >= 5:
            last_scrape = now
            deployments = int(_scrape(port).get(
                'kvfleet_operator_objects_applied_total{kind="Deployment"}', 0.0))
            if deployments >= num_pools:
                operator_done = now - started
        if now - started > timeout_s:
            print(f"[{num_pools} pools] timed out: {done} Available after {timeout_s:.0f}s; "
                  "recording what was measured", flush=True)
            break
        if now - last_print > 10:
            # (RSS over time: whether the peak is the burst or the cache growing)
            print(f"[{num_pools} pools] {done} Available at {now - started:.0f}s, "
                  f"{deployments} Deployments applied, "
                  f"operator RSS {sampler.current / 2**20:.0f} MB "
                  f"(peak {sampler.peak / 2**20:.0f} at {sampler.peak_at:.0f} s)", flush=True)
            last_print = now
        time.sleep(1)
    return operator_done


def _result(measured: Result, window: dict[str, float], steady: dict[str, float]) -> Result:
    """`measured` completed with what the operator's metrics say over the run (`window`) and
    over one drift interval after it (`steady`; empty after a timeout)."""
    reconciles = _total(window, 'kvfleet_operator_reconciles_total{kind="ServingPool"')
    reconciles += _total(window, 'kvfleet_operator_reconciles_total{kind="ModelArtifact"')
    requests = _total(window, "kvfleet_operator_apiserver_requests_total")
    gets = _total(window, 'kvfleet_operator_apiserver_requests_total{verb="GET"')
    steady_reconciles = _total(steady, "kvfleet_operator_reconciles_total")
    steady_requests = _total(steady, "kvfleet_operator_apiserver_requests_total")
    writes = steady_requests - _total(
        steady, 'kvfleet_operator_apiserver_requests_total{verb="GET"'
    )
    return replace(
        measured,
        reconciles=int(reconciles),
        reconcile_p50_s=round(_quantile(window, 0.50), 4),
        reconcile_p95_s=round(_quantile(window, 0.95), 4),
        queue_p95_s=round(_quantile(window, 0.95, "reconcile_queue_seconds", "bulk"), 4),
        requests_per_reconcile=round(requests / max(reconciles, 1), 2),
        gets_per_reconcile=round(gets / max(reconciles, 1), 2),
        requests_per_pool=round(requests / measured.pools, 2),
        steady_p50_s=round(_quantile(steady, 0.50), 4),
        steady_p95_s=round(_quantile(steady, 0.95), 4),
        steady_requests_per_reconcile=round(steady_requests / max(steady_reconciles, 1), 2),
        steady_writes=int(writes),
        urgent_queue_p95_s=round(_quantile(window, 0.95, "reconcile_queue_seconds", "urgent"), 4),
        loop_lag_p95_s=round(_quantile(window, 0.95, "event_loop_lag_seconds", kind=None), 4),
        loop_lag_p99_s=round(_quantile(window, 0.99, "event_loop_lag_seconds", kind=None), 4),
        gc_full_s=round(window.get(
            'kvfleet_operator_gc_pause_seconds_sum{generation="2"}', 0.0), 2),
        gc_full_count=int(window.get(
            'kvfleet_operator_gc_pause_seconds_count{generation="2"}', 0.0)),
    )


def _profiler(num_pools: int) -> list[str]:
    """`-m cProfile -o FILE` when KVFLEET_BENCH_PROFILE names a folder (to see where CPU goes);
    the tracemalloc wrapper below when KVFLEET_BENCH_TRACEMALLOC does (where memory goes)."""
    folder = os.environ.get("KVFLEET_BENCH_PROFILE")
    if folder:
        return ["-m", "cProfile", "-o", f"{folder}/operator-{num_pools}.prof"]
    for variable, wrapper in (("KVFLEET_BENCH_TRACEMALLOC", _TRACEMALLOC_WRAPPER),
                              ("KVFLEET_BENCH_MALLOCSTATS", _MALLOCSTATS_WRAPPER)):
        folder = os.environ.get(variable)
        if folder:
            return ["-c", wrapper, f"{folder}/operator-{num_pools}", "--"]
    return []


def _module() -> list[str]:
    """How the operator's command line starts: a memory wrapper takes the arguments."""
    wrapped = not os.environ.get("KVFLEET_BENCH_PROFILE") and (
        os.environ.get("KVFLEET_BENCH_TRACEMALLOC") or os.environ.get("KVFLEET_BENCH_MALLOCSTATS"))
    return [] if wrapped else ["-m", "kvfleet"]


# Runs `python -m kvfleet ARGS` under tracemalloc and, every 15 s, records the traced and
# resident memory; whenever the traced memory reached a new high it dumps a snapshot
# (PREFIX-peak-SECONDSs.snap: two of them compared show what grew), and one more at exit
# (PREFIX-end.snap). Snapshots pause the operator
# for a moment: the timings of such a run are not comparable with a plain one.
_TRACEMALLOC_WRAPPER = """
import atexit, json, os, runpy, sys, threading, time, tracemalloc
import psutil
prefix = sys.argv[1]
sys.argv = ["kvfleet", *sys.argv[3:]]
tracemalloc.start(int(os.environ.get("KVFLEET_BENCH_TRACEMALLOC_FRAMES", "8")))
high, born = [0], time.monotonic()
log = open(prefix + "-memory.jsonl", "a")
def record(tag):
    current, peak = tracemalloc.get_traced_memory()
    rss = psutil.Process().memory_info().rss
    log.write(json.dumps({"t": time.time(), "tag": tag, "traced": current, "traced_peak": peak,
                          "rss": rss, "threads": threading.active_count()}) + "\\n")
    log.flush()
    if tag == "end" or current > high[0]:
        high[0] = current
        name = "-end" if tag == "end" else f"-peak-{time.monotonic() - born:.0f}s"
        tracemalloc.take_snapshot().dump(prefix + name + ".snap")
def watch():
    while True:
        time.sleep(float(os.environ.get("KVFLEET_BENCH_TRACEMALLOC_TICK", "15")))
        record("tick")
threading.Thread(target=watch, daemon=True).start()
atexit.register(record, "end")
runpy.run_module("kvfleet", run_name="__main__", alter_sys=True)
"""

# Runs `python -m kvfleet ARGS` and, every KVFLEET_BENCH_TRACEMALLOC_TICK (15) s, records who
# holds the resident memory, without tracing (which slows the operator and inflates it):
# pymalloc's arenas and the bytes in their live blocks (sys._debugmallocstats, Python objects of
# 512 bytes or less), and glibc's heap, its free part and its mmapped chunks (mallinfo2: larger
# Python objects and C libraries' buffers), and a census of the objects the GC tracks, by type
# (coroutines by function). PREFIX-malloc.jsonl, one line per tick.
_MALLOCSTATS_WRAPPER = """
import collections, ctypes, gc, json, os, re, runpy, sys, tempfile, threading, time
import psutil
prefix = sys.argv[1]
sys.argv = ["kvfleet", *sys.argv[3:]]
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks "
                                               "fsmblks uordblks fordblks keepcost").split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
log = open(prefix + "-malloc.jsonl", "a")
def pymalloc():
    with tempfile.TemporaryFile("w+") as out:
        saved = os.dup(2)
        os.dup2(out.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read()
    def field(label):
        found = re.search(re.escape(label) + r"\\s*=\\s*([\\d,]+)", text)
        return int(found.group(1).replace(",", "")) if found else None
    return {"arenas": field("# arenas allocated current"),
            "allocated_blocks": field("# bytes in allocated blocks"),
            "free_blocks": field("# bytes in available blocks"),
            "total": field("Total")}
def census():
    # The most numerous objects the GC tracks, coroutines by their function's name: a pile of
    # waiting tasks shows here by what they wait in.
    counts = collections.Counter(
        f"coroutine {o.__qualname__}" if type(o).__name__ == "coroutine" else type(o).__name__
        for o in gc.get_objects())
    return dict(counts.most_common(25))
def record():
    info = libc.mallinfo2()
    log.write(json.dumps({"t": time.time(), "rss": psutil.Process().memory_info().rss,
                          "glibc_heap": info.arena, "glibc_in_use": info.uordblks,
                          "glibc_free": info.fordblks, "glibc_mmapped": info.hblkhd,
                          "pymalloc": pymalloc(), "census": census()}) + "\\n")
    log.flush()
def watch():
    while True:
        time.sleep(float(os.environ.get("KVFLEET_BENCH_TRACEMALLOC_TICK", "15")))
        record()
threading.Thread(target=watch, daemon=True).start()
runpy.run_module("kvfleet", run_name="__main__", alter_sys=True)
"""


def _apply_crds(kube: KubeClient) -> None:
    crd_path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    names = []
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        kube.request("POST", crd_path, crd)
        names.append(crd["metadata"]["name"])

    def established(name: str) -> bool | None:
        crd = kube.request("GET", f"{crd_path}/{name}")
        conditions = (crd.get("status") or {}).get("conditions") or []
        ok = any(c["type"] == "Established" and c["status"] == "True" for c in conditions)
        return True if ok else None

    for name in names:
        kube.wait_for(f"CRD {name} established", lambda: established(name), 60)  # noqa: B023


def main() -> int:
    # A SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the cluster and operator stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    devcluster_module.SERVICE_CIDR = BENCH_SERVICE_CIDR
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--nodes-per-pool", type=int, default=2)
    parser.add_argument("--drift-interval", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="per N, seconds")
    parser.add_argument("--max-concurrent-reconciles", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--autoscale", action="store_true",
                        help="every pool autoscaled; a load step on one during the burst")
    parser.add_argument("--autoscale-interval", type=float, default=15.0)
    args = parser.parse_args()
    results: list[Result] = []
    for n in args.pools:
        results.append(
            run_one(
                n,
                args.nodes_per_pool,
                args.drift_interval,
                args.timeout,
                args.max_concurrent_reconciles,
                args.autoscale_interval if args.autoscale else None,
            )
        )
        _print_table(results)
        if args.json is not None:
            args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


def _print_table(results: list[Result]) -> None:
    base = results[0]
    print()
    print(
        "| pools | nodes | Available | converge s | operator done s | s/pool | reconciles "
        "| p50 s | p95 s | queue p95 s | req/reconcile | GET/reconcile | req/pool "
        "| steady p50 s | steady p95 s "
        "| steady req/reconcile | steady writes | RSS MB | operator CPU s | s/pool vs first "
        "| step s | queries/interval | urgent queue p95 s | apiserver write p95 s "
        "| loop lag p95 s | loop lag p99 s | full GCs | full GC s |"
    )
    print("|" + "---|" * 28)
    for r in results:
        ratio = (r.converge_s / r.pools) / (base.converge_s / base.pools)
        print(f"| {r.pools} | {r.nodes} | {r.available} | {r.converge_s} | {r.operator_done_s} | "
              f"{r.converge_s / r.pools:.3f} | {r.reconciles} | {r.reconcile_p50_s} | "
              f"{r.reconcile_p95_s} | {r.queue_p95_s} | {r.requests_per_reconcile} | "
              f"{r.gets_per_reconcile} | "
              f"{r.requests_per_pool} | "
              f"{r.steady_p50_s} | {r.steady_p95_s} | {r.steady_requests_per_reconcile} | "
              f"{r.steady_writes} | {r.rss_mb} | {r.operator_cpu_s} | {ratio:.2f}× | "
              f"{r.step_s} | {r.queries_per_interval} | {r.urgent_queue_p95_s} | "
              f"{r.apiserver_write_p95_s} | {r.loop_lag_p95_s} | {r.loop_lag_p99_s} | "
              f"{r.gc_full_count} | {r.gc_full_s} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
