"""The router's latency histograms: per-series buckets at the pool's SLO, and prompt classes."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.router.metrics import LATENCY_BUCKETS, TPOT_BUCKETS, RouterMetrics, slo_edges

LIVE = ("llm", "chat", "abcdef012345", "live")


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's estimate from cumulative (le, count) buckets: linear within the bucket
    that holds the rank, the first bucket starting at 0."""
    count = buckets[-1][1]
    rank = q * count
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    raise AssertionError("no bucket holds the rank")


def buckets_of(metrics: RouterMetrics, name: str, prompt_class: str) -> list[tuple[float, float]]:
    out = []
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name + "_bucket" and s.labels["prompt_class"] == prompt_class \
                    and s.labels["pool"] == LIVE[1]:
                out.append((float(s.labels["le"]), s.value))
    return sorted(out)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.floats(0.01, 100.0), min_size=20, max_size=200),
       threshold=st.floats(0.05, 60.0))
def test_at_the_slo_the_p95_estimate_is_on_the_true_side_and_within_10_percent(
        values: list[float], threshold: float) -> None:
    metrics = RouterMetrics()
    metrics.slos = {LIVE[:2]: (threshold, None)}
    for value in values:
        metrics.observe_ttft(LIVE, 100, value)
    estimate = histogram_quantile(
        0.95, buckets_of(metrics, "kvfleet_router_time_to_first_token_seconds", "256"))
    # The value at Prometheus's rank lies in the bucket the estimate is taken from.
    true = sorted(values)[math.ceil(0.95 * len(values)) - 1]
    edge = round(threshold, 6)
    assert (estimate > edge) == (true > edge), (true, estimate)
    if 0.9 * threshold < true <= 1.1 * threshold:
        assert abs(estimate - true) <= 0.1 * threshold + 1e-6


def test_a_ladder_alone_puts_a_19s_p95_under_a_15s_slo_and_the_slo_edges_do_not() -> None:
    values = [1.0] * 90 + [19.0] * 10  # p95 19 s
    coarse = [(e, float(sum(v <= e for v in values))) for e in (10.0, 20.0, 40.0, math.inf)]
    assert histogram_quantile(0.95, coarse) <= 15.0  # what the issue saw
    metrics = RouterMetrics()
    metrics.slos = {LIVE[:2]: (15.0, None)}
    for value in values:
        metrics.observe_ttft(LIVE, 10, value)
    assert histogram_quantile(0.95, buckets_of(
        metrics, "kvfleet_router_time_to_first_token_seconds", "256")) > 15.0


def test_series_are_split_by_prompt_class_and_keep_their_buckets() -> None:
    metrics = RouterMetrics()
    metrics.slos = {LIVE[:2]: (2.0, 0.05)}
    metrics.observe_e2e(LIVE, 300, 1.0)
    metrics.observe_e2e(LIVE, 5000, 9.0)
    metrics.observe_tpot(LIVE, 20000, 0.04)
    classes = {s.labels["prompt_class"] for f in metrics.registry.collect() for s in f.samples
               if s.name.endswith("_count") and s.labels.get("pool") == "chat"}
    assert classes == {"512", "8192", "inf"}
    assert metrics.tpot.edges((*LIVE, "inf")) == slo_edges(TPOT_BUCKETS, 0.05)
    assert {0.045, 0.05, 0.055} <= set(slo_edges(TPOT_BUCKETS, 0.05))
    assert metrics.e2e.edges((*LIVE, "512")) == LATENCY_BUCKETS  # no SLO of its own
    metrics.slos = {LIVE[:2]: (4.0, None)}  # an SLO edit: new series only
    metrics.observe_ttft(LIVE, 10, 1.0)
    assert metrics.ttft.edges((*LIVE, "256")) == slo_edges(LATENCY_BUCKETS, 4.0)
    metrics.slos = {LIVE[:2]: (8.0, None)}
    metrics.observe_ttft(LIVE, 10, 1.0)
    assert metrics.ttft.edges((*LIVE, "256")) == slo_edges(LATENCY_BUCKETS, 4.0)


def test_a_revision_no_table_sends_to_loses_its_series_an_hour_later() -> None:
    """About 60 series a revision (outcomes by prompt class, tokens, answer signs, latency):
    kept for ever, they grew with every rollout; dropped at once, Prometheus had no current
    series for the revision a rollout had just promoted away from."""
    import time

    from kvfleet.router.metrics import RETAIN_SECONDS
    from kvfleet.router.outcome import Outcome

    metrics = RouterMetrics()
    old, new = ("llm", "smol", "aaaaaaaaaaaa", "live"), ("llm", "smol", "bbbbbbbbbbbb", "live")

    def series(revision: str) -> int:
        return sum(1 for f in metrics.registry.collect() for s in f.samples
                   if s.labels.get("revision") == revision)

    metrics.declare([old, new])
    metrics.observe_ttft(old, 10, 0.2)
    metrics.count(old, 10, Outcome.COMPLETED)
    metrics.check_answer(old, "Paris.", ["stop"])
    before = series(old[2])
    assert before > series(new[2]) > 50  # (the old one has a latency histogram too)
    left = time.monotonic()
    metrics.declare([new])  # promoted: the old revision left the table
    metrics.sweep(left + RETAIN_SECONDS - 60)
    assert series(old[2]) == before  # still there for dashboards and late queries
    metrics.sweep(left + RETAIN_SECONDS + 1)
    assert series(old[2]) == 0 and series(new[2]) > 50
    metrics.declare([old, new])  # routed again (a retry): declared anew
    assert series(old[2]) > 50
