"""How many replicas a pool wants, from the signals its engines and routers already export:
the pure decision of the autoscaler (issue 37), apart from where the signals come from and
where the count goes.

Each interval the operator hands `decide` the pool's policy, the latest signals (None when it
has none), what it observed of the pool's replicas and the history it keeps between calls. The
recommendation is the largest of:

- load: the replicas that put each at `target_load`, in the unit the router picks replicas by
  (`kvfleet.api.saturation.load_score`: waiting, running and KV pressure), so the router and
  the autoscaler agree on what saturated means;
- KV cache: the replicas that put the mean KV-cache use at `target_kv_usage`;
- SLOs: one more replica than now while the TTFT or TPOT p95 misses the pool's SLO;
- demand at zero: one replica while the routers hold requests for a pool at zero.

The load's and the KV cache's counts carry the pool's `reserves.failover` and `reserves.burst`
on top (replicas kept beyond what the load needs; not a pool at zero, whose idle time says
nothing needs them). It is then bounded by [min, max] and stabilised as Kubernetes' HPA does: a
scale-up takes the lowest recommendation of the last `up_window` seconds, a scale-down the
highest of the last `down_window`, so a scale-down never comes sooner than `down_window` after
the recommendation that raised the count; each decision moves at most `max_step` replicas. A
pool idle for `idle_seconds` (with `min_replicas` 0 and no request held) goes to zero at once:
the idle time is its own stabilisation.

Never silent: signals that are missing or older than `stale_after` hold the count and say why
(`active` False, `why_inactive`); replicas the scheduler has found no node for over
`pending_grace` (no GPU to place them; a node autoscaler had that long to add one) stop the
count from growing and say so (`limited`, `why_limited`), instead of asking for more that
cannot be placed. Replicas that are placed and still starting do not: their engines load.

No overshoot from cold starts: the SLO signal adds a replica only once every replica asked for
is Ready and the SLO window has passed since the last scale-up, so the slow first requests of
fresh replicas (and the p95 of the load they were added for) do not ask for yet another; the
load signal needs no such rule (a fresh replica adds no load, it takes some).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Policy:
    min_replicas: int
    max_replicas: int
    target_load: float  # load_score per replica the pool is sized for
    target_kv_usage: float | None = None  # 0..1
    ttft_slo: float | None = None  # the pool's p95 SLOs, seconds
    tpot_slo: float | None = None
    up_window: float = 0.0
    down_window: float = 300.0
    max_step: int = 4
    idle_seconds: float | None = None  # to zero after this long without a request (min 0)
    stale_after: float = 60.0
    pending_grace: float = 120.0
    slo_window: float = 60.0  # what the p95s are measured over
    reserve: int = 0  # replicas kept beyond the load's count (reserves.failover + burst)
    rolling_out: bool = False  # a Rollout runs: never to zero (idle holds at 1 and says so)


@dataclass(frozen=True, slots=True)
class Signals:
    at: float  # when they were measured (the operator's clock)
    loads: tuple[float, ...] = ()  # load_score of each warm Ready replica
    kv_usage: tuple[float, ...] = ()  # its KV-cache use, 0..1
    ttft_p95: float | None = None
    tpot_p95: float | None = None
    held: int = 0  # requests the routers hold for the pool while it is at zero
    last_request_at: float | None = None
    missing: tuple[str, ...] = ()  # what should be there and is not, each a phrase


@dataclass(frozen=True, slots=True)
class Observed:
    current: int  # the replicas asked for now
    ready: int
    pending_since: float | None = None  # since when the oldest unplaceable replica waits
    unplaced: int = 0  # replicas the scheduler found no node for


@dataclass(slots=True)
class History:
    """Recommendations of the last window, (time, count), oldest first."""

    recommendations: list[tuple[float, int]] = field(default_factory=list)
    last_up_at: float | None = None  # the last scale-up (the SLO signal waits a window)


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int
    signal: str  # what decided: load, kvCache, slo, held, idle, min, max, stale, hold
    message: str = ""  # the deciding signal's numbers, for status and events
    active: bool = True
    why_inactive: str = ""
    limited: bool = False
    why_limited: str = ""

    @property
    def scaling_limited(self) -> bool:
        """Kept from the count the signals ask for: replicas that cannot be placed, or the
        min/max bounds (the ScalingLimited condition)."""
        return self.limited or self.signal in ("min", "max")


def _recommend(policy: Policy, signals: Signals, observed: Observed, history: History,
               now: float) -> tuple[int, str, str]:
    """The raw count the signals ask for, which signal asks for it, and its numbers."""
    current = observed.current
    if current == 0:
        return (1, "held", f"{signals.held} requests held") if signals.held > 0 else (
            0, "idle", "no request held")
    idle_since = signals.last_request_at
    # (Idle also means nothing running: a stream admitted before the idle window may still
    # be answering.)
    if (policy.idle_seconds is not None and policy.min_replicas == 0 and signals.held == 0
            and idle_since is not None and now - idle_since >= policy.idle_seconds
            and not any(signals.loads)):
        if policy.rolling_out:
            # An idle spell mid-rollout once took the pool to 0, and the promotion then scaled
            # the new revision to 0 and deleted stable: a rollout's silence is its own to judge.
            return 1, "rollout", (f"no request for {now - idle_since:.0f} s, but a rollout "
                                  "runs: not to zero (its maxWaitSeconds decides)")
        return 0, "idle", f"no request for {now - idle_since:.0f} s"
    # No warm replica measured: nothing says otherwise.
    wants = [(current, "hold", "no replica measured")]
    # The reserves ride on what the load and the KV cache ask for (a held count has them).
    reserved = f" + {policy.reserve} reserved" if policy.reserve else ""
    if signals.loads:
        load = sum(signals.loads)
        wants = [(math.ceil(load / policy.target_load - 1e-9) + policy.reserve, "load",
                  f"load {load:.1f} over {len(signals.loads)} replicas, target "
                  f"{policy.target_load:g} each{reserved}")]
    if policy.target_kv_usage and signals.kv_usage:
        used = sum(signals.kv_usage)
        wants.append((math.ceil(used / policy.target_kv_usage - 1e-9) + policy.reserve,
                      "kvCache", f"KV cache {used / len(signals.kv_usage):.0%} used on "
                      f"average, target {policy.target_kv_usage:.0%}{reserved}"))
    missed = [f"{name} p95 {p95:.3g} s over its SLO {slo:g} s" for name, slo, p95 in (
        ("TTFT", policy.ttft_slo, signals.ttft_p95), ("TPOT", policy.tpot_slo, signals.tpot_p95))
        if slo is not None and p95 is not None and p95 > slo]
    settled = observed.ready >= current and (
        history.last_up_at is None or now - history.last_up_at >= policy.slo_window)
    if missed and settled:
        wants.append((current + 1, "slo", "; ".join(missed)))
    return max(wants, key=lambda w: w[0])


def _bounded(policy: Policy, count: int, signal: str, message: str) -> tuple[int, str, str]:
    if signal == "idle" and count == 0:
        return 0, signal, message
    floor = max(policy.min_replicas, 1)
    if count < floor:
        return floor, "min", f"{message}; at least minReplicas {floor}"
    if count > policy.max_replicas:
        return policy.max_replicas, "max", \
            f"{message}: wants {count}, at most maxReplicas {policy.max_replicas}"
    return count, signal, message


def _inactive(signals: Signals | None, policy: Policy, now: float) -> str | None:
    if signals is None:
        return "no signals for this pool"
    if signals.missing:
        return "; ".join(signals.missing)
    if now - signals.at > policy.stale_after:
        return f"its signals are {now - signals.at:.0f} s old (over {policy.stale_after:.0f} s)"
    return None


def decide(policy: Policy, signals: Signals | None, observed: Observed, history: History,
           now: float) -> Decision:
    """The pool's desired replica count now; updates `history`."""
    current = observed.current
    why = _inactive(signals, policy, now)
    if why is not None or signals is None:
        return Decision(current, "stale", active=False,
                        why_inactive=f"{why}: holding {current} replicas")
    raw, signal, message = _bounded(policy, *_recommend(policy, signals, observed, history, now))
    if signal in ("idle", "held"):  # the idle time, or a waiting request, is the window
        history.recommendations.clear()
        desired = raw
    else:
        window = max(policy.up_window, policy.down_window)
        if not history.recommendations:  # (a restarted operator: as if the count had been
            history.recommendations = [(now, current)]  # recommended all along)
        older = [(t, c) for t, c in history.recommendations if now - t < window]
        ups = [raw] + [c for t, c in older if now - t < policy.up_window]
        downs = [raw] + [c for t, c in older if now - t < policy.down_window]
        history.recommendations = [*older, (now, raw)]
        desired = current
        if min(ups) > current:
            desired = min(ups)
        elif max(downs) < current:
            desired = max(downs)
        desired = max(current - policy.max_step, min(current + policy.max_step, desired))
    if desired > current and observed.pending_since is not None and \
            now - observed.pending_since > policy.pending_grace:
        waited = now - observed.pending_since
        return Decision(current, signal, message, limited=True, why_limited=(
            f"{observed.unplaced} replicas unschedulable for {waited:.0f} s (no node with a "
            f"free GPU fits them): holding {current}, not growing to {desired}"))
    if desired > current:
        history.last_up_at = now
    return Decision(desired, signal, message)
