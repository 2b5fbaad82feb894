"""One replica's load, as one number: what the router picks replicas by and what the operator's
autoscaler sizes pools by, so the two never disagree on which replica, or pool, is saturated.

A waiting request costs more than a running one (it has no KV yet and will queue); a nearly
full KV cache (over KV_PRESSURE_FROM) means preemptions, and weighs heavily.
"""

from __future__ import annotations

KV_PRESSURE_FROM = 0.8
KV_PRESSURE_WEIGHT = 50.0
WAITING_WEIGHT = 2.0


def load_score(waiting: float, running: float, kv_usage: float) -> float:
    """The load of a replica with these engine gauges (kv_usage 0..1)."""
    kv_pressure = max(0.0, kv_usage - KV_PRESSURE_FROM) * KV_PRESSURE_WEIGHT
    return WAITING_WEIGHT * waiting + running + kv_pressure
