"""The autoscaler's edge: every interval, one Prometheus query for the whole fleet, then
`autoscale.decide` for each pool with spec.autoscaling, and spec.replicas written where the
count changes (as HPA writes a Deployment's). The pool's reconcile writes what was decided to
its status and conditions: the pool has one status writer.

The query reads, per engine pod, its waiting and running requests and KV-cache use (the
router's `load_score` is computed from them here, one definition for both), and per pool the
routers' TTFT and TPOT p95 over the last minute of live traffic, when the routers were last
scraped, the requests they hold for it at zero and when they last admitted one. A pool's
signals are missing when its engines (once it has Ready replicas) or its routers have no
series: the count is held and AutoscalingActive says which. The decisions live in this
process; a restarted operator starts its stabilisation windows afresh, as if the current count
had been recommended all along (it never scales down sooner for it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kvfleet.api.labels import label_value
from kvfleet.api.saturation import load_score
from kvfleet.api.servingpool import Autoscaling, Reserves, SLOs
from kvfleet.operator import metrics
from kvfleet.operator.autoscale import Decision, History, Observed, Policy, Signals, decide
from kvfleet.operator.conditions import rfc3339
from kvfleet.operator.events import Event

log = logging.getLogger("kvfleet.operator.autoscaler")
Key = tuple[str, str]

DEFAULT_INTERVAL_SECONDS = 15.0
SLO_WINDOW = "1m"
SLO_WINDOW_SECONDS = 60.0
# Engine gauges, by what load_score calls them.
ENGINE_SERIES = {"kvfleet_engine_requests_waiting": "waiting",
                 "kvfleet_engine_requests_running": "running",
                 "kvfleet_engine_kv_cache_usage_ratio": "kv"}
ROUTER_P95 = {"ttft": "kvfleet_router_time_to_first_token_seconds",
              "tpot": "kvfleet_router_time_per_output_token_seconds"}


def _tagged(expr: str, signal: str) -> str:
    return f'label_replace({expr}, "signal", "{signal}", "", "")'


def signals_query() -> str:
    """One instant query for every pool's signals: the engine gauges per pod (as they are,
    with __name__), the time of each pool's oldest engine sample, each pool's TTFT and TPOT
    p95, the time of its routers' newest sample, the requests they hold for it (at zero) and
    when they last admitted one; all but the gauges carry a `signal` label naming what they
    are."""
    names = "|".join(ENGINE_SERIES)
    parts = [
        f'{{__name__=~"{names}"}}',
        _tagged("min by (namespace, kvfleet_io_pool) "
                "(timestamp(kvfleet_engine_requests_running))", "engines_at"),
        *(_tagged(f"histogram_quantile(0.95, sum by (le, namespace, pool) "
                  f'(rate({histogram}_bucket{{traffic="live"}}[{SLO_WINDOW}])))', signal)
          for signal, histogram in ROUTER_P95.items()),
        _tagged('max by (namespace, pool) (timestamp(kvfleet_router_requests_total'
                '{traffic="live"}))', "routers_at"),
        _tagged("sum by (namespace, pool) (kvfleet_router_held_requests)", "held"),
        _tagged("max by (namespace, pool) (kvfleet_router_last_request_timestamp_seconds)",
                "last_request"),
    ]
    return " or ".join(parts)


@dataclass
class FleetSignals:
    """The query's answer, by pool: engines by (namespace, pool label), the rest by
    (namespace, pool name) as the router labels them."""

    at: float
    error: str | None = None  # why there are none (Prometheus did not answer)
    engines: dict[Key, dict[str, dict[str, float]]] = field(default_factory=dict)  # pod->gauges
    engines_at: dict[Key, float] = field(default_factory=dict)
    p95: dict[str, dict[Key, float]] = field(default_factory=dict)
    routers_at: dict[Key, float] = field(default_factory=dict)
    held: dict[Key, float] = field(default_factory=dict)
    last_request: dict[Key, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, rows: list[tuple[dict[str, str], float]], at: float) -> FleetSignals:
        fleet = cls(at)
        for labels, value in rows:
            signal = labels.get("signal")
            ns = labels.get("namespace", "")
            if signal is None:
                gauge = ENGINE_SERIES.get(labels.get("__name__", ""))
                if gauge is not None and math.isfinite(value):
                    pods = fleet.engines.setdefault((ns, labels.get("kvfleet_io_pool", "")), {})
                    pods.setdefault(labels.get("pod", ""), {})[gauge] = value
            elif signal == "engines_at":
                fleet.engines_at[(ns, labels.get("kvfleet_io_pool", ""))] = value
            elif signal in ("routers_at", "held", "last_request"):
                getattr(fleet, signal)[(ns, labels.get("pool", ""))] = value
            elif math.isfinite(value):  # (no traffic: NaN, not a signal)
                fleet.p95.setdefault(signal, {})[(ns, labels.get("pool", ""))] = value
        return fleet

    def of(self, namespace: str, name: str, ready: int) -> Signals:
        """One pool's signals (`ready`: its Ready replicas); `missing` names the series it
        should have and has not."""
        engine_key, router_key = (namespace, label_value(name)), (namespace, name)
        pods = [p for p in self.engines.get(engine_key, {}).values()
                if len(p) == len(ENGINE_SERIES)]  # (a pod with all three gauges)
        missing = []
        if self.error is not None:
            missing.append(self.error)
        elif ready > 0 and not pods:
            missing.append("no engine of the pool has series in Prometheus "
                           "(kvfleet_engine_requests_running)")
        if self.error is None and router_key not in self.routers_at:
            missing.append("no router reports the pool to Prometheus "
                           "(kvfleet_router_requests_total)")
        sampled = [t for t in (self.engines_at.get(engine_key), self.routers_at.get(router_key))
                   if t is not None]
        return Signals(
            at=min(sampled, default=self.at),
            loads=tuple(load_score(p["waiting"], p["running"], p["kv"]) for p in pods),
            kv_usage=tuple(p["kv"] for p in pods),
            ttft_p95=self.p95.get("ttft", {}).get(router_key),
            tpot_p95=self.p95.get("tpot", {}).get(router_key),
            held=round(self.held.get(router_key, 0)),
            last_request_at=self.last_request.get(router_key),
            missing=tuple(missing))


def policy_of(spec: Autoscaling, slos: SLOs | None, reserve: int = 0,
              rolling_out: bool = False) -> Policy:
    """`rolling_out`: a Rollout's traffic table is on the pool (never to zero then)."""
    return Policy(
        reserve=reserve, rolling_out=rolling_out, min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas,
        target_load=spec.target_load, target_kv_usage=spec.target_kv_cache_usage,
        ttft_slo=slos.ttft_p95_seconds if slos is not None and spec.slo_scaling else None,
        tpot_slo=slos.tpot_p95_seconds if slos is not None and spec.slo_scaling else None,
        up_window=spec.scale_up_stabilization_seconds,
        down_window=spec.scale_down_stabilization_seconds, max_step=spec.max_step,
        stale_after=spec.stale_after_seconds, pending_grace=spec.pending_grace_seconds,
        slo_window=SLO_WINDOW_SECONDS,
        idle_seconds=spec.scale_to_zero.idle_seconds if spec.scale_to_zero is not None
        else None)


@dataclass(frozen=True)
class PoolView:
    """What the autoscaler reads of a pool, from its cached object: the two small spec parts
    parsed, the rest plain values (thousands of pools: no whole parsed pool kept per pool)."""

    namespace: str
    name: str
    replicas: int
    autoscaling: Autoscaling
    slos: SLOs | None = None
    reserve: int = 0  # reserves.failover + reserves.burst (deployment is a rollout's surge)
    ready: int = 0
    reconciled: bool = False  # its status has an observedGeneration
    rolling_out: bool = False  # a Rollout's traffic table is on it (status.traffic)
    # What its status shows now: (desiredReplicas, signal, AutoscalingActive, ScalingLimited)
    shown: tuple[object, ...] = ()
    last_scale_time: str | None = None

    @property
    def key(self) -> Key:
        return self.namespace, self.name

    @classmethod
    def of(cls, raw: dict[str, Any]) -> PoolView | None:
        """None for a pool without spec.autoscaling; ValueError (pydantic's) for one whose
        autoscaling, slos or reserves do not parse."""
        spec, status = raw.get("spec") or {}, raw.get("status") or {}
        if not spec.get("autoscaling"):
            return None
        meta = raw["metadata"]
        reserves = Reserves.model_validate(spec.get("reserves") or {})
        shown_by = status.get("autoscaling") or {}
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        return cls(
            namespace=str(meta.get("namespace") or "default"), name=str(meta["name"]),
            replicas=int(spec.get("replicas", 1)),
            autoscaling=Autoscaling.model_validate(spec["autoscaling"]),
            slos=SLOs.model_validate(spec["slos"]) if spec.get("slos") else None,
            reserve=reserves.failover + reserves.burst,
            ready=int(status.get("readyReplicas", 0)),
            reconciled=status.get("observedGeneration") is not None,
            rolling_out=bool(status.get("traffic")),
            shown=(shown_by.get("desiredReplicas"), shown_by.get("signal"),
                   conditions.get("AutoscalingActive"), conditions.get("ScalingLimited")),
            last_scale_time=shown_by.get("lastScaleTime"))


@dataclass(frozen=True)
class Report:
    """What the pool's status says of the autoscaler: its last decision, and when it last
    changed the count."""

    decision: Decision
    last_scale_time: str | None


@dataclass
class _PoolState:
    history: History = field(default_factory=History)
    report: Report | None = None


# Pools decided in one turn of the event loop (each ~0.2 ms).
DECIDE_CHUNK = 200


class Autoscaler:
    """Owns the decisions of every autoscaled pool. `read` answers the fleet's signals;
    `scale` writes a pool's spec.replicas; `changed(key, scaled)` asks for the pool's
    reconcile (which writes its status, and with `scaled` carries out a new count: that one
    must not wait behind other work); `unplaced(key)` says how many of its pods the scheduler
    found no node for, and since when."""

    def __init__(self, read: Callable[[], Awaitable[FleetSignals]],
                 scale: Callable[[Key, int], Any],
                 changed: Callable[[Key, bool], None], post: Callable[[Key, Event], Any],
                 interval: float = DEFAULT_INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.time,
                 unplaced: Callable[[Key], tuple[int, float | None]] = lambda key: (0, None),
                 ) -> None:
        self.read, self.scale, self.changed, self.post = read, scale, changed, post
        self.unplaced = unplaced
        self.interval, self.clock = interval, clock
        self._pools: dict[Key, _PoolState] = {}

    def report(self, key: Key) -> Report | None:
        state = self._pools.get(key)
        return state.report if state is not None else None

    async def step(self, pools: list[PoolView]) -> None:
        """One interval: decide every pool among `pools` and act on it."""
        wanted = {p.key: p for p in pools}
        for gone in set(self._pools) - set(wanted):
            del self._pools[gone]
            metrics.forget_autoscaled(*gone)
        if not wanted:
            return
        fleet = await self.read()
        now = self.clock()
        tasks: list[asyncio.Future[None]] = []
        try:
            for i, pool in enumerate(wanted.values(), 1):
                tasks.append(asyncio.ensure_future(self._one(pool, fleet, now)))
                if i % DECIDE_CHUNK == 0:
                    # Let replies and watch events in between: 5,000 pools decided in one go
                    # held the event loop, and every reconcile in flight, for a second.
                    await asyncio.sleep(0)
        except BaseException:  # cancelled (shutdown): no decision goes on writing alone
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for key, outcome in zip(wanted, outcomes, strict=True):
            if isinstance(outcome, Exception):  # (one pool's failure is not the others')
                log.warning("autoscaling of %s/%s failed: %s", *key, outcome)

    async def _one(self, pool: PoolView, fleet: FleetSignals, now: float) -> None:
        key, current, ready = pool.key, pool.replicas, pool.ready
        state = self._pools.setdefault(key, _PoolState())
        unplaced, since = self.unplaced(key)
        # (Engines are expected to report once Ready: a pool still starting is not "missing".)
        signals = fleet.of(pool.namespace, pool.name, ready)
        decision = decide(policy_of(pool.autoscaling, pool.slos, pool.reserve,
                                    pool.rolling_out), signals,
                          Observed(current, ready, since, unplaced), state.history, now)
        metrics.AUTOSCALE_DESIRED.labels(*key).set(decision.desired)
        metrics.AUTOSCALE_ACTIVE.labels(*key).set(decision.active)
        previous = state.report
        scaled_at = previous.last_scale_time if previous is not None else \
            pool.last_scale_time
        events = []
        if decision.desired != current:
            await self.scale(key, decision.desired)  # (failed: decided again next interval)
            scaled_at = rfc3339(datetime.fromtimestamp(now, UTC))
            events.append(Event("Normal", "Scaled", (
                f"{current} -> {decision.desired} replicas ({decision.signal}: "
                f"{decision.message})")))
        was = previous.decision if previous is not None else None
        if not decision.active and (was is None or was.active):
            events.append(Event("Warning", "AutoscalingInactive", decision.why_inactive))
        if decision.limited and (was is None or not was.limited):
            events.append(Event("Warning", "ScalingLimited", decision.why_limited))
        # The status changes with what was decided, not with every interval's numbers: a
        # reconcile per pool per interval would be the fleet's whole reconcile budget.
        if previous is None or _shown(previous.decision) != _shown(decision) or \
                scaled_at != previous.last_scale_time:
            state.report = Report(decision, scaled_at)
            # A pool not reconciled yet (a burst of creates) or whose status already says
            # this (a restarted operator) gets it at its next reconcile, not a reconcile more.
            if decision.desired != current or (pool.reconciled and pool.shown != (
                    decision.desired, decision.signal, _text(decision.active),
                    _text(decision.scaling_limited))):
                self.changed(key, decision.desired != current)
        for event in events:  # last: a refused event changes nothing decided
            await self.post(key, event)

    async def run_forever(self, pools: Callable[[], list[PoolView]]) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.step(pools())
            except Exception:  # never a loop that stopped deciding in silence
                log.exception("autoscaling interval failed")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))


def _shown(decision: Decision) -> tuple[int, str, bool, bool]:
    return decision.desired, decision.signal, decision.active, decision.limited


def _text(flag: bool) -> str:
    return "True" if flag else "False"
