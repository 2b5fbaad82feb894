"""The autoscaler's edge: the fleet query's answer parsed into each pool's signals, and one
interval's actions (spec.replicas written, events once, the pool's reconcile asked for only
when what its status shows changes)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvfleet.api.saturation import load_score
from kvfleet.api.servingpool import ServingPool
from kvfleet.operator.autoscaler import (
    DECIDE_CHUNK,
    Autoscaler,
    FleetSignals,
    Key,
    PoolView,
    policy_of,
    signals_query,
)
from kvfleet.operator.events import Event

NS = "team-a"


def _engine(pool: str, pod: str, waiting: float, running: float, kv: float
            ) -> list[tuple[dict[str, str], float]]:
    base = {"namespace": NS, "kvfleet_io_pool": pool, "pod": pod}
    return [({**base, "__name__": "kvfleet_engine_requests_waiting"}, waiting),
            ({**base, "__name__": "kvfleet_engine_requests_running"}, running),
            ({**base, "__name__": "kvfleet_engine_kv_cache_usage_ratio"}, kv)]


def _rows(pool: str = "chat", at: float = 1000.0) -> list[tuple[dict[str, str], float]]:
    return [*_engine(pool, "a", 1, 3, 0.5), *_engine(pool, "b", 0, 2, 0.9),
            ({"namespace": NS, "kvfleet_io_pool": pool, "signal": "engines_at"}, at - 5),
            ({"namespace": NS, "pool": pool, "signal": "ttft"}, 0.8),
            ({"namespace": NS, "pool": pool, "signal": "tpot"}, float("nan")),
            ({"namespace": NS, "pool": pool, "signal": "routers_at"}, at - 2),
            ({"namespace": NS, "pool": pool, "signal": "held"}, 2.0),
            ({"namespace": NS, "pool": pool, "signal": "last_request"}, at - 30)]


def test_the_query_is_one_for_the_fleet_and_tags_what_it_reads() -> None:
    query = signals_query()
    assert query.count(" or ") == 6 and "by (namespace, pool)" in query
    assert 'traffic="live"' in query and "kvfleet_engine_requests_waiting" in query


def test_a_pools_signals_are_its_engines_load_scores_and_its_routers_p95s() -> None:
    signals = FleetSignals.parse(_rows(), 1000.0).of(NS, "chat", ready=2)
    assert sorted(signals.loads) == sorted([load_score(1, 3, 0.5), load_score(0, 2, 0.9)])
    assert signals.kv_usage and sorted(signals.kv_usage) == [0.5, 0.9]
    # The oldest sample dates the signals; no traffic (NaN) is no p95, not a signal.
    assert (signals.at, signals.ttft_p95, signals.tpot_p95, signals.missing) == (
        995.0, 0.8, None, ())
    assert (signals.held, signals.last_request_at) == (2, 970.0)


def test_missing_series_are_named() -> None:
    rows = [r for r in _rows() if r[0].get("signal") != "routers_at"]
    fleet = FleetSignals.parse(rows, 1000.0)
    assert fleet.of(NS, "chat", 2).missing == (
        "no router reports the pool to Prometheus (kvfleet_router_requests_total)",)
    other = fleet.of(NS, "other", 1).missing
    assert "no engine of the pool has series" in other[0] and len(other) == 2
    down = FleetSignals(1000.0, error="Prometheus did not answer").of(NS, "chat", 2)
    assert down.missing == ("Prometheus did not answer",)


def _pool(replicas: int = 1, ready: int = 1, name: str = "chat",
          status: dict[str, Any] | None = None, **autoscaling: Any) -> PoolView:
    pool = ServingPool.model_validate({
        "metadata": {"name": name, "namespace": NS},
        "spec": {"artifactRef": {"name": "smol"}, "replicas": replicas,
                 "gpu": {"product": "NVIDIA-L4"},
                 "autoscaling": {"maxReplicas": 4, "targetLoad": 4.0,
                                 "scaleDownStabilizationSeconds": 60, **autoscaling}},
        "status": {"replicas": replicas, "readyReplicas": ready, "observedGeneration": 1,
                   **(status or {})}})
    view = PoolView.of(pool.to_wire())
    assert view is not None
    return view


class _Fake:
    def __init__(self) -> None:
        self.fleet = FleetSignals(0.0)
        self.scaled: list[tuple[Key, int]] = []
        self.changed: list[tuple[Key, bool]] = []
        self.events: list[Event] = []
        self.now = 1000.0

    def autoscaler(self) -> Autoscaler:
        async def read() -> FleetSignals:
            return self.fleet

        async def scale(key: Key, n: int) -> None:
            self.scaled.append((key, n))

        async def post(key: Key, event: Event) -> None:
            self.events.append(event)

        return Autoscaler(read, scale, lambda key, scaled: self.changed.append((key, scaled)),
                          post, clock=lambda: self.now)


def test_an_interval_scales_once_says_so_and_asks_for_the_status_only_on_a_change() -> None:
    fake = _Fake()
    scaler = fake.autoscaler()
    # Load 12 (a KV cache over 80 % weighs): 3 replicas at 4 each.
    fake.fleet = FleetSignals.parse(_rows(at=1000.0), 1000.0)
    asyncio.run(scaler.step([_pool()]))
    assert fake.scaled == [((NS, "chat"), 3)] and fake.changed == [((NS, "chat"), True)]
    assert [e.reason for e in fake.events] == ["Scaled"]
    assert "1 -> 3 replicas (load: load 12.0 over 2 replicas, target 4 each)" in \
        fake.events[0].message
    report = scaler.report((NS, "chat"))
    assert report is not None and report.decision.desired == 3 and report.last_scale_time
    # The next interval finds it at 3 with the same load: nothing to write or say.
    fake.now = 1015.0
    fake.fleet = FleetSignals.parse(_rows(at=1015.0), 1015.0)
    asyncio.run(scaler.step([_pool(replicas=3, ready=3)]))
    assert len(fake.scaled) == 1 and len(fake.changed) == 1 and len(fake.events) == 1


def test_lost_signals_warn_once_and_hold_the_count() -> None:
    fake = _Fake()
    scaler = fake.autoscaler()
    fake.fleet = FleetSignals(1000.0, error="Prometheus did not answer (TimeoutError)")
    for t in (1000.0, 1015.0, 1030.0):
        fake.now = t
        asyncio.run(scaler.step([_pool(replicas=2, ready=2)]))
    assert fake.scaled == [] and len(fake.changed) == 1
    assert [e.reason for e in fake.events] == ["AutoscalingInactive"]
    assert "Prometheus did not answer (TimeoutError): holding 2 replicas" in \
        fake.events[0].message


def test_a_status_that_shows_the_decision_or_a_pool_not_reconciled_yet_costs_no_reconcile(
) -> None:
    """A burst of new pools, or a restarted operator over thousands of them, must not add a
    reconcile per pool for the status alone: the next one writes it anyway."""
    fake = _Fake()
    scaler = fake.autoscaler()
    fake.fleet = FleetSignals(1000.0, error="Prometheus did not answer")
    new = PoolView(NS, "chat", 2, _pool().autoscaling)  # (no status yet)
    shown = _pool(replicas=2, ready=2, name="shown", status={
        "autoscaling": {"desiredReplicas": 2, "signal": "stale"},
        "conditions": [{"type": t, "status": "False", "reason": "R", "message": "",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}
                       for t in ("AutoscalingActive", "ScalingLimited")]})
    asyncio.run(scaler.step([new, shown]))
    assert fake.changed == [] and scaler.report((NS, "chat")) is not None


def test_a_pool_that_stops_autoscaling_is_forgotten() -> None:
    fake = _Fake()
    scaler = fake.autoscaler()
    fake.fleet = FleetSignals.parse(_rows(), 1000.0)
    asyncio.run(scaler.step([_pool()]))
    asyncio.run(scaler.step([]))
    assert scaler.report((NS, "chat")) is None


def test_a_pool_whose_writes_fail_does_not_stop_the_others_or_the_loop() -> None:
    """A namespace being deleted refuses the event (and the scale): the other pools are still
    decided, and the decision that was taken is kept."""
    fake = _Fake()
    refusing = fake.autoscaler()

    async def refuse(key: Key, event: Event) -> None:
        raise RuntimeError(f"namespace {key[0]} is being terminated")

    refusing.post = refuse
    fake.fleet = FleetSignals.parse(_rows() + _rows("other"), 1000.0)
    asyncio.run(refusing.step([_pool(), _pool(name="other")]))
    assert sorted(fake.scaled) == [((NS, "chat"), 3), ((NS, "other"), 3)]
    assert refusing.report((NS, "chat")) is not None


def test_the_view_reads_the_pools_failover_and_burst_reserves() -> None:
    plain = _pool()
    assert plain.reserve == 0
    pool = ServingPool.model_validate({
        "metadata": {"name": "chat", "namespace": NS},
        "spec": {"artifactRef": {"name": "smol"}, "gpu": {"product": "NVIDIA-L4"},
                 "reserves": {"failover": 1, "burst": 2, "deployment": 3},
                 "autoscaling": {"maxReplicas": 8, "targetLoad": 4.0}}})
    view = PoolView.of(pool.to_wire())
    assert view is not None and view.reserve == 3  # (the deployment reserve is a surge)
    assert policy_of(view.autoscaling, view.slos, view.reserve).reserve == 3


def test_a_large_fleet_is_decided_in_chunks_between_which_the_loop_runs_other_work() -> None:
    """5,000 pools decided in one turn of the event loop held every reconcile in flight (and
    the watches) for about a second; at most DECIDE_CHUNK pools are decided between two turns."""
    fake = _Fake()
    scaler = fake.autoscaler()
    fake.fleet = FleetSignals(1000.0, error="Prometheus did not answer")
    decided: list[int] = []
    scaler.unplaced = lambda key: (decided.append(1), (0, None))[1]
    pools = [_pool(name=f"p{i}") for i in range(5 * DECIDE_CHUNK)]
    gaps: list[int] = []

    async def run() -> None:
        async def other_work() -> None:  # a reply or a watch event, every turn of the loop
            seen = 0
            while len(decided) < len(pools):
                await asyncio.sleep(0)
                gaps.append(len(decided) - seen)
                seen = len(decided)

        await asyncio.gather(scaler.step(pools), other_work())

    asyncio.run(run())
    assert len(decided) == len(pools)
    assert 0 < max(gaps) <= DECIDE_CHUNK


def test_a_pool_mid_rollout_never_scales_to_zero() -> None:
    """An idle spell mid-rollout took the pool to 0; the promotion then scaled the new revision
    to 0 and deleted stable, and every request waited through a cold start."""
    from kvfleet.operator.autoscale import History, Observed, Signals, decide

    idle = {"minReplicas": 0, "scaleToZero": {"idleSeconds": 30}}
    traffic = {"traffic": [{"revision": "a" * 64, "role": "stable", "weight": 50},
                           {"revision": "b" * 64, "role": "canary", "weight": 50}]}
    quiet = Signals(at=600, loads=(0.0,), last_request_at=0)
    for status, desired, signal in (({}, 0, "idle"), (traffic, 1, "rollout")):
        view = _pool(1, 1, status=status, **idle)
        assert view.rolling_out == bool(status)
        policy = policy_of(view.autoscaling, view.slos, view.reserve, view.rolling_out)
        decision = decide(policy, quiet, Observed(1, 1), History(), 600)
        assert (decision.desired, decision.signal) == (desired, signal), (status, decision)
    assert "a rollout runs: not to zero" in decision.message
    # Two replicas, idle mid-rollout: down to 1 (after the down window), never 0.
    history = History(recommendations=[(0, 2)])
    down = decide(policy, quiet, Observed(2, 2), history, 600)
    assert (down.desired, down.signal) == (1, "rollout")
