"""The Rollout controller's decision, pure: `decide(view, evaluation, now) -> Decision`.

Input: the Rollout (spec, status, the pending request), what the pool serves and wants, how
ready the canary Deployment is, and the result of the analysis window that was due (queried by
the runtime between `due_window` and this call). Output: the Rollout's next status, the pool's
traffic table, how many canary replicas should exist, whether the canary is promoted, events,
and when to look again. The pool reconciler turns that into Deployments and the pool's status;
the router reads the traffic table. Status is the only memory, so a restart at any point
resumes the same step and recomputes the same window.

A rollout is (pool, target revision), not a digest of its policy: once it is promoted, rolled
back or aborted it is final until the pool's artifactRef moves away from that revision (back to
stable or to another) or a person asks `retry`. A policy edit applies to the next rollout, or to
the running one from its current step (a new attempt of the step under the new policy).

Invariants (property-tested): stable is never restarted by a rollout, and never scaled down
on a fixed-size pool (an autoscaled one shares its count: `shares`); a promotion needs a
passing last evaluation of the 100 % step (unless a person asked for it) and a Ready canary
replica (a promotion onto none left the pool with nothing Ready to serve); a
failed, waiting, inconclusive or erroring evaluation never advances a step; a query error
pauses and holds the weight, never rolls back by itself; no policy edit, restart or result
restarts a finished rollout; every wait that holds canary weight ends after
`analysis.maxWaitSeconds` with `analysis.onTimeout`.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from kvfleet.api.analysis import AnalysisConfigError, MetricPlan, Window, due, overall, plans
from kvfleet.api.labels import short_revision
from kvfleet.api.meta import Condition
from kvfleet.api.rollout import (
    MAX_EVALUATIONS,
    Evaluation,
    MetricEvaluation,
    Outcome,
    Phase,
    RequestAction,
    RolloutRequest,
    RolloutSpec,
    RolloutStatus,
    StepCounts,
    TimeoutAction,
)
from kvfleet.api.servingpool import SLOs, SyntheticTraffic, TrafficRole, TrafficTarget
from kvfleet.operator.conditions import Cond, merge_conditions
from kvfleet.operator.events import Event

SHADOW_STEP = -1
RUNNING = (Phase.SHADOW, Phase.PROGRESSING)
ACTIVE = (Phase.SHADOW, Phase.PROGRESSING, Phase.PAUSED, Phase.ROLLING_BACK)
# Paused for a query error: evaluation goes on and the rollout resumes by itself.
ANALYSIS_ERROR = "AnalysisError"
# How soon a pool its fleet wave holds looks again for a free place (kvfleet.operator.waves).
WAVE_RECHECK_SECONDS = 15.0


@dataclass(frozen=True)
class View:
    """What the decision reads."""

    spec: RolloutSpec
    status: RolloutStatus
    generation: int | None
    request: RolloutRequest | None
    pool_replicas: int
    slos: SLOs | None
    stable: str | None  # the pool's servingRevision
    target: str | None  # the revision the pool's spec asks for; None: missing or blocked
    target_artifact: str
    # What the target changes against stable (kvfleet.operator.revisions.describe_change).
    target_change: str = ""
    wave: str | None = None  # the fleet wave the target belongs to (kvfleet.operator.waves)
    held: str | None = None  # why the wave does not admit the target yet
    blocked: str | None = None  # why the target cannot be deployed
    canary_ready: int = 0  # ready replicas of the target revision's Deployment
    canary_problem: str | None = None  # why canary pods do not run (e.g. unschedulable)
    # An autoscaled pool's maxReplicas + rolloutSurge: stable and canary share the pool's
    # count (`shares`). None: a fixed count, which stable keeps whole beside the canary.
    surge_limit: int | None = None
    # Container restarts of the target's pods, and the latest one's pod and reason.
    canary_restarts: int = 0
    canary_restarted: str = ""
    stable_artifact: str = ""  # the pool's servingArtifact
    previous_ready: int = 0  # ready replicas of status.previousRevision's Deployment
    # The revisions that have a Deployment; None: not known (every one is taken to).
    deployed: frozenset[str] | None = None

    def has_deployment(self, revision: str | None) -> bool:
        return revision is not None and (self.deployed is None or revision in self.deployed)


@dataclass
class Decision:
    status: RolloutStatus
    traffic: list[TrafficTarget] = field(default_factory=list)
    # Replicas the canary revision's Deployment should have; None: it should not exist.
    canary_replicas: int | None = None
    # Replicas the stable revision's Deployment should have; None: the pool's whole count.
    stable_replicas: int | None = None
    promote: bool = False  # the pool's servingRevision becomes status.canaryRevision
    # An undo after promotion: the pool's servingRevision goes back to this (revision,
    # artifact), whose Deployment was kept.
    demote: tuple[str, str] | None = None
    # The revision that served before the promotion, kept (no traffic) at this many replicas.
    keep: tuple[str, int] | None = None
    # What the routers send themselves while a quiet pool's step is judged (probePrompts).
    synthetic: SyntheticTraffic | None = None
    events: list[Event] = field(default_factory=list)
    requeue_seconds: float | None = None
    # The request in the annotation is a retry that this status shows handled (the pool's
    # memory forgets the revision once it runs again: kvfleet.operator.refusals).
    retried: bool = False


def policy_hash(spec: RolloutSpec) -> str:
    """Digest of the policy a rollout runs, to notice an edit (never the rollout's identity:
    an operator upgrade that adds a default must not look like a new rollout)."""
    policy = spec.to_wire()
    policy.pop("poolRef", None)
    return hashlib.sha256(json.dumps(policy, sort_keys=True).encode()).hexdigest()[:16]


def step_name(spec: RolloutSpec, step: int | None) -> str:
    if step is None:
        return "not started"
    if step == SHADOW_STEP:
        return f"shadow {spec.shadow.percent if spec.shadow else 0}%"
    return f"step {step + 1}/{len(spec.steps)} weight {spec.steps[step].weight}%"


def _analysed(spec: RolloutSpec, step: int) -> bool:
    if step == SHADOW_STEP:
        return bool(spec.shadow and spec.shadow.analysis)
    return spec.steps[step].analysis


def metric_plans(spec: RolloutSpec, slos: SLOs | None, step: int) -> list[MetricPlan]:
    return plans(spec.analysis.metrics, slos, shadow=step == SHADOW_STEP,
                 agreement=spec.analysis.output_agreement, split=spec.analysis.by_prompt_length,
                 checks=spec.analysis.answer_checks)


def _plannable(view: View, step: int) -> bool:
    try:
        metric_plans(view.spec, view.slos, step)
    except AnalysisConfigError:
        return False  # `decide` says why in the Rollout's status; nothing to query
    return True


def due_window(view: View, now: datetime) -> Window | None:
    """The analysis window to query before `decide`, or None. A window is due once it ended
    `scrapeDelaySeconds` ago, so Prometheus has scraped its last requests."""
    status = view.status
    evaluating = status.phase in RUNNING or (
        status.phase == Phase.PAUSED and status.pause_reason == ANALYSIS_ERROR)
    step = status.current_step
    if (not evaluating or step is None or status.step_started_at is None
            or status.canary_revision != view.target or _promote_full(status)
            or not _analysed(view.spec, step) or not _plannable(view, step)):
        return None
    analysis = view.spec.analysis
    return due(status.step_started_at, analysis.interval_seconds, analysis.warmup_seconds,
               _done(status, step), now - timedelta(seconds=analysis.scrape_delay_seconds), step)


def baseline_window(status: RolloutStatus, window: Window) -> Window:
    """The window whose stable series a versus-stable metric compares with. At weight 100 the
    stable revision serves no live conversation, so it is stable's window of the latest step
    before (recorded in status: deterministic after a restart); otherwise `window` itself."""
    if window.step == SHADOW_STEP or status.current_weight < 100:
        return window
    before = [e for e in status.evaluations
              if e.revision == status.canary_revision and 0 <= e.step < window.step]
    if not before:
        return window
    last = before[-1]
    return Window(last.step, last.index, last.window_start, last.window_end)


def _done(status: RolloutStatus, step: int) -> set[int]:
    return {e.index for e in _attempt(status, step)}


def _attempt(status: RolloutStatus, step: int) -> list[Evaluation]:
    """The current step attempt's evaluations (a resume starts a new attempt)."""
    return [e for e in status.evaluations
            if e.revision == status.canary_revision and e.step == step
            and status.step_started_at is not None and e.window_start >= status.step_started_at]


def _promote_full(status: RolloutStatus) -> bool:
    return status.promote_full


def shares(total: int, canary_share: int, live_weight: int, limit: int | None
           ) -> tuple[int, int]:
    """(canary, stable) replicas while a rollout runs. `canary_share`: the percent of the
    pool's traffic the step gives the canary (live or shadow); `live_weight`: the live weight
    in effect now, which stable no longer serves.

    A fixed pool (`limit` None) keeps stable whole and adds the canary's share. An autoscaled
    pool shares the autoscaler's `total`: stable keeps the part its live traffic needs, the
    canary gets its step's part, each at least 1 (stable for its in-flight streams and a
    rollback's first requests), the sum at most `limit` (maxReplicas + rolloutSurge). Stable
    never gives way to a canary that has no traffic yet (it would serve its share
    overloaded), so where both do not fit the canary gets what is left and its step waits for
    room (`_needed`); only with rolloutSurge 0 at maxReplicas does stable give the canary its
    one replica. A pool asleep at 0 keeps stable at 0."""
    canary = max(1, math.ceil(total * canary_share / 100))
    if limit is None:
        return canary, total
    if total == 0:
        return canary, 0
    stable = max(1, math.ceil(total * (100 - live_weight) / 100))
    canary = max(1, min(canary, limit - stable))
    return canary, max(1, min(stable, limit - canary))


def _share(view: View, step: int) -> int:
    return (view.spec.shadow.percent if view.spec.shadow else 0) if step == SHADOW_STEP \
        else view.spec.steps[step].weight


def _needed(view: View, step: int) -> int:
    """Canary replicas a step needs before its weight moves: its share of the pool, at least
    one (and on an autoscaled pool at most what its limit holds beside one stable replica)."""
    share = _share(view, step)
    return shares(view.pool_replicas, share, share, view.surge_limit)[0]


def _no_room(view: View, step: int, live_weight: int) -> str | None:
    """Why an autoscaled pool's canary cannot have its step's replicas beside stable now."""
    limit, total = view.surge_limit, view.pool_replicas
    needed = _needed(view, step)
    canary, stable = shares(total, _share(view, step), live_weight, limit)
    if limit is None or canary >= needed:
        return None
    return (f"no room for {needed} canary replicas beside stable's {stable}: the pool runs "
            f"{total} replicas and a rollout may run {limit} (maxReplicas + rolloutSurge); "
            f"it goes on once the load lets the pool shrink, or raise spec.autoscaling."
            f"rolloutSurge by {needed - canary}")


def _synthetic(spec: RolloutSpec, status: RolloutStatus) -> SyntheticTraffic | None:
    """The requests the routers send themselves while a step with traffic is judged: a quiet
    pool's evidence (analysis.probePrompts)."""
    analysis, step = spec.analysis, status.current_step
    # (A pause on a query error still evaluates: its windows still need their samples.)
    evaluating = status.phase in RUNNING or (status.phase == Phase.PAUSED and
                                             status.pause_reason == ANALYSIS_ERROR)
    judged = evaluating and step is not None and _analysed(spec, step) and \
        status.step_started_at is not None and not status.promote_full and \
        (status.current_weight > 0 or status.shadow_percent > 0)
    if not analysis.probe_prompts or not judged:
        return None
    return SyntheticTraffic(prompts=analysis.probe_prompts,
                            rate_per_second=analysis.probe_rate_per_second,
                            max_tokens=analysis.probe_max_tokens)


def _traffic(spec: RolloutSpec, status: RolloutStatus) -> list[TrafficTarget]:
    """The pool's traffic table. While an analysed step has canary or shadow traffic, the
    routers also mirror greedy probes to the canary and stable (OutputAgreement)."""
    stable, canary = status.stable_revision, status.canary_revision
    if stable is None or canary is None:
        return []
    agreement = spec.analysis.output_agreement
    step = status.current_step
    probe = agreement.probe_percent if agreement.enabled and step is not None and \
        _analysed(spec, step) and not status.promote_full else 0
    table = [TrafficTarget(revision=stable, role=TrafficRole.STABLE,
                           weight=100 - status.current_weight)]
    if status.current_weight > 0:
        table.append(TrafficTarget(revision=canary, role=TrafficRole.CANARY,
                                   weight=status.current_weight, probe_percent=probe))
    if status.shadow_percent > 0:
        table.append(TrafficTarget(revision=canary, role=TrafficRole.SHADOW,
                                   shadow_percent=status.shadow_percent, probe_percent=probe))
    return table


class _Run:
    """One decision in progress: the status being edited, the events, the requeue time."""

    def __init__(self, view: View, now: datetime) -> None:
        self.view, self.now, self.spec = view, now, view.spec
        self.status = view.status.model_copy(deep=True)
        self.events: list[Event] = []
        self.requeue: float | None = None
        self.promote = False

    # -- helpers ----------------------------------------------------------------------------

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message))

    def wake_in(self, seconds: float) -> None:
        seconds = max(0.5, seconds)
        self.requeue = seconds if self.requeue is None else min(self.requeue, seconds)

    def where(self) -> str:
        return step_name(self.spec, self.status.current_step)

    def start(self, reason: str) -> None:
        """(Re)start from stable: no canary traffic, the first phase not yet effective."""
        view, s = self.view, self.status
        assert view.target is not None and view.stable is not None
        s.phase = Phase.SHADOW if self.spec.shadow else Phase.PROGRESSING
        s.stable_revision, s.canary_revision = view.stable, view.target
        s.canary_artifact = view.target_artifact
        s.canary_change = view.target_change or None
        s.wave = view.wave
        s.rollout_hash = policy_hash(self.spec)
        s.started_at, s.finished_at, s.drain_started_at = self.now, None, None
        s.live_since, s.canary_restarts_base = None, view.canary_restarts
        s.current_step = SHADOW_STEP if self.spec.shadow else 0
        s.current_weight, s.shadow_percent = 0, 0
        s.step_started_at, s.pause_reason, s.promote_full = None, None, False
        s.canary_waiting_since = None
        if s.previous_revision is not None:
            self.event("Normal", "PreviousReleased", f"revision "
                       f"{short_revision(s.previous_revision)}, kept since the last promotion "
                       "for an undo, is released: a new rollout starts")
        s.previous_revision = s.previous_artifact = s.previous_kept_until = None
        s.counts = StepCounts()
        s.message = f"{self.where()}: starting the canary revision"
        self.event("Normal", "RolloutStarted",
                   f"{reason}: {short_revision(view.stable)} -> "
                   f"{short_revision(view.target)} ({view.target_artifact})")

    def enter_step(self, step: int) -> None:
        s = self.status
        s.current_step, s.step_started_at, s.counts = step, None, StepCounts()
        s.canary_waiting_since = None
        if step != SHADOW_STEP:
            s.shadow_percent = 0

    def back_to_stable(self, phase: Phase, message: str, reason: str) -> None:
        s = self.status
        s.phase, s.message = phase, message
        s.current_weight, s.shadow_percent, s.pause_reason = 0, 0, None
        s.live_since = None
        s.drain_started_at = self.now
        self.event("Warning", reason, message)

    def time_out(self, reason: str, message: str) -> None:
        """A wait that holds canary weight hit its bound: the policy's declared action."""
        s, action = self.status, self.spec.analysis.on_timeout
        if action == TimeoutAction.ROLLBACK:
            self.back_to_stable(Phase.ROLLING_BACK, f"{message}; rolled back", "RollingBack")
            self.wake_in(self.spec.drain_seconds)
        elif action == TimeoutAction.HOLD:
            self.pause(reason, f"{message}; weight held: resume, promote or abort")
        else:
            # The step is no longer effective: a resume makes it so again, with a new window
            # (and a bake from then: the canary served no live traffic meanwhile).
            s.current_weight, s.shadow_percent, s.live_since = 0, 0, None
            s.step_started_at, s.counts = None, StepCounts()
            self.pause(reason, f"{message}; live traffic back on stable, canary pods kept "
                       "(on an autoscaled pool, those its rolloutSurge leaves room for): resume "
                       "to try the step again, or abort")

    def adopt_policy(self) -> None:
        """The policy was edited: a running rollout goes on from its current step under it (a
        new attempt of that step, or, when the steps changed, the last step at or below the
        weight it had); a finished one is not touched."""
        s, spec = self.status, self.spec
        s.rollout_hash = policy_hash(spec)
        if s.phase not in (*RUNNING, Phase.PAUSED) or s.current_step is None:
            return
        step = s.current_step
        if s.promote_full:
            new = len(spec.steps) - 1
        elif step == SHADOW_STEP:
            new = SHADOW_STEP if spec.shadow is not None else 0
        else:
            # Never more live exposure than was judged before the edit.
            new = max((i for i, st in enumerate(spec.steps) if st.weight <= s.current_weight),
                      default=0)
        share = (spec.shadow.percent if spec.shadow else 0) if new == SHADOW_STEP \
            else spec.steps[new].weight
        effective = s.step_started_at is not None
        current = s.shadow_percent if new == SHADOW_STEP else s.current_weight
        if new != step or (effective and share != current):
            self.enter_step(new)
        elif effective:
            s.step_started_at, s.counts = self.now, StepCounts()
        self.event("Normal", "PolicyChanged",
                   f"the Rollout's policy was edited: continuing at {self.where()}")

    def pause(self, reason: str, message: str) -> None:
        s = self.status
        if s.phase != Phase.PAUSED or s.pause_reason != reason:
            self.event("Warning" if reason != "Manual" else "Normal", "Paused",
                       f"{message} ({reason})")
        s.phase, s.pause_reason, s.message = Phase.PAUSED, reason, message

    def resume(self) -> None:
        s = self.status
        s.canary_restarts_base = self.view.canary_restarts  # (what a person resumed after)
        s.phase = Phase.SHADOW if s.current_step == SHADOW_STEP else Phase.PROGRESSING
        s.pause_reason, s.canary_waiting_since = None, None  # a resumed wait is bounded anew
        if s.step_started_at is not None:
            # A new attempt at the step: a fresh window, so the pause's traffic is judged anew.
            s.step_started_at, s.counts = self.now, StepCounts()

    # -- requests ---------------------------------------------------------------------------

    def handle(self, request: RolloutRequest) -> None:
        s = self.status
        if request.id == s.last_request_id:
            return
        s.last_request_id = request.id
        action, where = request.action, self.where()
        if action == RequestAction.ABORT and s.phase in ACTIVE and s.phase != Phase.ROLLING_BACK:
            self.back_to_stable(Phase.ABORTED, f"{where}: aborted on request; all traffic on "
                                "stable", "Aborted")
        elif action == RequestAction.RETRY and s.phase in (
                Phase.ABORTED, Phase.ROLLED_BACK, Phase.ROLLING_BACK, Phase.PAUSED):
            self.start("retried on request")
        elif action == RequestAction.PAUSE and s.phase in RUNNING:
            self.pause("Manual", f"{where}: paused on request; weight held")
        elif action == RequestAction.RESUME and s.phase == Phase.PAUSED:
            self.resume()
            self.event("Normal", "Resumed", f"{where}: resumed on request")
        elif action == RequestAction.PROMOTE and s.phase in (*RUNNING, Phase.PAUSED):
            if request.step != s.current_step:
                self.event("Normal", "RequestIgnored",
                           f"promote of step {request.step} ignored: the rollout is at {where}")
                return
            if self.nothing_to_promote_onto():
                self.event("Normal", "RequestIgnored", f"promote of {where} ignored: no Ready "
                           "canary replica to promote onto; ask again once one is Ready")
                return
            if s.phase == Phase.PAUSED:
                self.resume()
            self.event("Normal", "PromotedStep", f"{where} promoted on request")
            self.advance()
        elif action == RequestAction.UNDO and s.phase == Phase.PROMOTED and \
                s.previous_revision is not None:
            self.undo()
        elif action == RequestAction.PROMOTE_FULL and s.phase in (*RUNNING, Phase.PAUSED):
            s.phase, s.pause_reason, s.promote_full = Phase.PROGRESSING, None, True
            self.enter_step(len(self.spec.steps) - 1)
            self.event("Normal", "PromoteFull",
                       "full promotion on request: the canary goes to 100% without analysis")
        else:
            self.event("Normal", "RequestIgnored",
                       f"{action.value} does not apply to a rollout in phase {s.phase.value}")

    def undo(self) -> None:
        """All traffic back to the revision kept since the promotion, at once (it has a Ready
        replica; the pool scales it back to its count), and the promoted revision rolled back
        as any other: drained, removed, refused until retried."""
        s, previous, view = self.status, self.status.previous_revision, self.view
        assert previous is not None and s.canary_revision is not None
        why = None
        if view.target != s.canary_revision:
            # (A revert or a new artifact already moves the pool on; undoing under it would
            # remove the promoted revision with no drain while it still serves.)
            why = (f"the artifactRef no longer names the promoted revision (it asks for "
                   f"{view.target_artifact}): set it back, or let that change roll out")
        elif view.previous_ready < 1:
            why = (f"the previous revision {short_revision(previous)} has no Ready replica "
                   "to take the traffic back (see its pods' events)")
        if why is not None:
            self.event("Normal", "RequestIgnored", f"undo ignored: {why}")
            return
        promoted = f"{short_revision(s.canary_revision)} ({s.canary_artifact})"
        s.stable_revision, s.canary_waiting_since, s.finished_at = previous, None, None
        s.previous_revision = s.previous_kept_until = None
        self.back_to_stable(Phase.ROLLING_BACK, f"undone on request after promotion: all "
                            f"traffic back on {short_revision(previous)} "
                            f"({s.previous_artifact}); {promoted} rolled back", "RollingBack")
        self.wake_in(self.spec.drain_seconds)

    # -- steps ------------------------------------------------------------------------------

    def nothing_to_promote_onto(self) -> bool:
        """The last step, with no Ready canary replica: a promotion now would leave the pool
        nothing Ready to serve (its pods crashed or were evicted at the last step)."""
        step = self.status.current_step
        return step is not None and step + 1 >= len(self.spec.steps) and \
            self.view.canary_ready < 1

    def baking(self) -> bool:
        """The last step passed before the canary served live traffic `bakeSeconds`: it
        waits out the rest, still analysed (a person's promote-full does not wait)."""
        s, spec = self.status, self.spec
        step = s.current_step
        if step is None or step + 1 < len(spec.steps) or s.promote_full or \
                s.live_since is None:
            return False
        left = spec.bake_seconds - (self.now - s.live_since).total_seconds()
        if left <= 0:
            return False
        s.message = f"{self.where()}: passed; baking, {int(left + 0.999)}s left before promotion"
        self.wake_in(min(left, spec.analysis.interval_seconds))
        return True

    def restarted(self) -> bool:
        """The canary's pods restarted more than analysis.maxCanaryRestarts allows: the
        rollout fails whatever the metrics say (a crash after minutes, an OOM kill)."""
        view, s, spec = self.view, self.status, self.spec
        # (Replaced pods start from 0: the base follows the count down, never up.)
        s.canary_restarts_base = min(s.canary_restarts_base, view.canary_restarts)
        restarts = view.canary_restarts - s.canary_restarts_base
        if restarts <= spec.analysis.max_canary_restarts or s.canary_revision != view.target:
            return False
        message = (f"{self.where()}: the canary's pods restarted {restarts} times (at most "
                   f"{spec.analysis.max_canary_restarts}): {view.canary_restarted}")
        if spec.auto_rollback:
            self.back_to_stable(Phase.ROLLING_BACK, message + "; rolled back", "RollingBack")
            self.wake_in(spec.drain_seconds)
        else:
            self.pause("CanaryRestarted", message)
        return True

    def advance(self) -> None:
        s = self.status
        step = s.current_step if s.current_step is not None else SHADOW_STEP
        if step + 1 < len(self.spec.steps):
            self.enter_step(step + 1)
            s.phase = Phase.PROGRESSING
            s.message = f"{self.where()}: scaling the canary"
            return
        s.phase, s.finished_at, s.pause_reason = Phase.PROMOTED, self.now, None
        s.promote_full = False
        keep = self.spec.keep_previous_seconds
        s.previous_revision = s.stable_revision if keep else None
        s.previous_artifact = self.view.stable_artifact or None if keep else None
        s.previous_kept_until = self.now + timedelta(seconds=keep) if keep else None
        s.stable_revision = s.canary_revision
        s.current_weight, s.shadow_percent = 100, 0
        s.message = f"promoted {s.canary_artifact} ({short_revision(s.canary_revision or '')})"
        self.promote = True
        self.event("Normal", "Promoted", s.message)

    def record(self, window: Window, metrics: list[MetricEvaluation]) -> Outcome:
        s = self.status
        assert s.canary_revision is not None
        outcome = overall(metrics)
        s.evaluations.append(Evaluation(
            revision=s.canary_revision, step=window.step, index=window.index,
            window_start=window.start, window_end=window.end, outcome=outcome, metrics=metrics))
        del s.evaluations[:-MAX_EVALUATIONS]
        counts = s.counts
        attr = {Outcome.PASS: "passed", Outcome.FAIL: "failed", Outcome.WAITING: "waiting",
                Outcome.INCONCLUSIVE: "inconclusive", Outcome.ERROR: "errors"}[outcome]
        setattr(counts, attr, getattr(counts, attr) + 1)
        if outcome in (Outcome.FAIL, Outcome.ERROR):
            self.event("Warning", f"Analysis{outcome.value}",
                       f"{self.where()}: {_explain(metrics, outcome)}")
        return outcome

    def run_step(self, window: Window | None, results: list[MetricEvaluation] | None) -> None:
        """A running (or error-paused) phase whose step is effective."""
        s, spec = self.status, self.spec
        step = s.current_step
        assert step is not None and s.step_started_at is not None
        analysed = _analysed(spec, step) and not _promote_full(s)
        if analysed:
            try:
                metric_plans(spec, self.view.slos, step)
            except AnalysisConfigError as exc:
                # Nothing can judge the weight it holds (e.g. the pool's slos were removed).
                self.time_out("NoAnalysisMetrics", f"{self.where()}: {exc}")
                return
        if window is not None and results is not None and window.step == step \
                and window.index not in _done(s, step):
            outcome = self.record(window, results)
            if outcome == Outcome.ERROR:
                self.pause(ANALYSIS_ERROR, f"{self.where()}: analysis could not run, weight "
                           f"held until it can: {_explain(results, outcome)}")
            elif s.phase == Phase.PAUSED:  # the analysis runs again
                s.phase = Phase.SHADOW if step == SHADOW_STEP else Phase.PROGRESSING
                s.pause_reason = None
                self.event("Normal", "Resumed", f"{self.where()}: analysis runs again")
        if s.phase == Phase.PAUSED:
            if not self.stalled(step):
                self.wake_in(spec.analysis.interval_seconds)
            return
        attempt = _attempt(s, step)
        last = attempt[-1] if attempt else None
        if s.counts.failed >= spec.analysis.failure_limit:
            message = f"{self.where()}: {_explain(last.metrics if last else [], Outcome.FAIL)}"
            if spec.auto_rollback:
                self.back_to_stable(Phase.ROLLING_BACK, message + "; rolled back", "RollingBack")
                self.wake_in(spec.drain_seconds)
            else:
                self.pause("AnalysisFailed", message)
            return
        elapsed = (self.now - s.step_started_at).total_seconds()
        least = (spec.shadow.duration_seconds if spec.shadow else 0) if step == SHADOW_STEP \
            else spec.steps[step].pause_seconds
        passed = not analysed or (last is not None and last.outcome == Outcome.PASS)
        if elapsed >= least and passed and self.nothing_to_promote_onto():
            _wait_for_canary(self, 1)  # (bounded by capacityWaitSeconds, as a step's wait)
            return
        s.canary_waiting_since = None
        if elapsed >= least and passed and self.baking():
            return
        if elapsed >= least and passed:
            if spec.auto_promote or _promote_full(s):
                self.event("Normal", "StepPassed", f"{self.where()} passed")
                self.advance()
            else:
                s.message = f"{self.where()}: passed; waiting for a promote request"
            return
        if analysed and self.stalled(step):
            return
        s.message = f"{self.where()}: " + (
            _explain(last.metrics, last.outcome) if last is not None else
            "analysing" if analysed else f"{int(least - elapsed)}s left")
        if analysed:
            base = s.step_started_at + timedelta(seconds=spec.analysis.warmup_seconds
                                                 + spec.analysis.scrape_delay_seconds)
            done = _done(s, step)
            slot = max(done, default=0) + 1
            self.wake_in((base + timedelta(seconds=slot * spec.analysis.interval_seconds)
                          - self.now).total_seconds() + 0.05)
        if elapsed < least:
            self.wake_in(least - elapsed)

    def stalled(self, step: int) -> bool:
        """The step has gone `maxWaitSeconds` since its last passing window (or the start of
        its analysis) without a conclusive one: query errors, too few samples or inconclusive
        results. Then the timeout action applies and this says True."""
        s, analysis = self.status, self.spec.analysis
        attempt = _attempt(s, step)
        last = attempt[-1] if attempt else None
        if last is None or last.outcome in (Outcome.PASS, Outcome.FAIL):
            return False
        assert s.step_started_at is not None
        passes = [e.window_end for e in attempt if e.outcome == Outcome.PASS]
        since = passes[-1] if passes else \
            s.step_started_at + timedelta(seconds=analysis.warmup_seconds)
        waited = (self.now - since).total_seconds()
        if waited < analysis.max_wait_seconds:
            self.wake_in(analysis.max_wait_seconds - waited)
            return False
        reason = {Outcome.WAITING: "TooFewSamples", Outcome.INCONCLUSIVE: "Inconclusive",
                  Outcome.ERROR: "AnalysisUnavailable"}[last.outcome]
        self.time_out(reason, f"{self.where()}: no conclusive analysis in {int(waited)}s: "
                      f"{_explain(last.metrics, last.outcome)}")
        return True

    def make_effective(self) -> None:
        """The step's canary replicas are ready: its traffic takes effect now."""
        s, spec = self.status, self.spec
        step = s.current_step
        assert step is not None
        if step == SHADOW_STEP:
            s.shadow_percent = spec.shadow.percent if spec.shadow else 0
        else:
            s.current_weight = spec.steps[step].weight
            s.live_since = s.live_since or self.now
        s.step_started_at, s.canary_waiting_since = self.now, None
        s.counts = StepCounts()
        s.message = f"{self.where()}: traffic moved"
        self.event("Normal", "StepStarted", f"{self.where()}")


# status.message allows 1024 characters (the CRD's maxLength; a longer one makes the
# API server refuse the whole status write, so the rollout stops moving). The explanation
# gets most of it; the step and the action taken share the rest.
MESSAGE_MAX = 1024
EXPLAIN_MAX = 700


def _explain(metrics: list[MetricEvaluation], outcome: Outcome) -> str:
    relevant = [m for m in metrics if m.outcome == outcome] or metrics
    # One Prometheus outage fails every metric with the same text: say it once, with the
    # metrics it hit, instead of 33 copies.
    groups: dict[str, list[str]] = {}
    for m in relevant:
        groups.setdefault(m.message or f"{m.name} {m.outcome.value}", []).append(m.name)
    parts = [text if len(names) == 1 else f"{text} ({len(names)} metrics: {_names(names)})"
             for text, names in groups.items()]
    return _fit_parts(parts, EXPLAIN_MAX) or outcome.value.lower()


def _names(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f", +{len(names) - shown}" if len(names) > shown else "")


def _fit_parts(parts: list[str], limit: int) -> str:
    """`parts` joined with "; ": as many whole ones as fit in `limit`, then how many not."""
    def joined(keep: int) -> str:
        rest = len(parts) - keep
        return "; ".join(parts[:keep]) + (f"; and {rest} more" if rest else "")
    for keep in range(len(parts), 0, -1):
        if len(text := joined(keep)) <= limit:
            return text
    tail = joined(1)[len(parts[0]):] if parts else ""
    return _clip(parts[0], limit - len(tail)) + tail if parts else ""


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:max(0, limit - 1)] + "…"


def decide(view: View, window: Window | None, results: list[MetricEvaluation] | None,
           now: datetime) -> Decision:
    """The next status and actions. `results`: the metrics of `window` (from `due_window`)."""
    run = _Run(view, now)
    s = run.status
    if view.request is not None and view.request.action == RequestAction.UNDO:
        run.handle(view.request)  # (the promoted revision serves: no rollout runs to ask)
    # An undo the pool has not taken yet: it still serves the revision rolled back.
    undoing = s.phase in (Phase.ROLLING_BACK, Phase.ROLLED_BACK) and \
        view.stable is not None and view.stable == s.canary_revision != s.stable_revision
    if undoing and not view.has_deployment(s.stable_revision):
        # The kept revision went (deleted by hand) before the pool moved back to it: the
        # promoted revision serves on, and the Rollout says so rather than wait for ever.
        undoing, kept = False, s.stable_revision or ""
        s.phase, s.stable_revision = Phase.PROMOTED, s.canary_revision
        s.message = (f"undo abandoned: the Deployment of the kept revision "
                     f"{short_revision(kept)} ({s.previous_artifact}) is gone; "
                     f"{short_revision(s.canary_revision or '')} ({s.canary_artifact}) "
                     "serves on")
        run.event("Warning", "UndoAbandoned", s.message)
    nothing_to_do = not undoing and (
        view.target is None or view.stable is None or view.target == view.stable)
    held = not nothing_to_do and not undoing and view.held is not None and (
        s.canary_revision != view.target or s.phase not in ACTIVE)
    if nothing_to_do:
        _settle(run)
    elif held:
        _hold(run)
    elif undoing:
        pass  # the drain below; the pool moves its servingRevision back first
    else:
        assert view.target is not None
        if s.canary_revision != view.target or s.phase == Phase.IDLE:
            changed = s.phase in ACTIVE and s.canary_revision is not None
            change = view.target_change or f"artifactRef is now {view.target_artifact}"
            run.start(f"the revision changed during a rollout ({change}); restarted from "
                      "stable" if changed else change)
        elif s.rollout_hash != policy_hash(view.spec):
            run.adopt_policy()
        if view.request is not None:
            run.handle(view.request)
        _progress(run, window, results)
    request = view.request
    decision = Decision(status=s, events=run.events, requeue_seconds=run.requeue,
                        promote=run.promote,
                        retried=request is not None and request.action == RequestAction.RETRY
                        and s.last_request_id == request.id)
    if undoing and s.stable_revision is not None:
        decision.demote = (s.stable_revision, s.previous_artifact or "")
    if not nothing_to_do and not held:
        _actions(run, decision)
    _keep_previous(run, decision)
    s.observed_generation = view.generation
    s.message = _clip(s.message, MESSAGE_MAX)
    s.conditions = [Condition.model_validate(c) for c in _conditions(run, view)]
    return decision


def _keep_previous(run: _Run, decision: Decision) -> None:
    """After a promotion the revision that served before it stays, scaled down and without
    traffic, for spec.keepPreviousSeconds: an undo is then a scale-up, not a cold start."""
    s = run.status
    if s.previous_revision is None:
        return
    left = ((s.previous_kept_until or run.now) - run.now).total_seconds()
    gone = not run.view.has_deployment(s.previous_revision)
    if left > 0 and s.phase == Phase.PROMOTED and not gone:
        decision.keep = (s.previous_revision, run.spec.keep_previous_replicas)
        run.wake_in(left)
        decision.requeue_seconds = run.requeue
        return
    why = "its Deployment is gone" if gone else \
        f"spec.keepPreviousSeconds {run.spec.keep_previous_seconds}"
    run.event("Normal", "PreviousReleased",
              f"revision {short_revision(s.previous_revision)} ({s.previous_artifact}), kept "
              f"since the promotion for an undo, is released ({why})")
    s.previous_revision = s.previous_artifact = s.previous_kept_until = None
    decision.events = run.events


def _settle(run: _Run) -> None:
    """The pool serves its artifactRef (or cannot run it): no rollout runs."""
    view, s = run.view, run.status
    if view.request is not None and view.request.id != s.last_request_id:
        s.last_request_id = view.request.id
        run.event("Normal", "RequestIgnored",
                  f"{view.request.action.value}: no rollout is running")
    if s.phase in (Phase.SHADOW, Phase.PROGRESSING, Phase.PAUSED):
        why = (f"artifactRef {view.target_artifact} cannot be deployed: {view.blocked}"
               if view.target is None else "artifactRef is back on the serving revision")
        run.back_to_stable(Phase.ABORTED, f"{run.where()}: {why}; all traffic on stable",
                           "Aborted")
    elif s.phase == Phase.PROMOTED and view.stable == s.canary_revision:
        pass
    elif s.phase in (Phase.ABORTED, Phase.ROLLED_BACK, Phase.ROLLING_BACK) and \
            view.target is not None:
        # The artifactRef moved off the finished rollout's revision (a revert in Git): it is
        # released, and naming that revision again starts a new rollout of it.
        run.event("Normal", "RolloutReleased",
                  f"artifactRef is back on the serving revision; the {s.phase.value} rollout "
                  f"of {s.canary_artifact} is closed")
        s.phase, s.finished_at = Phase.IDLE, s.finished_at or run.now
        s.message = f"serving {view.target_artifact}"
    elif s.phase not in ACTIVE and s.phase not in (Phase.ABORTED, Phase.ROLLED_BACK):
        s.phase = Phase.IDLE
        s.message = f"serving {view.target_artifact}" if view.target else \
            f"artifactRef {view.target_artifact}: {view.blocked or 'not found'}"


def _hold(run: _Run) -> None:
    """A target its fleet wave does not admit yet: nothing starts, stable serves on, and the
    wave is looked at again soon (a place frees when another pool's rollout ends)."""
    s = run.status
    if s.phase not in (Phase.ABORTED, Phase.ROLLED_BACK):
        s.phase = Phase.IDLE
    if s.message != run.view.held:
        run.event("Normal", "WaitingForWave", run.view.held or "")
    s.message = run.view.held or ""
    run.wake_in(WAVE_RECHECK_SECONDS)


def _progress(run: _Run, window: Window | None, results: list[MetricEvaluation] | None) -> None:
    view, s = run.view, run.status
    if s.phase == Phase.PROMOTED:
        run.promote = True  # idempotent: the pool may not have taken it yet
        return
    if s.phase not in (*RUNNING, Phase.PAUSED) or run.restarted():
        return
    step = s.current_step
    assert step is not None
    if s.step_started_at is None:
        if s.phase == Phase.PAUSED:
            return
        needed = _needed(view, step)
        if view.canary_ready >= needed:
            run.make_effective()
        else:
            _wait_for_canary(run, needed, _no_room(view, step, s.current_weight))
            return
    if s.phase != Phase.PAUSED or s.pause_reason == ANALYSIS_ERROR:
        run.run_step(window, results)
        if s.phase in RUNNING and s.step_started_at is None and not run.promote:
            _progress(run, None, None)  # the next step: make it effective if it can be


def _wait_for_canary(run: _Run, needed: int, no_room: str | None = None) -> None:
    """The step waits for its canary replicas, never for ever: pods that cannot be placed (no
    free GPU, or no room under an autoscaled pool's limit), or that run but are not Ready (a
    model download and load can take minutes), wait at most spec.capacityWaitSeconds; then
    the timeout action applies, saying what is missing."""
    view, s = run.view, run.status
    problem = no_room or view.canary_problem
    s.message = (f"{run.where()}: waiting for canary replicas ({view.canary_ready}/{needed} "
                 "ready)" + (f": {problem}" if problem else ""))
    if s.canary_waiting_since is None:
        s.canary_waiting_since = run.now
    waited = (run.now - s.canary_waiting_since).total_seconds()
    bound = view.spec.capacity_wait_seconds
    if waited < bound:
        run.wake_in(bound - waited)
        return
    if no_room:
        run.time_out("InsufficientCapacity", f"{run.where()}: {no_room}; waited "
                     f"{int(waited)}s, stable serves on")
    elif view.canary_problem:
        run.time_out("InsufficientCapacity",
                     f"{run.where()}: the canary could not be placed in {int(waited)}s "
                     f"({view.canary_problem}); stable serves on; free or add GPUs (or set "
                     "the pool's reserves.deployment) and resume, or abort")
    else:
        run.time_out("CanaryNotReady", f"{run.where()}: the canary's pods were not Ready "
                     f"in {int(waited)}s ({view.canary_ready}/{needed}); see their events "
                     "and logs")


def _actions(run: _Run, decision: Decision) -> None:
    view, s = run.view, run.status
    if s.phase in (*RUNNING, Phase.PAUSED):
        step = s.current_step if s.current_step is not None else 0
        canary, stable = shares(view.pool_replicas, _share(view, step), s.current_weight,
                                view.surge_limit)
        if view.surge_limit is None:  # (a fixed pool keeps the canary pods it has)
            canary = max(canary, view.canary_ready if s.step_started_at is not None else 0)
        else:
            decision.stable_replicas = stable
        decision.canary_replicas = canary
        decision.traffic = _traffic(view.spec, s)
        decision.synthetic = _synthetic(view.spec, s)
    elif s.phase in (Phase.ROLLING_BACK, Phase.ABORTED) and s.drain_started_at is not None:
        left = view.spec.drain_seconds - (run.now - s.drain_started_at).total_seconds()
        if left > 0 and s.canary_revision == view.target:
            # In-flight streams finish on the canary; it has no new traffic.
            decision.canary_replicas = max(1, view.canary_ready)
            decision.traffic = _traffic(view.spec, s)
            run.wake_in(left)
            decision.requeue_seconds = run.requeue
        elif s.phase == Phase.ROLLING_BACK:
            s.phase, s.finished_at = Phase.ROLLED_BACK, run.now
            s.message = s.message.replace("; rolled back", "") + "; rolled back"
            run.event("Warning", "RolledBack", s.message)
    elif s.phase == Phase.PROMOTED:
        decision.promote = run.promote
    decision.events = run.events


def _conditions(run: _Run, view: View) -> list[dict[str, Any]]:
    s = run.status
    progressing = s.phase in (Phase.SHADOW, Phase.PROGRESSING, Phase.ROLLING_BACK)
    degraded = s.phase in (Phase.ROLLED_BACK, Phase.ROLLING_BACK) or (
        s.phase == Phase.PAUSED and s.pause_reason not in ("Manual", ANALYSIS_ERROR))
    decided = [
        Cond("Progressing", progressing, s.phase.value, s.message),
        Cond("Degraded", degraded, s.pause_reason or s.phase.value if degraded else "AsExpected",
             s.message if degraded else ""),
    ]
    waiting = None
    if s.phase in (*RUNNING, Phase.PAUSED) and s.step_started_at is None and \
            s.current_step is not None:
        waiting = _no_room(view, s.current_step, s.current_weight) or view.canary_problem
    decided.append(Cond("CapacityOK", not waiting,
                        "InsufficientCapacity" if waiting else "AsExpected", waiting or ""))
    ready = not progressing and not degraded and s.phase != Phase.PAUSED
    decided.append(Cond("Ready", ready, s.phase.value, s.message))
    previous = [c.to_wire() for c in s.conditions]
    return merge_conditions(previous, decided, view.generation, run.now)
