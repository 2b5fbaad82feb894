"""Prometheus metrics of the operator itself (prefix `kvfleet_operator_`), defined once."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

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
    "Time a triggered reconcile waited for a free slot (--max-concurrent-reconciles), by kind.",
    ["kind"],
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


def count_request(verb: str) -> None:
    API_REQUESTS.labels(verb=verb).inc()


def count_informer_list(kind: str) -> None:
    INFORMER_LISTS.labels(kind=kind).inc()
