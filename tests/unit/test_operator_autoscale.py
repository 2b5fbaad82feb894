"""The autoscaler's pure decision: signals to a replica count, bounded, stabilised, never
silent about stale signals or replicas that cannot be placed."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.operator.autoscale import History, Observed, Policy, Signals, decide

POLICY = Policy(min_replicas=1, max_replicas=4, target_load=2.0, target_kv_usage=0.8,
                ttft_slo=1.0, up_window=0.0, down_window=60.0, max_step=4)


def test_a_load_ramp_scales_up_at_once_and_down_only_after_the_window() -> None:
    history = History()
    up = decide(POLICY, Signals(at=0, loads=(6.0,)), Observed(1, 1), history, 0)
    assert (up.desired, up.signal) == (3, "load")
    # The load is gone: the window still holds the recommendation of 3.
    for t in (10, 30, 59):
        quiet = decide(POLICY, Signals(at=t, loads=(0.2, 0.2, 0.2)), Observed(3, 3), history, t)
        assert quiet.desired == 3
    down = decide(POLICY, Signals(at=61, loads=(0.2, 0.2, 0.2)), Observed(3, 3), history, 61)
    assert (down.desired, down.signal) == (1, "load")


def test_every_signal_can_decide_and_the_bounds_hold() -> None:
    cases = [(Signals(at=0, loads=(100.0,)), 4, "max"),
             (Signals(at=0, loads=(1.0, 1.0), kv_usage=(0.95, 0.95)), 3, "kvCache"),
             (Signals(at=0, loads=(1.0, 1.0), ttft_p95=1.5), 3, "slo"),
             # (a scale-down waits for its window, even for a fresh operator)
             (Signals(at=0, loads=(0.0, 0.0)), 2, "min")]
    for signals, desired, signal in cases:
        decision = decide(POLICY, signals, Observed(2, 2), History(), 0)
        assert (decision.desired, decision.signal) == (desired, signal), (signals, decision)


def test_stale_or_missing_signals_hold_the_count_and_say_why() -> None:
    missing = decide(POLICY, None, Observed(2, 2), History(), 100)
    assert (missing.desired, missing.active) == (2, False)
    assert "no signals" in missing.why_inactive
    stale = decide(POLICY, Signals(at=0, loads=(50.0,)), Observed(2, 2), History(), 100)
    assert (stale.desired, stale.active) == (2, False)
    assert "100 s old (over 60 s): holding 2" in stale.why_inactive


def test_replicas_pending_past_the_grace_stop_the_count_growing() -> None:
    busy = Signals(at=500, loads=(9.0, 9.0))
    fresh = decide(POLICY, busy, Observed(3, 2, pending_since=450, unplaced=1), History(), 500)
    assert fresh.desired == 4 and not fresh.limited  # within the grace: a node may come
    stuck = decide(POLICY, busy, Observed(3, 2, pending_since=300, unplaced=1), History(), 500)
    assert (stuck.desired, stuck.limited, stuck.scaling_limited) == (3, True, True)
    assert "1 replicas unschedulable for 200 s" in stuck.why_limited
    assert "holding 3, not growing to 4" in stuck.why_limited
    # Placed and still starting (an engine loading its model) is not "cannot be placed".
    starting = decide(POLICY, busy, Observed(3, 1), History(), 500)
    assert starting.desired == 4 and not starting.limited


def test_idle_goes_to_zero_and_a_held_request_wakes_one() -> None:
    policy = Policy(min_replicas=0, max_replicas=4, target_load=2.0, idle_seconds=300)
    history = History()
    busy = decide(policy, Signals(at=100, loads=(0.0,), last_request_at=0), Observed(1, 1),
                  history, 100)
    assert busy.desired == 1
    idle = decide(policy, Signals(at=300, loads=(0.0,), last_request_at=0), Observed(1, 1),
                  history, 300)
    assert (idle.desired, idle.signal) == (0, "idle")
    # A stream admitted before the idle window and still answering keeps its replica.
    streaming = decide(policy, Signals(at=300, loads=(1.0,), last_request_at=0),
                       Observed(1, 1), History(), 300)
    assert streaming.desired == 1
    asleep = decide(policy, Signals(at=400, last_request_at=0), Observed(0, 0), history, 400)
    assert asleep.desired == 0
    woken = decide(policy, Signals(at=401, held=3, last_request_at=0), Observed(0, 0), history,
                   401)
    assert (woken.desired, woken.signal) == (1, "held")


def test_missing_series_hold_the_count_and_are_named() -> None:
    gone = Signals(at=100, loads=(9.0,), missing=("no router reports the pool",))
    held = decide(POLICY, gone, Observed(2, 2), History(), 100)
    assert (held.desired, held.active, held.signal) == (2, False, "stale")
    assert held.why_inactive == "no router reports the pool: holding 2 replicas"


def test_the_slo_signal_waits_for_the_last_scale_up_to_land_and_be_measured() -> None:
    """Fresh replicas answer their first requests slowly: a p95 over the minute they started
    in must not ask for yet another replica (an overshoot from cold-start samples)."""
    history = History()
    slow = dict(loads=(1.0, 1.0), ttft_p95=1.5)
    first = decide(POLICY, Signals(at=0, **slow), Observed(2, 2), history, 0)
    assert (first.desired, first.signal) == (3, "slo") and "TTFT p95 1.5 s over its SLO" in \
        first.message
    pending = decide(POLICY, Signals(at=10, **slow), Observed(3, 2), history, 10)
    assert pending.desired == 3  # the third is not Ready yet
    cold = decide(POLICY, Signals(at=30, **slow), Observed(3, 3), history, 30)
    assert cold.desired == 3  # Ready, but the p95 still holds its first minute
    measured = decide(POLICY, Signals(at=61, **slow), Observed(3, 3), history, 61)
    assert measured.desired == 4


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 30), st.lists(st.floats(0, 20), max_size=6),
                          st.one_of(st.none(), st.floats(0, 3))), min_size=2, max_size=60))
def test_no_signals_make_it_flap_within_a_window(steps: list[tuple[float, list[float],
                                                                   float | None]]) -> None:
    """Whatever the samples, the count stays in bounds, moves at most max_step at a time, and
    never falls sooner than a down window after it last rose."""
    policy = Policy(min_replicas=1, max_replicas=8, target_load=2.0, ttft_slo=1.0,
                    down_window=60.0, max_step=2)
    history, now, current, last_rise = History(), 0.0, 1, None
    for gap, loads, ttft in steps:
        now += gap
        loads = loads[:current]
        decision = decide(policy, Signals(at=now, loads=tuple(loads), ttft_p95=ttft),
                          Observed(current, current), history, now)
        assert 1 <= decision.desired <= 8 and abs(decision.desired - current) <= 2
        if decision.desired > current:
            last_rise = now
        elif decision.desired < current and last_rise is not None:
            assert now - last_rise >= policy.down_window, (now, last_rise)
        current = decision.desired


def test_unschedulable_pods_are_counted_from_the_schedulers_verdict() -> None:
    from kvfleet.operator.placement import unschedulable_since

    def pod(scheduled: str, reason: str = "", at: str = "2026-01-01T00:00:10Z",
            deleting: bool = False) -> dict[str, object]:
        meta: dict[str, object] = {"name": "p"}
        if deleting:
            meta["deletionTimestamp"] = at
        return {"metadata": meta, "status": {"conditions": [
            {"type": "PodScheduled", "status": scheduled, "reason": reason,
             "lastTransitionTime": at}]}}

    pods = [pod("True"), pod("False", "Unschedulable", "2026-01-01T00:00:30Z"),
            pod("False", "Unschedulable"), pod("False", "Unschedulable", deleting=True)]
    count, since = unschedulable_since(pods)
    assert (count, since) == (2, 1767225610.0)
    assert unschedulable_since([pod("True")]) == (0, None)


def test_the_reserves_are_kept_beyond_what_the_load_asks_for_but_not_at_zero() -> None:
    """`reserves.failover` and `reserves.burst` are replicas beyond what the load needs: an
    autoscaled pool keeps them on top of the load's (or the KV cache's) count, within
    maxReplicas. Not on top of a held count, a wake or an idle pool: zero stays zero."""
    reserved = Policy(min_replicas=0, max_replicas=6, target_load=2.0, target_kv_usage=0.8,
                      down_window=60.0, idle_seconds=300.0, reserve=2)
    load = decide(reserved, Signals(at=0, loads=(3.0, 2.0), last_request_at=0), Observed(2, 2),
                  History(), 0)
    assert (load.desired, load.signal) == (5, "load") and "+ 2 reserved" in load.message
    kv = decide(reserved, Signals(at=0, loads=(0.5, 0.5), kv_usage=(0.9, 0.9),
                                  last_request_at=0), Observed(2, 2), History(), 0)
    assert (kv.desired, kv.signal) == (5, "kvCache")
    capped = decide(reserved, Signals(at=0, loads=(12.0,), last_request_at=0), Observed(2, 2),
                    History(), 0)
    assert (capped.desired, capped.signal) == (6, "max")
    unmeasured = decide(reserved, Signals(at=0, last_request_at=0), Observed(3, 0), History(), 0)
    assert unmeasured.desired == 3  # (the count it holds already has them)
    idle = decide(reserved, Signals(at=400, loads=(0.0, 0.0, 0.0), last_request_at=0),
                  Observed(3, 3), History(), 400)
    assert (idle.desired, idle.signal) == (0, "idle")
    woken = decide(reserved, Signals(at=500, held=3), Observed(0, 0), History(), 500)
    assert woken.desired == 1  # one replica to serve the held requests; then the load's count
