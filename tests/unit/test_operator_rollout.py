"""The Rollout controller's pure decision: steps, analysis outcomes, requests, restarts.

`_Sim` drives `decide` the way the runtime does: the due window is judged by a scripted
outcome, the canary becomes ready as soon as it is asked for, and the status goes through its
wire form between calls (what a restarted operator would read back)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet.api.analysis import (
    AnalysisConfigError,
    MetricPlan,
    QueryResult,
    Window,
    judge,
    overall,
    plans,
    render,
)
from kvfleet.api.builders import make_rollout
from kvfleet.api.rollout import (
    MAX_EVALUATED,
    Comparison,
    Metric,
    MetricEvaluation,
    MissingData,
    Outcome,
    OutputAgreement,
    Phase,
    PromptLengthSplit,
    RequestAction,
    RolloutRequest,
    RolloutSpec,
    RolloutStatus,
    SLOMetric,
)
from kvfleet.api.servingpool import SLOs, TrafficRole
from kvfleet.operator.rollout import (
    Decision,
    View,
    baseline_window,
    decide,
    due_window,
    policy_hash,
    shares,
)

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
STABLE, CANARY, OTHER = "a" * 64, "b" * 64, "c" * 64
SLO = SLOs(ttft_p95_seconds=0.5, tpot_p95_seconds=0.05, error_rate=0.01)
SLO_LOOSE = SLOs(ttft_p95_seconds=0.5, tpot_p95_seconds=0.05, error_rate=0.05)


def _spec(**changes: Any) -> RolloutSpec:
    """A policy judged every 10 s, with no bake unless `bakeSeconds` says (its own test)."""
    builder = make_rollout().set("spec.analysis", {"intervalSeconds": 10, "maxWaitSeconds": 60,
                                                   "scrapeDelaySeconds": 0})
    builder.set("spec.bakeSeconds", 0)
    for path, value in changes.items():
        builder.set(f"spec.{path}", value)
    return builder.obj().spec


@dataclass
class _Sim:
    spec: RolloutSpec
    outcomes: Callable[[Window], Outcome] = lambda w: Outcome.PASS
    replicas: int = 4
    now: datetime = T0
    status: RolloutStatus = field(default_factory=RolloutStatus)
    stable: str = STABLE
    target: str | None = CANARY
    change: str = ""  # what the target changes against stable
    ready: int = 0
    ready_revision: str | None = None  # whose Deployment `ready` counts
    request: RolloutRequest | None = None
    decisions: list[Decision] = field(default_factory=list)
    evaluated: list[Window] = field(default_factory=list)
    no_gpu: str | None = None  # canary pods cannot be placed, and why
    ready_cap: int | None = None  # canary pods beyond this run but never get Ready
    slos: SLOs | None = field(default_factory=lambda: SLO)
    metrics: Callable[[Window], list[MetricEvaluation]] | None = None  # overrides outcomes
    surge_limit: int | None = None  # autoscaled: maxReplicas + rolloutSurge
    previous_ready: int = 1  # ready replicas of the revision kept since a promotion

    def view(self) -> View:
        return View(spec=self.spec, status=self.status, generation=1, request=self.request,
                    pool_replicas=self.replicas, slos=self.slos, stable=self.stable,
                    target=self.target, target_artifact="qwen3-8b-v2", target_change=self.change,
                    canary_ready=self.ready if self.ready_revision == self.target else 0,
                    canary_problem=self.no_gpu, surge_limit=self.surge_limit,
                    stable_artifact="qwen3-8b-v1", previous_ready=self.previous_ready)

    def tick(self, seconds: float = 0.0) -> Decision:
        self.now += timedelta(seconds=seconds)
        view = self.view()
        window = due_window(view, self.now)
        results = None
        if window is not None:
            self.evaluated.append(window)
            results = self.metrics(window) if self.metrics else [
                MetricEvaluation(name="m", outcome=self.outcomes(window), message="scripted")]
        decision = decide(view, window, results, self.now)
        # Between reconciles only the wire form survives (the apiserver's copy).
        self.status = RolloutStatus.model_validate(decision.status.to_wire())
        self.ready = 0 if self.no_gpu else decision.canary_replicas or 0
        if self.ready_cap is not None:
            self.ready = min(self.ready, self.ready_cap)
        self.ready_revision = self.target
        if decision.promote:
            self.stable = self.status.canary_revision or self.stable
        if decision.demote is not None:
            self.stable = decision.demote[0]
        self.decisions.append(decision)
        return decision

    def decide_with(self, **view: Any) -> Decision:
        """One reconcile whose view differs from the sim's own (e.g. pod restarts)."""
        decision = decide(replace(self.view(), **view), None, None, self.now)
        self.status = RolloutStatus.model_validate(decision.status.to_wire())
        self.decisions.append(decision)
        return decision

    def run(self, seconds: float, every: float = 5.0) -> Decision:
        decision = self.tick()
        for _ in range(int(seconds / every)):
            decision = self.tick(every)
        return decision

    def ask(self, action: RequestAction, id: str, step: int | None = None) -> Decision:
        self.request = RolloutRequest(action=action, id=id, step=step)
        return self.tick()


def _events(sim: _Sim) -> list[str]:
    return [e.reason for d in sim.decisions for e in d.events]


def _table(decision: Decision) -> dict[str, int]:
    return {t.role.value: t.weight if t.role != TrafficRole.SHADOW else t.shadow_percent
            for t in decision.traffic}


# -- the happy path -----------------------------------------------------------------------


def test_a_good_canary_goes_through_every_step_and_is_promoted() -> None:
    sim = _Sim(_spec(shadow={"percent": 20, "durationSeconds": 20}))
    first = sim.tick()
    # Before the canary is ready nothing moves: stable keeps all traffic.
    assert first.status.phase == Phase.SHADOW and first.status.step_started_at is None
    assert first.canary_replicas == 1 and _table(first) == {"stable": 100}
    weights = []
    for _ in range(40):
        decision = sim.tick(5)
        weights.append(_table(decision).get("canary", 0))
        if decision.status.phase == Phase.PROMOTED:
            break
    assert decision.promote and sim.stable == CANARY
    assert decision.status.stable_revision == CANARY
    assert sorted(set(weights)) == [0, 10, 50, 100]  # 100: the final check before promotion
    assert decision.traffic == []  # promoted: the pool serves the canary, no table
    assert _events(sim).count("Promoted") == 1
    steps = [(w.step, w.index) for w in sim.evaluated]
    assert {s for s, _ in steps} == {-1, 0, 1, 2}
    # Canary replicas follow the weight (4 replicas: 10% -> 1, 50% -> 2, 100% -> 4).
    assert [d.canary_replicas for d in sim.decisions if d.canary_replicas] == sorted(
        d.canary_replicas for d in sim.decisions if d.canary_replicas)
    assert max(d.canary_replicas or 0 for d in sim.decisions) == 4
    # Afterwards the pool serves the canary: nothing to do, the status stays Promoted.
    assert sim.tick(5).status.phase == Phase.PROMOTED and _events(sim).count("Promoted") == 1


def test_shadow_phase_mirrors_without_moving_live_traffic() -> None:
    sim = _Sim(_spec(shadow={"percent": 30, "durationSeconds": 600}))
    sim.tick()
    decision = sim.tick(1)
    assert decision.status.phase == Phase.SHADOW
    assert _table(decision) == {"stable": 100, "shadow": 30}
    assert decision.status.current_weight == 0


def test_the_window_is_anchored_to_the_step_and_queried_at_its_end_once_scraped() -> None:
    sim = _Sim(_spec(analysis={"intervalSeconds": 10, "warmupSeconds": 5,
                               "scrapeDelaySeconds": 3}))
    sim.tick()
    sim.tick(1)
    started = sim.status.step_started_at
    assert started is not None
    sim.tick(14)  # 5 s warm-up + 10 s interval: not yet
    sim.tick(2)  # the window ended 1 s ago, but Prometheus may not have scraped its tail yet
    assert sim.evaluated == []
    # The operator asks to be woken when it is due, not a scrape interval too early.
    assert sim.decisions[-1].requeue_seconds == pytest.approx(2.05)
    sim.tick(2)  # now the first window is due: still the same window, queried at its end
    [window] = sim.evaluated
    assert window.start == started + timedelta(seconds=5)
    assert window.end == window.start + timedelta(seconds=10)
    assert window.range == "10s"
    evaluation = sim.status.evaluations[-1]
    assert (evaluation.window_start, evaluation.window_end) == (window.start, window.end)


def test_an_evaluation_recomputed_after_a_restart_is_not_counted_twice() -> None:
    sim = _Sim(_spec(steps=[{"weight": 50}, {"weight": 100}]))
    sim.tick()
    sim.tick(1)
    before = sim.status.model_copy(deep=True)
    sim.tick(11)  # evaluated, passed, on to step 2: written
    [first] = sim.evaluated
    written = sim.status.model_copy(deep=True)
    # The operator dies before that write lands; a restarted one reads `before`, a moment
    # later: it computes the very same window, and the result is recorded once.
    sim.status = before
    sim.tick(2)
    assert sim.evaluated == [first, first]
    keys = [(e.revision, e.step, e.index) for e in sim.status.evaluations]
    assert keys == [(CANARY, 0, 1)]
    assert sim.status.current_step == written.current_step == 1
    assert sim.status.counts == written.counts


# -- failures and safety ------------------------------------------------------------------


def test_a_failing_canary_rolls_back_traffic_first_and_drains() -> None:
    sim = _Sim(_spec(), outcomes=lambda w: Outcome.FAIL, replicas=2)
    sim.tick()
    sim.tick(1)
    assert _table(sim.decisions[-1]) == {"stable": 90, "canary": 10}
    rolling = sim.tick(10)
    assert rolling.status.phase == Phase.ROLLING_BACK
    assert _table(rolling) == {"stable": 100}  # the canary takes no new conversation
    assert rolling.canary_replicas == 1  # but keeps running for its in-flight streams
    assert "rolled back" in rolling.status.message and "step 1/3 weight 10%" in \
        rolling.status.message
    done = sim.tick(31)
    assert done.status.phase == Phase.ROLLED_BACK and done.canary_replicas is None
    assert done.traffic == [] and not done.promote
    assert _cond(done, "Degraded") == ("True", "RolledBack")
    # It stays rolled back (no second attempt by itself) until a retry or a new artifact.
    assert sim.run(120).status.phase == Phase.ROLLED_BACK


def test_auto_rollback_off_pauses_at_the_failed_step_holding_the_weight() -> None:
    sim = _Sim(_spec(autoRollback=False), outcomes=lambda w: Outcome.FAIL)
    sim.tick()
    sim.tick(1)
    paused = sim.tick(10)
    assert (paused.status.phase, paused.status.pause_reason) == (Phase.PAUSED, "AnalysisFailed")
    assert _table(paused) == {"stable": 90, "canary": 10}


def test_prometheus_down_briefly_pauses_and_holds_then_resumes_by_itself() -> None:
    down = {"on": True}
    sim = _Sim(_spec(), outcomes=lambda w: Outcome.ERROR if down["on"] else Outcome.PASS)
    sim.tick()
    sim.tick(1)
    paused = sim.run(45)  # under maxWaitSeconds (60)
    assert (paused.status.phase, paused.status.pause_reason) == (Phase.PAUSED, "AnalysisError")
    assert _table(paused) == {"stable": 90, "canary": 10}  # held: neither forward nor back
    assert paused.status.counts.errors >= 3 and paused.status.counts.failed == 0
    assert _cond(paused, "Degraded")[0] == "False"
    down["on"] = False
    resumed = sim.run(20)
    assert resumed.status.phase == Phase.PROGRESSING
    assert resumed.status.current_step is not None and resumed.status.current_step >= 1


def test_query_errors_past_max_wait_put_live_traffic_back_on_stable_and_say_why() -> None:
    """A custom query that returns two series, or a wrong --prometheus-url, errors for ever:
    the canary's weight must not be held without a bound."""
    down = {"on": True}
    sim = _Sim(_spec(steps=[{"weight": 50}, {"weight": 100}]),
               outcomes=lambda w: Outcome.ERROR if down["on"] else Outcome.PASS)
    sim.tick()
    sim.tick(1)
    assert _table(sim.decisions[-1]) == {"stable": 50, "canary": 50}
    held = sim.run(120)
    assert (held.status.phase, held.status.pause_reason) == (Phase.PAUSED,
                                                             "AnalysisUnavailable")
    assert _table(held) == {"stable": 100}
    assert held.canary_replicas is not None and held.canary_replicas >= 1  # pods kept
    assert _cond(held, "Degraded") == ("True", "AnalysisUnavailable")
    assert "no conclusive analysis in 6" in held.status.message
    assert "back on stable" in held.status.message
    assert _events(sim).count("Paused") == 2  # AnalysisError, then the timeout; not per loop
    # Nothing moves by itself once held at zero, however long it stays.
    assert sim.run(600).status.current_weight == 0
    down["on"] = False
    sim.ask(RequestAction.RESUME, "r1")
    again = sim.tick(1)
    assert again.status.phase == Phase.PROGRESSING and _table(again) == {"stable": 50,
                                                                         "canary": 50}
    assert sim.run(30).status.phase == Phase.PROMOTED


@pytest.mark.parametrize("same_text", [True, False])
def test_every_metric_erroring_at_once_still_writes_a_status_the_api_server_accepts(
        same_text: bool) -> None:
    """A Prometheus outage fails all 33 metrics, each with a long error. Their messages
    joined once passed status.message's 1024 characters: the API server refused every
    status write and the rollout could neither pause nor say why (seen in CI)."""
    def outage(window: Window) -> list[MetricEvaluation]:
        return [MetricEvaluation(
            name=f"metric-{i}", outcome=Outcome.ERROR,
            message=("prometheus unreachable: connection refused " if same_text else
                     f"query {i} failed: " + "x" * 200) * (10 if same_text else 2))
            for i in range(MAX_EVALUATED)]
    sim = _Sim(_spec(steps=[{"weight": 50}, {"weight": 100}]), metrics=outage)
    sim.tick()
    sim.tick(1)
    paused = sim.run(20)  # the sim keeps only what survives the CRD's schema
    assert (paused.status.phase, paused.status.pause_reason) == (Phase.PAUSED, "AnalysisError")
    assert len(paused.status.message) <= 1024
    if same_text:  # said once, with how many metrics it hit
        assert paused.status.message.count("prometheus unreachable") == 10
        assert f"({MAX_EVALUATED} metrics: metric-0, metric-1, metric-2, +{MAX_EVALUATED - 3})" in \
            paused.status.message
    else:  # as many whole ones as fit, then how many more
        assert "query 0 failed" in paused.status.message
        assert f"; and {MAX_EVALUATED - 1} more" in paused.status.message
    timed_out = sim.run(120)
    assert timed_out.status.pause_reason == "AnalysisUnavailable"
    assert len(timed_out.status.message) <= 1024 and "back on stable" in timed_out.status.message


@pytest.mark.parametrize(("action", "phase", "table"), [
    ("HoldAtZero", Phase.PAUSED, {"stable": 100}),
    ("Hold", Phase.PAUSED, {"stable": 90, "canary": 10}),
    ("Rollback", Phase.ROLLING_BACK, {"stable": 100}),
])
def test_the_timeout_action_is_the_policys(action: str, phase: Phase,
                                          table: dict[str, int]) -> None:
    sim = _Sim(_spec(analysis={"intervalSeconds": 10, "maxWaitSeconds": 30,
                               "scrapeDelaySeconds": 0, "onTimeout": action}),
               outcomes=lambda w: Outcome.INCONCLUSIVE)
    decision = sim.run(40)
    assert decision.status.phase == phase and _table(decision) == table
    assert _cond(decision, "Degraded")[0] == "True"


def test_too_few_samples_waits_then_pauses_never_passes() -> None:
    sim = _Sim(_spec(), outcomes=lambda w: Outcome.WAITING)
    decision = sim.run(200)
    assert (decision.status.phase, decision.status.pause_reason) == (Phase.PAUSED,
                                                                     "TooFewSamples")
    assert decision.status.current_step == 0 and _table(decision) == {"stable": 100}
    assert "no conclusive analysis in 60s" in decision.status.message
    assert _cond(decision, "Degraded") == ("True", "TooFewSamples")


def test_a_second_artifact_change_restarts_from_stable() -> None:
    sim = _Sim(_spec())
    sim.run(15)
    assert sim.status.current_step == 1
    sim.target = OTHER
    restarted = sim.tick(1)
    assert restarted.status.canary_revision == OTHER and restarted.status.current_step == 0
    assert _table(restarted) == {"stable": 100}
    assert "the revision changed during a rollout" in restarted.events[0].message


def test_a_settings_change_starts_a_rollout_that_names_it() -> None:
    sim = _Sim(_spec(), change="settings KVFLEET_MAX_MODEL_LEN (unset) -> 4096")
    started = sim.tick()
    assert started.status.canary_revision == CANARY
    assert started.status.canary_change == sim.change
    assert started.events[0].reason == "RolloutStarted"
    assert started.events[0].message.startswith(sim.change + ": aaaaaaaaaaaa -> bbbbbbbbbbbb")
    sim.run(15)
    sim.target, sim.change = OTHER, "image a -> b"
    restarted = sim.tick(1)
    assert "the revision changed during a rollout (image a -> b)" in restarted.events[0].message


def test_a_policy_edit_goes_on_from_the_current_step_never_above_its_weight() -> None:
    sim = _Sim(_spec())
    sim.run(15)
    sim.tick(1)
    assert (sim.status.current_step, sim.status.current_weight) == (1, 50)
    started = sim.status.started_at
    # A threshold edit: the same step, a new attempt judged under the new policy.
    sim.spec = _spec(**{"analysis.failureLimit": 2})
    edited = sim.tick(1)
    assert (edited.status.current_step, edited.status.current_weight) == (1, 50)
    assert edited.status.step_started_at == sim.now and edited.status.started_at == started
    assert "PolicyChanged" in _events(sim) and "RolloutStarted" not in [
        e.reason for e in edited.events]
    # New steps: the last one at or below the weight the canary has (25, not 75).
    sim.spec = _spec(steps=[{"weight": 25}, {"weight": 75}, {"weight": 100}])
    restepped = sim.tick(1)
    assert (restepped.status.current_step, _table(restepped)) == (0, {"stable": 75,
                                                                      "canary": 25})
    sim.target = STABLE  # Git reverted the artifactRef
    reverted = sim.tick(1)
    assert reverted.status.phase == Phase.ABORTED and reverted.traffic == []
    assert "back on the serving revision" in reverted.status.message


def test_a_rolled_back_revision_stays_out_whatever_the_policy_or_operator_does() -> None:
    sim = _Sim(_spec(), outcomes=lambda w: Outcome.FAIL)
    sim.run(60)
    assert sim.status.phase == Phase.ROLLED_BACK
    # A person tunes a threshold; an operator upgrade adds a default (a new policy digest).
    sim.spec = _spec(**{"analysis.failureLimit": 3})
    sim.outcomes = lambda w: Outcome.PASS
    after_edit = sim.run(120)
    sim.status.rollout_hash = "0" * 16
    after_upgrade = sim.run(120)
    for decision in (after_edit, after_upgrade):
        assert decision.status.phase == Phase.ROLLED_BACK
        assert decision.traffic == [] and decision.canary_replicas is None
    assert _events(sim).count("RolloutStarted") == 1
    # Only a person's retry, or the artifactRef naming it anew, tries it again.
    assert sim.ask(RequestAction.RETRY, "t1").status.phase == Phase.PROGRESSING


def test_naming_a_finished_revision_again_after_a_revert_starts_a_new_rollout() -> None:
    sim = _Sim(_spec(), outcomes=lambda w: Outcome.FAIL)
    sim.run(60)
    assert sim.status.phase == Phase.ROLLED_BACK
    sim.target = STABLE  # Git reverts the artifactRef: the rolled-back rollout is closed
    closed = sim.tick(1)
    assert closed.status.phase == Phase.IDLE and "RolloutReleased" in _events(sim)
    assert _cond(closed, "Degraded")[0] == "False"
    sim.target = CANARY  # and a later commit names the revision again, deliberately
    assert sim.tick(1).status.phase == Phase.PROGRESSING
    assert _events(sim).count("RolloutStarted") == 2


def test_a_promoted_rollout_is_not_restarted_by_a_policy_edit() -> None:
    sim = _Sim(_spec())
    sim.run(60)
    assert sim.status.phase == Phase.PROMOTED and sim.stable == CANARY
    sim.spec = _spec(steps=[{"weight": 5}, {"weight": 100}])
    assert sim.run(60).status.phase == Phase.PROMOTED
    assert _events(sim).count("RolloutStarted") == 1


def test_a_canary_that_runs_but_never_gets_ready_is_bounded() -> None:
    sim = _Sim(_spec(steps=[{"weight": 50}, {"weight": 100}], capacityWaitSeconds=60),
               replicas=2)
    sim.run(5)
    assert (sim.status.current_step, sim.status.current_weight) == (0, 50)
    sim.ready_cap = 1  # step 2 needs 2 canary replicas; the second never gets Ready
    waiting = sim.run(60)
    assert sim.status.current_step == 1
    assert _table(waiting) == {"stable": 50, "canary": 50}
    assert "waiting for canary replicas (1/2 ready)" in waiting.status.message
    held = sim.run(10)
    assert (held.status.phase, held.status.pause_reason) == (Phase.PAUSED, "CanaryNotReady")
    assert _table(held) == {"stable": 100} and _cond(held, "Degraded")[0] == "True"


@given(total=st.integers(0, 40), headroom=st.integers(0, 10), surge=st.integers(0, 12),
       share=st.sampled_from([1, 5, 10, 25, 50, 75, 100]), moved=st.booleans())
def test_an_autoscaled_pools_count_is_shared_in_proportion_within_its_surge(
        total: int, headroom: int, surge: int, share: int, moved: bool) -> None:
    maximum = max(1, total + headroom)
    limit = maximum + max(surge, 2 - maximum)  # (the API refuses a limit under 2)
    weight = share if moved else 0  # the step's weight in effect, or not yet
    canary, stable = shares(total, share, weight, limit)
    assert canary >= 1
    if total == 0:  # a pool asleep: stable stays asleep
        assert stable == 0
        return
    assert stable >= 1 and canary + stable <= limit
    full, live = math.ceil(total * share / 100), max(1, math.ceil(total * (100 - weight) / 100))
    # Stable keeps the share its live traffic needs (gives one replica only with no surge at
    # maxReplicas); the canary gets what is left of its step's share...
    assert stable == live or (stable == limit - 1 and live == limit)
    assert canary == max(1, min(full, limit - live))
    # ... which is all of it once the weight is in effect, with a surge of 1 or more.
    if moved and limit > maximum:
        assert canary == max(1, full)
    # A fixed pool keeps stable whole beside the canary.
    assert shares(total, share, weight, None) == (max(1, math.ceil(total * share / 100)), total)


def test_a_load_ramp_mid_rollout_grows_stable_and_canary_within_max_plus_surge() -> None:
    """The autoscaler raises the pool's count from 2 to 8 during the 50 % step: both revisions
    grow (stable kept its old count while only the canary was sized), never past 8 + 1."""
    sim = _Sim(_spec(steps=[{"weight": 50}, {"weight": 100}], capacityWaitSeconds=600),
               replicas=2, surge_limit=9,
               outcomes=lambda w: Outcome.WAITING if w.step == 0 and w.index > 0 else
               Outcome.PASS)
    sim.run(5)
    at_50 = sim.tick(1)
    assert at_50.status.current_weight == 50
    assert (at_50.canary_replicas, at_50.stable_replicas) == (1, 1)
    sim.replicas = 8
    ramped = sim.tick(1)
    assert (ramped.canary_replicas, ramped.stable_replicas) == (4, 4)
    # At maxReplicas the 100 % step finds no room for 8 canary replicas beside stable's 4:
    # stable keeps its share (never shrunk for a canary that has no traffic yet), the step
    # waits and says so.
    sim.outcomes = lambda w: Outcome.PASS
    sizes = []
    for _ in range(12):
        decision = sim.tick(5)
        sizes.append((decision.status.current_weight, decision.canary_replicas,
                      decision.stable_replicas))
    assert decision.status.current_step == 1 and decision.status.current_weight == 50
    assert set(sizes[-3:]) == {(50, 5, 4)}, sizes
    assert "no room for 8 canary replicas beside stable's 4" in decision.status.message
    assert "raise spec.autoscaling.rolloutSurge by 3" in decision.status.message
    assert _cond(decision, "CapacityOK")[0] == "False"
    # The load falls, the autoscaler shrinks the pool to 4: room, the weight moves, promoted.
    sim.replicas = 4
    for _ in range(30):
        decision = sim.tick(5)
        if decision.status.phase == Phase.PROMOTED:
            break
        sizes.append((decision.status.current_weight, decision.canary_replicas,
                      decision.stable_replicas))
    assert decision.promote, sizes
    assert all(c is not None and s is not None and c + s <= 9 for _, c, s in sizes), sizes
    assert (100, 4, 1) in sizes, sizes  # stable keeps one replica a rollback starts from


def test_a_fixed_pool_keeps_stable_whole_and_follows_its_count() -> None:
    sim = _Sim(_spec(steps=[{"weight": 50}, {"weight": 100}]), replicas=2)
    sim.run(5)
    assert sim.decisions[-1].stable_replicas is None  # the pool's count, whatever it is


def test_a_passing_last_step_with_no_ready_canary_waits_and_is_bounded() -> None:
    """Its pods crashed at the last step: promoting then left the pool nothing Ready."""
    sim = _Sim(_spec(steps=[{"weight": 100, "analysis": False, "pauseSeconds": 20}],
                     capacityWaitSeconds=60), replicas=2)
    assert sim.tick().canary_replicas == 2
    sim.tick(1)
    assert sim.status.current_weight == 100  # (the step took effect before the crash)
    sim.ready_cap = 0
    waiting = sim.run(30)
    assert waiting.status.phase == Phase.PROGRESSING and not waiting.promote
    assert "waiting for canary replicas (0/1 ready)" in waiting.status.message
    sim.ask(RequestAction.PROMOTE, "p1", step=0)
    assert "no Ready canary replica to promote onto" in " ".join(
        e.message for e in sim.decisions[-1].events)
    held = sim.run(60)
    assert (held.status.phase, held.status.pause_reason) == (Phase.PAUSED, "CanaryNotReady")
    assert not any(d.promote for d in sim.decisions)
    sim.ready_cap = None  # Ready again: resumed, it promotes
    sim.ask(RequestAction.RESUME, "r1")
    assert sim.run(20).promote


def test_a_passing_canary_bakes_on_live_traffic_before_promotion() -> None:
    """Default bake: the canary serves live traffic 300 s before stable goes, however fast its
    steps pass; a person's promote-full does not wait."""
    sim = _Sim(make_rollout().set("spec.steps", [{"weight": 50}, {"weight": 100}]).set(
        "spec.analysis", {"intervalSeconds": 10, "scrapeDelaySeconds": 0}).obj().spec)
    assert sim.spec.bake_seconds == 300
    sim.tick()
    sim.tick(1)
    live = sim.status.live_since
    assert live is not None and sim.status.current_weight == 50
    baking = sim.run(60)
    assert baking.status.current_weight == 100 and not baking.promote
    assert "baking" in baking.status.message and "left before promotion" in baking.status.message
    assert sim.run(300).status.phase == Phase.PROMOTED
    promoted_at = next(d.status.finished_at for d in sim.decisions if d.promote)
    assert promoted_at is not None and (promoted_at - live).total_seconds() >= 300
    # Every window of the bake was still judged: a failure then rolls back.
    assert len([w for w in sim.evaluated if w.step == 1]) >= 20
    quick = _Sim(sim.spec)
    quick.tick()
    quick.tick(1)
    quick.ask(RequestAction.PROMOTE_FULL, "full")
    assert quick.run(30).status.phase == Phase.PROMOTED


def test_a_canary_that_crashes_after_minutes_is_rolled_back_not_promoted() -> None:
    """Its pods restart 3 minutes in (an OOM kill): the metrics of the surviving windows pass,
    the restart watch stops it, during the bake if need be."""
    sim = _Sim(_spec(steps=[{"weight": 50}, {"weight": 100}], bakeSeconds=300))
    sim.run(170)
    assert sim.status.phase == Phase.PROGRESSING and sim.status.current_weight == 100
    restarted = sim.view()
    sim.view = lambda: replace(restarted, canary_restarts=1,  # type: ignore[method-assign]
                               canary_restarted="pod chat-b-1 OOMKilled (exit 137)",
                               status=sim.status, canary_ready=sim.ready)
    back = sim.tick(5)
    assert back.status.phase == Phase.ROLLING_BACK and _table(back) == {"stable": 100}
    assert "restarted 1 times (at most 0): pod chat-b-1 OOMKilled (exit 137); rolled back" in \
        back.status.message
    assert not any(d.promote for d in sim.decisions)
    # A policy that allows restarts, or pauses instead of rolling back, says so.
    lenient = _Sim(_spec(steps=[{"weight": 100}], analysis={
        "intervalSeconds": 10, "scrapeDelaySeconds": 0, "maxCanaryRestarts": 2},
        autoRollback=False))
    lenient.tick()
    assert lenient.decide_with(canary_restarts=2).status.phase == Phase.PROGRESSING
    paused = lenient.decide_with(canary_restarts=3, canary_restarted="pod x Error (exit 1)")
    assert (paused.status.phase, paused.status.pause_reason) == (Phase.PAUSED,
                                                                "CanaryRestarted")
    # A person resumes: the restarts before it are behind them (they were not, and the
    # rollout paused again in the same decision); three more stop it again.
    lenient.request = RolloutRequest(action=RequestAction.RESUME, id="r1")
    assert lenient.decide_with(canary_restarts=3).status.phase == Phase.PROGRESSING
    lenient.request = None
    assert lenient.decide_with(canary_restarts=5).status.phase == Phase.PROGRESSING
    assert lenient.decide_with(canary_restarts=6).status.phase == Phase.PAUSED


def test_removing_the_pools_slos_mid_step_says_so_without_failing_the_reconcile() -> None:
    sim = _Sim(_spec(**{"analysis.outputAgreement": {"enabled": False}}))
    sim.run(6)
    assert sim.status.current_weight == 10
    sim.slos = None
    assert due_window(sim.view(), sim.now + timedelta(seconds=30)) is None  # no exception
    held = sim.tick(30)
    assert (held.status.phase, held.status.pause_reason) == (Phase.PAUSED, "NoAnalysisMetrics")
    assert "spec.slos" in held.status.message and _table(held) == {"stable": 100}


def test_not_ready_canary_holds_and_reports_capacity() -> None:
    sim = _Sim(_spec())
    view = sim.view()
    blocked = View(**{**view.__dict__, "canary_problem": "0/3 nodes: 3 Insufficient "
                      "nvidia.com/gpu"})
    decision = decide(blocked, None, None, T0)
    assert decision.status.step_started_at is None and _table(decision) == {"stable": 100}
    assert _cond(decision, "CapacityOK") == ("False", "InsufficientCapacity")
    assert "Insufficient nvidia.com/gpu" in decision.status.message


def test_a_canary_without_gpus_waits_a_bounded_time_then_pauses_saying_why() -> None:
    sim = _Sim(_spec(capacityWaitSeconds=60), no_gpu="0/3 nodes: 3 Insufficient nvidia.com/gpu")
    waiting = sim.run(55)
    assert waiting.status.phase == Phase.PROGRESSING and _table(waiting) == {"stable": 100}
    assert waiting.requeue_seconds is not None and waiting.requeue_seconds <= 5
    paused = sim.run(10)
    assert (paused.status.phase, paused.status.pause_reason) == (Phase.PAUSED,
                                                                 "InsufficientCapacity")
    assert "could not be placed in 60s (0/3 nodes: 3 Insufficient nvidia.com/gpu)" in \
        paused.status.message
    assert _cond(paused, "Degraded") == ("True", "InsufficientCapacity")
    assert _cond(paused, "CapacityOK") == ("False", "InsufficientCapacity")
    assert _table(paused) == {"stable": 100} and paused.canary_replicas == 1
    assert _events(sim).count("Paused") == 1
    # GPUs freed and a person resumes: the wait starts anew, the canary gets its traffic.
    sim.no_gpu = None
    resumed = sim.ask(RequestAction.RESUME, "r1")
    assert resumed.status.phase == Phase.PROGRESSING
    assert sim.tick(1).status.current_weight == 10


# -- requests -----------------------------------------------------------------------------


def test_requests_are_idempotent_and_a_repeated_promote_skips_one_step() -> None:
    sim = _Sim(_spec(autoPromote=False), outcomes=lambda w: Outcome.WAITING)
    sim.tick()
    sim.tick(1)
    assert sim.status.current_step == 0
    sim.ask(RequestAction.PROMOTE, "p1", step=0)
    assert sim.status.current_step == 1
    sim.tick(1)  # the same annotation seen again: nothing
    sim.ask(RequestAction.PROMOTE, "p2", step=0)  # a second click made for step 0: stale
    assert sim.status.current_step == 1
    assert "RequestIgnored" in _events(sim)
    sim.ask(RequestAction.PAUSE, "x1")
    sim.ask(RequestAction.PAUSE, "x2")
    assert (sim.status.phase, sim.status.pause_reason) == (Phase.PAUSED, "Manual")
    sim.ask(RequestAction.RESUME, "r1")
    sim.ask(RequestAction.RESUME, "r1")
    assert sim.status.phase == Phase.PROGRESSING
    sim.ask(RequestAction.ABORT, "a1")
    sim.ask(RequestAction.ABORT, "a2")
    assert sim.status.phase == Phase.ABORTED and _events(sim).count("Aborted") == 1
    sim.ask(RequestAction.RETRY, "t1")
    sim.ask(RequestAction.RETRY, "t1")
    assert sim.status.phase == Phase.PROGRESSING and sim.status.current_step == 0
    assert _events(sim).count("RolloutStarted") == 2


def test_promote_full_goes_to_100_without_analysis() -> None:
    sim = _Sim(_spec(), outcomes=lambda w: Outcome.WAITING)
    sim.tick()
    sim.ask(RequestAction.PROMOTE_FULL, "f1")
    decision = sim.run(10)
    assert decision.status.phase == Phase.PROMOTED and sim.stable == CANARY


# -- property: random outcomes, restarts and requests -------------------------------------

OUTCOMES = st.sampled_from(list(Outcome))
ACTIONS = st.one_of(st.none(), st.sampled_from(list(RequestAction)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outcomes=st.lists(OUTCOMES, min_size=1, max_size=30),
       actions=st.lists(st.tuples(ACTIONS, st.integers(-1, 3)), max_size=30),
       gaps=st.lists(st.sampled_from([0.0, 1.0, 5.0, 11.0, 40.0]), min_size=1, max_size=30),
       auto_rollback=st.booleans(), shadow=st.booleans())
def test_never_promotes_on_a_bad_last_evaluation_and_always_settles(
        outcomes: list[Outcome], actions: list[tuple[RequestAction | None, int]],
        gaps: list[float], auto_rollback: bool, shadow: bool) -> None:
    script: Iterator[Outcome] = iter(outcomes)
    spec = _spec(autoRollback=auto_rollback,
                 **({"shadow": {"percent": 10, "durationSeconds": 5}} if shadow else {}))
    sim = _Sim(spec, outcomes=lambda w: next(script, Outcome.WAITING))
    sim.tick()
    manual = False
    for i, gap in enumerate(gaps):
        action, step = actions[i] if i < len(actions) else (None, 0)
        before = sim.status.model_copy(deep=True)
        if action is not None:
            sim.request = RolloutRequest(action=action, id=f"r{i}", step=step)
        decision = sim.tick(gap)
        handled = action is not None and before.last_request_id != f"r{i}"
        manual = manual or (handled and action in (RequestAction.PROMOTE,
                                                   RequestAction.PROMOTE_FULL))
        if decision.promote and before.phase != Phase.PROMOTED and not manual:
            last = decision.status.evaluations[-1]
            assert last.outcome == Outcome.PASS and last.step == len(spec.steps) - 1
        if sim.decisions[-1].status.counts.errors and before.phase != Phase.ROLLING_BACK:
            # A query error never moves traffic back by itself.
            assert not (before.phase in (Phase.PROGRESSING, Phase.PAUSED)
                        and decision.status.phase == Phase.ROLLING_BACK
                        and decision.status.evaluations[-1].outcome == Outcome.ERROR)
        # The table always gives stable its share; weights add to 100.
        live = [t for t in decision.traffic if t.role != TrafficRole.SHADOW]
        assert not live or sum(t.weight for t in live) == 100
        assert all(t.revision == STABLE for t in live if t.role == TrafficRole.STABLE)
    sim.request = None
    final = sim.run(900, every=15).status.phase
    assert final in (Phase.PROMOTED, Phase.ROLLED_BACK, Phase.PAUSED, Phase.ABORTED)


POLICY_EDITS = st.sampled_from([
    {}, {"analysis.failureLimit": 2}, {"steps": [{"weight": 25}, {"weight": 100}]},
    {"shadow": {"percent": 10, "durationSeconds": 5}}, {"analysis.onTimeout": "Rollback"},
    {"analysis.onTimeout": "Hold"}, {"autoRollback": False}])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outcomes=st.lists(OUTCOMES, min_size=1, max_size=30),
       edits=st.lists(st.one_of(st.none(), POLICY_EDITS), max_size=30),
       lost_writes=st.lists(st.booleans(), max_size=30),
       gaps=st.lists(st.sampled_from([0.0, 1.0, 5.0, 11.0, 40.0, 70.0]), min_size=1,
                     max_size=30))
def test_no_edit_restart_or_result_revives_a_finished_rollout_or_promotes_a_failed_one(
        outcomes: list[Outcome], edits: list[dict[str, Any] | None], lost_writes: list[bool],
        gaps: list[float]) -> None:
    script: Iterator[Outcome] = iter(outcomes)
    sim = _Sim(_spec(), outcomes=lambda w: next(script, Outcome.FAIL))
    sim.tick()
    for i, gap in enumerate(gaps):
        edit = edits[i] if i < len(edits) else None
        if edit is not None:
            sim.spec = _spec(**edit)
        before = sim.status.model_copy(deep=True)
        finished = before.phase in (Phase.ROLLED_BACK, Phase.ABORTED)
        decision = sim.tick(gap)
        if finished:
            assert decision.status.phase == before.phase
            assert decision.traffic == [] and decision.canary_replicas is None
        if before.phase == Phase.ROLLING_BACK:
            assert decision.status.phase in (Phase.ROLLING_BACK, Phase.ROLLED_BACK)
        if decision.status.phase == Phase.PROMOTED and before.phase != Phase.PROMOTED:
            last = decision.status.evaluations[-1]
            assert last.outcome == Outcome.PASS and last.step == len(sim.spec.steps) - 1
        if i < len(lost_writes) and lost_writes[i]:
            sim.status = before  # the operator died before its status write landed


# -- analysis: judging results ------------------------------------------------------------


def _plan(**kw: Any) -> MetricPlan:
    base = dict(name="ttft", query="q", samples_query="s", threshold=1.5,
                comparison=Comparison.AT_MOST, versus_stable=True, min_samples=10,
                on_missing=MissingData.INCONCLUSIVE)
    return MetricPlan(**{**base, **kw})


def test_judge_ratio_samples_missing_data_and_errors() -> None:
    good, slow = QueryResult(0.2, 100), QueryResult(0.38, 100)
    assert judge(_plan(), good, good).outcome == Outcome.PASS
    failed = judge(_plan(), slow, good)
    assert failed.outcome == Outcome.FAIL and failed.message == "ttft canary/stable 1.9 > 1.5"
    assert judge(_plan(), QueryResult(0.2, 3), good).outcome == Outcome.WAITING
    assert judge(_plan(), QueryResult(None, 50), good).outcome == Outcome.INCONCLUSIVE
    assert judge(_plan(), QueryResult(float("nan"), 50), good).outcome == Outcome.INCONCLUSIVE
    assert judge(_plan(on_missing=MissingData.FAIL), QueryResult(None, 50),
                 good).outcome == Outcome.FAIL
    assert judge(_plan(), QueryResult(error="connection refused"), good).outcome == \
        Outcome.ERROR
    zero = QueryResult(0.0, 100)
    assert judge(_plan(), zero, zero).outcome == Outcome.PASS  # 0/0: as good as stable
    assert judge(_plan(), good, zero).outcome == Outcome.FAIL  # x/0: infinitely worse
    absolute = _plan(versus_stable=False, threshold=0.25)
    assert judge(absolute, good, None).outcome == Outcome.PASS


def test_an_error_rate_passes_only_when_its_requests_show_it_under_the_threshold() -> None:
    """Seen in the e2e: a canary ending 1 stream in 5 with an error passed its 50 % step on a
    window of 12 requests none of which failed (0.8^12 = 7 %), and reached 100 %. A rate
    passes only when its samples bound it under the threshold; until then it waits."""
    errors = next(p for p in plans([], SLO, shadow=False) if p.name == "errorrate")
    assert errors.proportion and errors.threshold == 0.01
    few = judge(errors, QueryResult(0.0, 60), None)  # over minSamples (50), but not enough
    assert few.outcome == Outcome.WAITING
    assert few.message == ("errorrate 0 from 60 requests: the rate could be up to 0.0432, "
                           "over 0.01 (need 268 with none failed)")
    assert judge(errors, QueryResult(0.0, 267), None).outcome == Outcome.WAITING
    assert judge(errors, QueryResult(0.0, 268), None).outcome == Outcome.PASS
    assert judge(errors, QueryResult(1 / 60, 60), None).outcome == Outcome.FAIL
    # Versus stable, or with the user's own samples query, it is the ratio the user asked.
    ratio = plans([Metric(name="e", slo=SLOMetric.ERROR_RATE, versus_stable=True,
                          threshold=2.0)], SLO, shadow=False)[0]
    assert not ratio.proportion
    # "Not one error" (threshold 0) cannot be bounded: no error passes, any error fails.
    zero = plans([Metric(name="e", slo=SLOMetric.ERROR_RATE, threshold=0.0)], SLO,
                 shadow=False)[0]
    assert judge(zero, QueryResult(0.0, 60), None).outcome == Outcome.PASS


@settings(max_examples=60, deadline=None)
@given(threshold=st.sampled_from([0.01, 0.02, 0.05, 0.1]), factor=st.floats(2.0, 10.0),
       samples=st.integers(12, 2000), seed=st.integers(0, 2**32 - 1))
def test_a_revision_failing_twice_the_threshold_almost_never_passes_a_window(
        threshold: float, factor: float, samples: int, seed: int) -> None:
    import random
    errors = plans([Metric(name="e", slo=SLOMetric.ERROR_RATE, threshold=threshold,
                           min_samples=12)], SLO, shadow=False)[0]
    rate = min(1.0, threshold * factor)
    rng = random.Random(seed)
    passes = sum(
        judge(errors, QueryResult(sum(rng.random() < rate for _ in range(samples)) / samples,
                                  samples), None).outcome == Outcome.PASS
        for _ in range(40))
    assert passes <= 2  # a one-sided 95 % bound: at most 5 % of windows by chance


def test_default_metrics_come_from_the_pools_slos() -> None:
    live = plans([], SLO, shadow=False)
    assert [p.name for p in live] == ["ttftp95", "tpotp95", "errorrate"]
    assert [p.threshold for p in live] == [0.5, 0.05, 0.01]
    shadow = plans([], SLO, shadow=True)  # no TTFT/TPOT series for shadow copies
    assert [p.name for p in shadow] == ["errorrate", "e2ep95-vs-stable"]
    with pytest.raises(AnalysisConfigError, match=r"pool declares no spec\.slos"):
        plans([], None, shadow=False)
    with pytest.raises(AnalysisConfigError, match="has no threshold"):
        plans([Metric(name="e2e", slo=SLOMetric.E2E_P95)], SLO, shadow=False)


def test_queries_select_the_routers_series_for_the_revision_and_window() -> None:
    [ttft] = plans([Metric(name="t", slo=SLOMetric.TTFT_P95)], SLO, shadow=False)
    window = Window(0, 3, T0, T0 + timedelta(seconds=95))
    text = render(ttft.query, pool="chat", namespace="llm", revision=CANARY, traffic="live",
                  window=window)
    assert text == ("histogram_quantile(0.95, sum by (le) (increase("
                    "kvfleet_router_time_to_first_token_seconds_bucket{namespace=\"llm\","
                    "pool=\"chat\","
                    f"revision=\"{CANARY[:12]}\",traffic=~\"live|synthetic\"}}[95s])))")
    # (A quiet pool's synthetic requests count with the live; the shadow phase's copies alone.)
    assert 'traffic=~"shadow"' in render(ttft.query, pool="chat", namespace="llm",
                                         revision=CANARY, traffic="shadow", window=window)


def test_answer_agreement_judges_every_analysed_step_by_default() -> None:
    spec = _spec()
    [agree] = [p for p in plans(spec.analysis.metrics, SLO, shadow=True,
                                agreement=spec.analysis.output_agreement)
               if p.name == "output-agreement"]
    assert (agree.threshold, agree.comparison, agree.min_samples) == (0.9, Comparison.AT_LEAST,
                                                                      20)
    assert not agree.versus_stable and agree.detail_query is not None
    text = render(agree.query, pool="chat", namespace="llm", revision=CANARY, traffic="shadow",
                  window=Window(0, 1, T0, T0 + timedelta(seconds=8)))
    assert 'kind="agreed"' in text and "traffic" not in text  # probes have no traffic kind
    off = _spec(**{"analysis.outputAgreement": {"enabled": False}})
    assert all(p.name != "output-agreement" for p in plans(
        off.analysis.metrics, SLO, shadow=False, agreement=off.analysis.output_agreement))
    # The table asks the routers for probes while an analysed step has canary traffic.
    sim = _Sim(spec)
    sim.tick()
    [canary] = [t for t in sim.tick(1).traffic if t.role == TrafficRole.CANARY]
    assert canary.probe_percent == 20
    sim = _Sim(off)
    sim.tick()
    assert all(t.probe_percent == 0 for t in sim.tick(1).traffic)


def test_policy_hash_covers_the_policy_not_the_pool() -> None:
    spec = _spec()
    assert policy_hash(spec) != policy_hash(_spec(autoPromote=False))
    other_pool = RolloutSpec.model_validate({**spec.to_wire(), "poolRef": {"name": "x"}})
    assert policy_hash(spec) == policy_hash(other_pool)


def _cond(decision: Decision, cond_type: str) -> tuple[str, str]:
    found = next(c for c in decision.status.conditions if c.type == cond_type)
    return found.status.value, found.reason


def test_every_builtin_query_renders_to_promql_without_placeholders() -> None:
    window = Window(0, 1, T0, T0 + timedelta(seconds=8))
    for plan in plans([Metric(name=s.value.lower(), slo=s, threshold=1) for s in SLOMetric],
                      SLO, shadow=False):
        for template in (plan.query, plan.samples_query):
            text = render(template, pool="chat", namespace="llm", revision=CANARY,
                          traffic="live", window=window)
            assert "{{" not in text and "[8s]" in text, text
            assert '{namespace="llm",pool="chat",' in text, text
            assert text.count("(") == text.count(")"), text


def test_at_weight_100_stable_is_compared_over_its_last_served_window() -> None:
    sim = _Sim(_spec(steps=[{"weight": 50}, {"weight": 100}]), replicas=1)
    sim.run(30)
    assert sim.status.current_weight == 100 or sim.status.phase == Phase.PROMOTED
    status = sim.decisions[-1].status
    last_50 = [e for e in status.evaluations if e.step == 0][-1]
    at_100 = Window(1, 1, T0, T0 + timedelta(seconds=10))
    pinned = status.model_copy(update={"current_weight": 100, "phase": Phase.PROGRESSING})
    base = baseline_window(pinned, at_100)
    assert (base.start, base.end) == (last_50.window_start, last_50.window_end)
    at_50 = Window(0, 2, T0, T0 + timedelta(seconds=10))
    assert baseline_window(pinned.model_copy(update={"current_weight": 50}), at_50) == at_50


@pytest.mark.asyncio
async def test_prometheus_answers_become_results_and_failures_become_errors() -> None:
    from aiohttp import web

    from kvfleet.operator.promquery import PromQuery, Target

    asked: list[tuple[str, str]] = []

    async def query(request: web.Request) -> web.Response:
        form = await request.post()
        text, at = str(form["query"]), str(form["time"])
        asked.append((text, at))
        if "bad" in text:
            return web.json_response({"status": "error", "errorType": "bad_data",
                                      "error": "parse error"}, status=400)
        value = "100" if "_count" in text or "requests_total" in text else "0.2"
        if 'revision="bbbbbbbbbbbb"' in text and "_count" not in text:
            value = "0.5"
        return web.json_response({"status": "success", "data": {
            "resultType": "vector", "result": [{"metric": {}, "value": [0, value]}]}})

    app = web.Application()
    app.router.add_post("/api/v1/query", query)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    prom = PromQuery(f"http://127.0.0.1:{port}")
    try:
        metrics = [Metric(name="ttft", slo=SLOMetric.TTFT_P95, versus_stable=True, threshold=2.0),
                   Metric(name="custom", query="bad_query", threshold=1.0)]
        window = Window(1, 1, T0, T0 + timedelta(seconds=10))
        baseline = Window(0, 3, T0 - timedelta(seconds=60), T0 - timedelta(seconds=30))
        results = await prom.evaluate(plans(metrics, SLO, shadow=False), window,
                                      Target("chat", "llm", CANARY, STABLE, "live"), baseline)
        ttft, custom = results
        assert (ttft.outcome, ttft.value) == (Outcome.FAIL, 2.5)  # 0.5 / 0.2
        assert custom.outcome == Outcome.ERROR and "parse error" in custom.message
        stable_asks = [a for t, a in asked if f'revision="{STABLE[:12]}"' in t]
        assert {float(a) for a in stable_asks} == {baseline.end.timestamp()}
        assert all("[30s]" in t for t, _ in asked if f'revision="{STABLE[:12]}"' in t)
        down = PromQuery("http://127.0.0.1:9")  # nothing listens: Error, not a failure
        [result] = await down.evaluate(plans(metrics[:1], SLO, shadow=False), window,
                                       Target("chat", "llm", CANARY, STABLE, "live"))
        assert result.outcome == Outcome.ERROR
        await down.close()
    finally:
        await prom.close()
        await runner.cleanup()


def test_killed_between_promotion_and_the_pools_update_promotes_once() -> None:
    """The Rollout's status said Promoted, then the operator died before the pool's
    servingRevision moved: the next operator moves it, with no second Promoted event."""
    sim = _Sim(_spec(steps=[{"weight": 100}]), replicas=1)
    sim.run(40)
    assert sim.status.phase == Phase.PROMOTED and _events(sim).count("Promoted") == 1
    sim.stable = STABLE  # the pool's write never landed
    again = sim.tick(1)
    assert again.promote and again.traffic == [] and sim.stable == CANARY
    assert _events(sim).count("Promoted") == 1


def test_a_promotion_keeps_the_previous_revision_and_an_undo_goes_back_to_it() -> None:
    """Promoted: the revision that served before stays (1 replica, no traffic) for
    keepPreviousSeconds. An undo then sends all traffic back to it at once, the pool serves it
    again, and the promoted revision drains and is rolled back as any other."""
    sim = _Sim(_spec(steps=[{"weight": 100}], keepPreviousSeconds=600, drainSeconds=30),
               replicas=2)
    promoted = sim.run(40)
    assert sim.status.phase == Phase.PROMOTED and sim.stable == CANARY
    assert promoted.keep == (STABLE, 1) and sim.status.previous_revision == STABLE
    assert sim.status.previous_artifact == "qwen3-8b-v1"
    assert promoted.requeue_seconds is not None and promoted.requeue_seconds <= 600
    # Its pods are gone (evicted): an undo would leave nothing to serve, and is refused.
    sim.previous_ready = 0
    ignored = sim.ask(RequestAction.UNDO, "u0")
    assert ignored.status.phase == Phase.PROMOTED and ignored.demote is None
    assert "undo ignored: the previous revision" in ignored.events[0].message
    sim.previous_ready = 1
    undone = sim.ask(RequestAction.UNDO, "u1")
    assert undone.demote == (STABLE, "qwen3-8b-v1") and sim.stable == STABLE
    assert undone.status.phase == Phase.ROLLING_BACK and undone.keep is None
    assert undone.status.stable_revision == STABLE and undone.status.canary_revision == CANARY
    assert _table(undone) == {"stable": 100} and undone.traffic[0].revision == STABLE
    assert undone.canary_replicas is not None  # (its in-flight streams finish)
    assert "undone on request after promotion" in undone.status.message
    sim.request = None
    done = sim.run(40)
    assert done.status.phase == Phase.ROLLED_BACK and done.canary_replicas is None
    assert not any(d.promote for d in sim.decisions[-8:]) and sim.stable == STABLE
    # A repeated undo (or one on a rolled-back rollout) changes nothing.
    assert sim.ask(RequestAction.UNDO, "u2").status.phase == Phase.ROLLED_BACK


def test_an_undo_that_cannot_finish_says_so_and_leaves_the_promoted_revision_serving(
        ) -> None:
    """Undo is refused while the artifactRef already asks for another revision (a revert on
    its way: undoing under it would remove the promoted revision with no drain); and an undo
    whose kept Deployment is deleted before the pool moved back is abandoned, not stuck."""
    sim = _Sim(_spec(steps=[{"weight": 100}], keepPreviousSeconds=600), replicas=2)
    sim.run(40)
    sim.target = OTHER
    moved_on = sim.decide_with(request=RolloutRequest(action=RequestAction.UNDO, id="u1"))
    assert moved_on.demote is None and moved_on.status.phase != Phase.ROLLING_BACK
    assert "artifactRef no longer names the promoted revision" in " ".join(
        e.message for e in moved_on.events)
    stuck = _Sim(_spec(steps=[{"weight": 100}], keepPreviousSeconds=600), replicas=2)
    stuck.run(40)
    undo = stuck.decide_with(request=RolloutRequest(action=RequestAction.UNDO, id="u1"))
    assert undo.status.phase == Phase.ROLLING_BACK and undo.status.finished_at is None
    # (the pool's write did not land; then the kept Deployment was deleted)
    gone = stuck.decide_with(request=None, deployed=frozenset({CANARY}))
    assert gone.status.phase == Phase.PROMOTED and gone.demote is None
    assert gone.status.stable_revision == CANARY and "undo abandoned" in gone.status.message
    assert "UndoAbandoned" in [e.reason for e in gone.events]
    # A kept Deployment deleted by hand is released: nothing offers an undo to nowhere.
    kept = _Sim(_spec(steps=[{"weight": 100}], keepPreviousSeconds=600), replicas=2)
    kept.run(40)
    released = kept.decide_with(deployed=frozenset({CANARY}))
    assert released.keep is None and released.status.previous_revision is None
    assert "its Deployment is gone" in released.events[-1].message


def test_a_quiet_pools_probe_prompts_are_sent_only_while_a_step_with_traffic_is_judged(
        ) -> None:
    spec = _spec(steps=[{"weight": 50, "analysis": False}, {"weight": 100}],
                 analysis={"intervalSeconds": 10, "scrapeDelaySeconds": 0,
                           "probePrompts": ["Say hello.", "Name a colour."],
                           "probeRatePerSecond": 2})
    sim = _Sim(spec)
    done = sim.run(60)
    assert done.status.phase == Phase.PROMOTED and done.synthetic is None
    sent = {(d.status.current_step, d.status.step_started_at is not None): d.synthetic
            for d in sim.decisions if d.status.phase == Phase.PROGRESSING}
    # Step 1 is not judged, step 2 only once its traffic took effect.
    assert sent[(1, False)] is None and all(v is None for k, v in sent.items() if k[0] == 0)
    synthetic = sent[(1, True)]
    assert synthetic is not None and synthetic.prompts == ["Say hello.", "Name a colour."]
    assert (synthetic.rate_per_second, synthetic.max_tokens) == (2.0, 64)
    assert _Sim(_spec()).run(10).synthetic is None  # none asked for


def test_the_kept_revision_is_released_after_its_time_or_a_new_rollout() -> None:
    sim = _Sim(_spec(steps=[{"weight": 100}], keepPreviousSeconds=120), replicas=1)
    sim.run(40)
    assert sim.decisions[-1].keep == (STABLE, 1)
    released = sim.run(120)
    assert released.keep is None and sim.status.previous_revision is None
    assert _events(sim).count("PreviousReleased") == 1
    assert sim.ask(RequestAction.UNDO, "late").events[0].reason == "RequestIgnored"
    # Not kept at all with keepPreviousSeconds 0; and a new target ends the keep at once.
    none = _Sim(_spec(steps=[{"weight": 100}], keepPreviousSeconds=0), replicas=1)
    assert none.run(40).keep is None and none.status.previous_revision is None
    again = _Sim(_spec(steps=[{"weight": 100}]), replicas=1)
    again.run(40)
    assert again.decisions[-1].keep == (STABLE, 1)
    again.target = OTHER
    restarted = again.tick(1)
    assert restarted.keep is None and restarted.status.canary_revision == OTHER


def test_answers_are_judged_per_probe_as_well_as_per_token() -> None:
    """Pooled over tokens, flipping the 2-token answers of one request in five scored 0.8 of
    the tokens only where the flips were whole answers; spread over long answers it passed
    the token gate. The share of probes agreeing in full does not pool them."""
    live = plans([], SLO, shadow=False, agreement=OutputAgreement())
    gates = {p.name: p for p in live if p.name.endswith("-agreement")}
    assert set(gates) == {"output-agreement", "probe-agreement"}
    probe = gates["probe-agreement"]
    assert (probe.threshold, probe.comparison, probe.min_samples) == (
        0.9, Comparison.AT_LEAST, 20)
    text = render(probe.query, pool="chat", namespace="llm", revision=CANARY, traffic="live",
                  window=Window(0, 1, T0, T0 + timedelta(seconds=30)))
    assert "kvfleet_router_probes_agreed_total" in text and 'outcome="compared"' in text
    # 100 probes of 32 tokens; 20 differ only in their last token: 0.994 of the tokens agree.
    tokens = judge(gates["output-agreement"], QueryResult(1 - 20 / 3200, 100), None)
    probes = judge(probe, QueryResult(0.8, 100), None)
    assert (tokens.outcome, probes.outcome) == (Outcome.PASS, Outcome.FAIL)
    # Named in the metrics, it is not added twice; turned off, neither gate is.
    named = plans([Metric(name="p", slo=SLOMetric.PROBE_AGREEMENT, threshold=0.5)], SLO,
                  shadow=False, agreement=OutputAgreement())
    assert [p.name for p in named if "agreement" in p.name or p.name == "p"] == [
        "p", "output-agreement"]
    own = plans([Metric(name="t", slo=SLOMetric.OUTPUT_AGREEMENT, threshold=0.6)], SLO,
                shadow=False, agreement=OutputAgreement())
    assert [p.name for p in own if "agreement" in p.name or p.name == "t"] == ["t"]
    assert not [p for p in plans([], SLO, shadow=False,
                                 agreement=OutputAgreement(enabled=False)) if "agreement" in
                p.name]


def test_live_answers_are_judged_by_their_signs_against_stable() -> None:
    """A canary that cannot stop (every answer cut by max_tokens where stable's mostly end)
    fails `answers-unfinished`; a new model whose answers are worded otherwise but shaped
    alike passes; too few answers are not judged, and shadow copies (capped by the router)
    never are."""
    from kvfleet.api.rollout import AnswerChecks

    live = {p.name: p for p in plans([], SLO, shadow=False, checks=AnswerChecks())}
    gates = {n: p for n, p in live.items() if n.startswith("answers-")}
    assert set(gates) == {"answers-empty", "answers-unfinished", "answers-looping",
                          "answers-garbled"}
    unfinished = gates["answers-unfinished"]
    assert unfinished.difference and unfinished.versus_stable and not unfinished.required
    text = render(unfinished.query, pool="chat", namespace="llm", revision=CANARY,
                  traffic="live", window=Window(0, 1, T0, T0 + timedelta(seconds=30)))
    assert 'kvfleet_router_answer_flags_total{namespace="llm",pool="chat"' in text
    assert 'flag="unfinished"' in text and "kvfleet_router_answers_checked_total" in text
    broken = judge(unfinished, QueryResult(1.0, 120), QueryResult(0.2, 140))
    upgrade = judge(unfinished, QueryResult(0.23, 120), QueryResult(0.2, 140))
    thin = judge(unfinished, QueryResult(1.0, 10), QueryResult(0.2, 140))
    assert (broken.outcome, upgrade.outcome, thin.outcome) == (
        Outcome.FAIL, Outcome.PASS, Outcome.NOT_JUDGED)
    assert "canary 1 (120 requests) vs stable 0.2 (140)" in broken.message
    assert not [p for p in plans([], SLO, shadow=True, checks=AnswerChecks())
                if p.name.startswith("answers-")]
    assert not [p for p in plans([], SLO, shadow=False, checks=AnswerChecks(enabled=False))
                if p.name.startswith("answers-")]
    # Every metric an evaluation can hold fits its status list.
    assert len(plans([Metric(name=f"m{i}", slo=SLOMetric.TTFT_P95) for i in range(16)], SLO,
                     shadow=False, agreement=OutputAgreement(), split=PromptLengthSplit(),
                     checks=AnswerChecks())) <= MAX_EVALUATED


def test_a_canary_refusing_only_long_prompts_fails_their_class_not_the_overall_error_slo(
) -> None:
    """A smaller maxModelLength refuses the long prompts, 3 % of the traffic: under a 5 %
    error-rate SLO over all requests, the class's error rate against stable's shows it."""
    split = _spec().analysis.by_prompt_length
    live = plans([], SLO_LOOSE, shadow=False, split=split)
    error_slo = next(p for p in live if p.name == "errorrate")
    long = next(p for p in live if p.name == "errorrate-le4096")
    text = render(long.query, pool="chat", namespace="llm", revision=CANARY, traffic="live",
                  window=Window(0, 1, T0, T0 + timedelta(seconds=30)))
    assert 'outcome=~"stream_error|revision_refused|upstream_error",prompt_class=~' \
        '"1024|2048|4096"}[30s]' in text
    everything = judge(error_slo, QueryResult(0.03, 1000), None)
    refused = judge(long, QueryResult(1.0, 30), QueryResult(0.0, 30))
    assert (everything.outcome, refused.outcome) == (Outcome.PASS, Outcome.FAIL)
    assert "canary 1 (30 requests) vs stable 0 (30): +1 > 0.02" in refused.message
    assert overall([everything, refused]) == Outcome.FAIL
    # One refusal in twenty-five against none is not yet shown; the same rate over 2,000
    # requests each is; a class as bad on stable is the model's, not the revision's.
    one = judge(long, QueryResult(0.04, 25), QueryResult(0.0, 25))
    shown = judge(long, QueryResult(0.04, 2000), QueryResult(0.0, 2000))
    both = judge(long, QueryResult(0.5, 100), QueryResult(0.49, 100))
    assert (one.outcome, shown.outcome, both.outcome) == (
        Outcome.PASS, Outcome.FAIL, Outcome.PASS), (one.message, shown.message)
    assert "not yet shown by so few requests" in one.message


@given(canary=st.integers(0, 200), stable=st.integers(0, 200), n=st.integers(20, 200))
def test_the_class_error_gate_fails_only_what_its_samples_show(canary: int, stable: int,
                                                                n: int) -> None:
    canary, stable = min(canary, n), min(stable, n)
    long = next(p for p in plans([], SLO_LOOSE, shadow=False, split=_spec().analysis
                                 .by_prompt_length) if p.name == "errorrate-le4096")
    verdict = judge(long, QueryResult(canary / n, n), QueryResult(stable / n, n))
    if canary <= stable:
        assert verdict.outcome == Outcome.PASS
    if verdict.outcome == Outcome.FAIL:  # (a difference over 0.02, and shown)
        assert canary - stable > 0.02 * n and canary - stable >= 3


def test_latency_is_judged_per_prompt_class_against_stable_and_a_thin_class_never_blocks(
) -> None:
    split = _spec().analysis.by_prompt_length
    live = plans([], SLO, shadow=False, split=split)
    classes = [p for p in live if not p.required]
    assert [p.name for p in classes] == [
        "ttftp95-le512", "e2ep95-le512", "errorrate-le512", "ttftp95-le4096", "e2ep95-le4096",
        "errorrate-le4096", "ttftp95-over4096", "e2ep95-over4096", "errorrate-over4096"]
    assert all(p.versus_stable and p.threshold == 1.5 for p in classes if not p.difference)
    # Shadow copies are not streamed: end to end (and errors) only.
    assert [p.name for p in plans([], SLO, shadow=True, split=split) if not p.required] == [
        "e2ep95-le512", "errorrate-le512", "e2ep95-le4096", "errorrate-le4096",
        "e2ep95-over4096", "errorrate-over4096"]
    long = next(p for p in classes if p.name == "ttftp95-le4096")
    text = render(long.query, pool="chat", namespace="llm", revision=CANARY, traffic="live",
                  window=Window(0, 1, T0, T0 + timedelta(seconds=30)))
    assert 'prompt_class=~"1024|2048|4096"}[30s]' in text
    # 3x slower on long prompts: the p95 over all requests passes, the class fails.
    overall_ttft = judge(live[0], QueryResult(0.3, 400), None)
    slow_long = judge(long, QueryResult(0.9, 25), QueryResult(0.3, 30))
    thin = judge(classes[-2], QueryResult(9.0, 3), QueryResult(0.3, 40))
    assert (overall_ttft.outcome, slow_long.outcome, thin.outcome) == (
        Outcome.PASS, Outcome.FAIL, Outcome.NOT_JUDGED)
    assert overall([overall_ttft, thin]) == Outcome.PASS  # a thin class never blocks
    assert overall([overall_ttft, slow_long, thin]) == Outcome.FAIL
    assert overall([thin]) == Outcome.WAITING  # nor passes alone
    classes = [p for p in classes if not p.difference]
    # Twice stable's 40 ms is noise, not a slow revision.
    noise = judge(classes[0], QueryResult(0.08, 30), QueryResult(0.04, 30))
    assert noise.outcome == Outcome.PASS and "only 0.04 over stable" in noise.message
    off = PromptLengthSplit(enabled=False)
    assert all(p.required for p in plans([], SLO, shadow=False, split=off))
    # Alone the classes judge nothing: no SLOs and no metrics is still refused.
    with pytest.raises(AnalysisConfigError):
        plans([], None, shadow=False, split=split)
    with pytest.raises(ValueError, match=r"choose among \[256, 512"):
        PromptLengthSplit(edges=[500])
    with pytest.raises(ValueError, match="strictly increase"):
        PromptLengthSplit(edges=[4096, 512])
