"""Prometheus metrics of the operator itself (prefix `kvfleet_operator_`), defined once."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from kvfleet.api.rollout import Phase

RECONCILES = Counter("kvfleet_operator_reconciles_total", "Reconciles run, by kind.", ["kind"])
RECONCILE_ERRORS = Counter(
    "kvfleet_operator_reconcile_errors_total", "Reconciles that failed, by kind.", ["kind"]
)
RECONCILE_SECONDS = Histogram(
    "kvfleet_operator_reconcile_duration_seconds",
    "Wall time of one reconcile (reads, decision, writes), by kind.",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
QUEUE_SECONDS = Histogram(
    "kvfleet_operator_reconcile_queue_seconds",
    "Time a triggered reconcile waited for a free slot (--max-concurrent-reconciles), by kind "
    "and lane (urgent: a pool with an autoscaling or rollout decision to carry out; bulk).",
    ["kind", "lane"],
    buckets=(0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
)
API_REQUESTS = Counter(
    "kvfleet_operator_apiserver_requests_total", "Requests the operator sent, by verb.", ["verb"]
)
INFORMER_LISTS = Counter(
    "kvfleet_operator_informer_lists_total",
    "Full listings by the informers of child kinds (the first, then one after each expired "
    "watch or failure), by kind.",
    ["kind"],
)
OBJECTS_APPLIED = Counter(
    "kvfleet_operator_objects_applied_total",
    "Owned objects created or restored by server-side apply, by kind.",
    ["kind"],
)

LOOP_LAG_PERIOD_SECONDS = 0.25
LOOP_LAG = Histogram(
    "kvfleet_operator_event_loop_lag_seconds",
    "How late the operator's event loop woke a timer due every 0.25 s: time spent on other "
    "work without yielding, which every reconcile and watch in flight waits out too.",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)


async def measure_loop_lag() -> None:
    """Observe LOOP_LAG for ever: on a saturated host it separates the operator's own stalls
    from the apiserver's latency in a slow reconcile."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + LOOP_LAG_PERIOD_SECONDS
        await asyncio.sleep(LOOP_LAG_PERIOD_SECONDS)
        LOOP_LAG.observe(max(0.0, loop.time() - due))


GC_PAUSE = Histogram(
    "kvfleet_operator_gc_pause_seconds",
    "Python's cyclic garbage collections, by generation: each one stops the event loop (a "
    "full one walks every object the operator holds).",
    ["generation"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
_gc_started = [0.0]
# Resolved here, once: `labels()` takes the metric's lock, which a /metrics scrape holds while
# it allocates, and a collection that allocation starts would then wait on its own thread's
# lock for ever (prometheus/client_python#363). A child's observe only locks around floats.
_GC_PAUSE_BY_GENERATION = tuple(GC_PAUSE.labels(generation=str(g)) for g in range(3))


def _time_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    else:
        _GC_PAUSE_BY_GENERATION[info["generation"]].observe(
            time.perf_counter() - _gc_started[0])


def time_gc_pauses() -> None:
    """Observe GC_PAUSE from now on (once per process)."""
    if _time_gc not in gc.callbacks:
        gc.callbacks.append(_time_gc)


def count_request(verb: str) -> None:
    API_REQUESTS.labels(verb=verb).inc()


def count_informer_list(kind: str) -> None:
    INFORMER_LISTS.labels(kind=kind).inc()
ANALYSES = Counter(
    "kvfleet_operator_rollout_analyses_total",
    "Rollout analysis evaluations, by outcome (Pass, Fail, Waiting, Inconclusive, Error).",
    ["outcome"],
)
ROLLOUT_PHASE = Gauge(
    "kvfleet_operator_rollout_phase",
    "1 for each Rollout's current phase, 0 for its other phases.",
    ["namespace", "rollout", "phase"],
)
ROLLOUT_STEP = Gauge(
    "kvfleet_operator_rollout_step",
    "Each Rollout's step index (-1: shadow phase; -2: none).",
    ["namespace", "rollout"],
)
ROLLOUT_WEIGHT = Gauge(
    "kvfleet_operator_rollout_canary_weight_percent",
    "Percent of conversations each Rollout sends to its canary.",
    ["namespace", "rollout"],
)
AUTOSCALE_DESIRED = Gauge(
    "kvfleet_operator_autoscale_desired_replicas",
    "The replicas the autoscaler decided for each autoscaled pool.",
    ["namespace", "pool"],
)
AUTOSCALE_ACTIVE = Gauge(
    "kvfleet_operator_autoscale_active",
    "1 while an autoscaled pool's signals are fresh; 0 while its count is held for want of "
    "them.",
    ["namespace", "pool"],
)


def forget_autoscaled(namespace: str, pool: str) -> None:
    _remove(AUTOSCALE_DESIRED, namespace, pool)
    _remove(AUTOSCALE_ACTIVE, namespace, pool)


def forget_rollout(namespace: str, rollout: str) -> None:
    """A deleted Rollout's series go (else its last phase and weight would be reported for
    ever)."""
    for phase in Phase:
        _remove(ROLLOUT_PHASE, namespace, rollout, phase.value)
    _remove(ROLLOUT_STEP, namespace, rollout)
    _remove(ROLLOUT_WEIGHT, namespace, rollout)


def _remove(gauge: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never set: nothing to forget
        gauge.remove(*labels)
