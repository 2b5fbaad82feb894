"""Rollout: the standing rollout policy of one ServingPool (like Flagger's Canary).

A rollout starts when the pool's spec asks for a revision that is not the one serving: another
`spec.artifactRef`, engine image or engine setting (kvfleet.operator.revisions), one line
changed in Git, or an operator whose default engine image changed. The Rollout says how the
new revision is tried (an optional shadow phase, canary steps by weight) and judged (analysis
metrics read from Prometheus, by default the pool's SLOs), and the operator records every
step, window and evaluation in `status`, so an operator restart resumes exactly where it
stopped.

Nothing here is a one-shot command: people steer a running rollout with requests in the
`kvfleet.io/rollout-request` annotation (see `RolloutRequest`), which carry an id and, for a
promote, the step they apply to; the operator records the last id it handled, so a repeated
request changes nothing. Git owns the spec; the operator writes only status.
"""

from __future__ import annotations

import itertools
import json
from datetime import datetime
from enum import StrEnum
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvfleet.api.meta import (
    GROUP,
    SHA256_PATTERN,
    Condition,
    CRDNames,
    KubeModel,
    ObjectMeta,
    PrinterColumn,
    age_column,
    cel,
    conditions_field,
)
from kvfleet.api.servingpool import MAX_PROBE_PROMPTS, PROBE_PROMPT_CHARS

MAX_STEPS = 20
MAX_METRICS = 16
MAX_EVALUATIONS = 60
REQUEST_ANNOTATION = f"{GROUP}/rollout-request"


class PoolRef(KubeModel):
    """A ServingPool in the same namespace."""

    name: str = Field(min_length=1, max_length=253, description="ServingPool name.")


class Comparison(StrEnum):
    LESS_THAN = "LessThan"
    AT_MOST = "AtMost"
    GREATER_THAN = "GreaterThan"
    AT_LEAST = "AtLeast"


class SLOMetric(StrEnum):
    """Built-in analysis metrics over the router's client-observed series (see
    `kvfleet.router.metrics`); their thresholds default to the pool's `spec.slos`."""

    TTFT_P95 = "TTFTP95"
    TPOT_P95 = "TPOTP95"
    ERROR_RATE = "ErrorRate"
    E2E_P95 = "E2EP95"
    # Greedy answer agreement with stable, token by token, over the router's probes
    # (`kvfleet.router.probes`); its threshold defaults to analysis.outputAgreement.
    OUTPUT_AGREEMENT = "OutputAgreement"
    # The share of compared probes whose two answers agree in full, token ids and text; its
    # threshold defaults to analysis.outputAgreement.minProbeAgreement.
    PROBE_AGREEMENT = "ProbeAgreement"


class MissingData(StrEnum):
    """What an empty result, NaN or infinity counts as. Never a pass."""

    INCONCLUSIVE = "Inconclusive"
    FAIL = "Fail"


class Metric(KubeModel):
    """One analysis metric: a built-in SLO metric or a PromQL query, judged against a threshold.

    Queries are templates: `{{pool}}`, `{{namespace}}`, `{{revision}}` (12-digit short
    revision), `{{traffic}}` (live, or shadow in the shadow phase), `{{traffics}}` (a regex:
    live|synthetic, the routers' own requests of analysis.probePrompts included; or shadow)
    and `{{window}}` (the
    step's window so far, e.g. `95s`) are filled in, and the query is evaluated at the window's
    end, an absolute time recorded in status."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("has(self.slo) != has(self.query)", "set exactly one of slo and query"),
                cel("has(self.slo) || has(self.threshold)", "a query needs a threshold",
                    ".threshold"),
            ]
        }
    )

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63,
                      description="Metric name.")
    slo: SLOMetric | None = Field(
        default=None,
        description="A built-in metric (TTFTP95, TPOTP95, ErrorRate, E2EP95) over the "
        "router's series; its threshold defaults to the pool's spec.slos. ErrorRate passes "
        "only when its requests bound the rate under the threshold (one-sided 95 %: 52 "
        "requests without an error for 0.05, 268 for 0.01); until then it waits.")
    query: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description="PromQL template returning one value ({{pool}}, {{namespace}}, "
        "{{revision}}, {{traffic}}, {{window}}).")
    samples_query: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description="PromQL template counting the requests the value came from; default: the "
        "router's requests of that revision and traffic in the window.")
    threshold: float | None = Field(
        default=None, description="Value (or canary/stable ratio) the result is compared with.")
    comparison: Comparison = Field(
        default=Comparison.AT_MOST,
        description="Pass when the result is LessThan / AtMost / GreaterThan / AtLeast it.")
    versus_stable: bool = Field(
        default=False,
        description="Judge canary/stable (the same query on both revisions) instead of the "
        "canary's own value.")
    min_samples: int = Field(
        default=50, ge=1, le=10_000_000,
        description="Requests each judged revision needs in the window; fewer is waiting, "
        "never a pass.")
    on_missing_data: MissingData = Field(
        default=MissingData.INCONCLUSIVE,
        description="What no data, NaN or infinity count as: Inconclusive or Fail.")


class TimeoutAction(StrEnum):
    """What a step that could not conclude within `maxWaitSeconds` does (query errors, too
    few samples, inconclusive results, canary pods that never get Ready)."""

    ROLLBACK = "Rollback"  # final: all traffic to stable, the canary drained and removed
    HOLD_AT_ZERO = "HoldAtZero"  # live and shadow weight to 0, canary pods kept; resumable
    HOLD = "Hold"  # pause holding the weight (a person decides)


class OutputAgreement(KubeModel):
    """The built-in answer gate: the router mirrors a sample of live requests as greedy probes
    (temperature 0, capped tokens, never billed, shed under load) to the new revision and to
    stable and compares the answers token by token. Same weights answer the same; a broken
    template or tokenizer, or same-shaped wrong weights, do not, at the same speed."""

    enabled: bool = Field(
        default=True,
        description="Judge every analysed step (and the shadow phase) on answer agreement. "
        "Turn off for a rollout that is meant to answer differently (a new model version).")
    min_agreement: float = Field(
        default=0.9, ge=0.0, le=1.0,
        description="Least share of probe tokens that must agree with stable's greedy answer "
        "(each probe counts its common prefix over the longer answer).")
    min_probe_agreement: float = Field(
        default=0.9, ge=0.0, le=1.0,
        description="Least share of compared probes whose answers agree in full, token ids "
        "and text: pooled over tokens, flipping every 2-token answer on 20 % of the traffic "
        "scored 0.985, and a tokenizer broken only in decoding (same ids, other text) 1.0.")
    min_probes: int = Field(
        default=20, ge=1, le=100_000, description="Compared probes a window needs.")
    probe_percent: int = Field(
        default=20, ge=1, le=100, description="Percent of live requests mirrored as probes.")


# The prompt-length classes the router labels its latency histograms with (`prompt_class`:
# the least edge at or above the prompt's token count, or "inf"). A Rollout's class edges are
# chosen among these, so a class is a set of the router's classes and no series is re-labelled.
PROMPT_CLASS_EDGES = (256, 512, 1024, 2048, 4096, 8192, 16384)
PROMPT_CLASS_OVER = "inf"


# The signs the router checks each live answer for (kvfleet.router.answers).
ANSWER_FLAGS = ("empty", "unfinished", "looping", "garbled")
# An evaluation's metrics: the declared ones, answer agreement (tokens and probes), three per
# prompt class, and one per answer sign.
MAX_EVALUATED = MAX_METRICS + 2 + 3 * (len(PROMPT_CLASS_EDGES) + 1) + len(ANSWER_FLAGS)


def prompt_class(prompt_tokens: int) -> str:
    """The router's `prompt_class` label of a prompt of `prompt_tokens` tokens."""
    return next((str(e) for e in PROMPT_CLASS_EDGES if prompt_tokens <= e), PROMPT_CLASS_OVER)


class PromptLengthSplit(KubeModel):
    """Latency and errors judged per prompt-length class, canary against stable: a revision
    slow only on long prompts, or refusing them (a smaller maxModelLength), hides in a p95 or
    an error rate over all traffic when long prompts are a few percent of it. Each class is
    judged on its own time to first token (streamed), end-to-end latency (streamed or not)
    and error rate (errors inside a 200 and the revision's refusals), once both revisions
    have `minSamples` requests of that class in the window; a class with fewer is not judged
    (it never blocks nor passes a step)."""

    enabled: bool = Field(default=True, description="Judge latency per prompt-length class.")
    edges: list[int] = Field(
        default_factory=lambda: [512, 4096], min_length=1, max_length=len(PROMPT_CLASS_EDGES),
        description="Upper prompt-token edges of the classes, strictly increasing, each one "
        f"of {', '.join(map(str, PROMPT_CLASS_EDGES))}; a last class takes longer prompts.",
        json_schema_extra={"default": [512, 4096]})
    max_ratio: float = Field(
        default=1.5, gt=1.0, le=100.0,
        description="Most a class's canary p95 may be over stable's (canary/stable).")
    min_samples: int = Field(
        default=20, ge=1, le=100_000,
        description="Requests of a class each revision needs in the window for it to count.")
    min_difference_seconds: float = Field(
        default=0.25, ge=0.0, le=3600.0,
        description="A class passes whatever its ratio while its canary p95 is at most this "
        "much over stable's: a ratio of two small latencies is mostly noise.")
    min_error_difference: float = Field(
        default=0.02, ge=0.0, le=1.0,
        description="A class fails on errors when its canary error rate is over stable's by "
        "more than this, and its samples show it (the canary's rate at least, over stable's "
        "at most, at 95 % each): one refused request in twenty is not yet a broken class.")

    @field_validator("edges")
    @classmethod
    def _edges(cls, edges: list[int]) -> list[int]:
        unknown = [e for e in edges if e not in PROMPT_CLASS_EDGES]
        if unknown:
            raise ValueError(f"edges {unknown} are not prompt classes the router labels; "
                             f"choose among {list(PROMPT_CLASS_EDGES)}")
        if any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError(f"edges must strictly increase, got {edges}")
        return edges

    def classes(self) -> list[tuple[str, list[str]]]:
        """(class name, the router's prompt_class values in it), shortest first: e.g.
        ("le512", ["256", "512"]), ("le4096", [...]), ("over4096", [..., "inf"])."""
        labels = [*map(str, PROMPT_CLASS_EDGES), PROMPT_CLASS_OVER]
        out, lower = [], 0
        for edge in self.edges:
            out.append((f"le{edge}", [v for v in labels[:-1] if lower < int(v) <= edge]))
            lower = edge
        out.append((f"over{lower}", [v for v in labels if v == PROMPT_CLASS_OVER
                                     or int(v) > lower]))
        return out


class AnswerChecks(KubeModel):
    """What clients received, judged canary against stable by its shape, not its words
    (kvfleet.router.answers): the share of completed live answers that are empty, cut by
    max_tokens instead of ended by the model, looping, or garbled. A legitimate model upgrade
    words its answers differently and passes; a revision that cannot stop, loops or garbles
    bytes fails, with OutputAgreement off. Fluent answers that are wrong pass: that is
    OutputAgreement's (same weights) or a person's to see."""

    enabled: bool = Field(default=True, description="Judge the live answers' signs.")
    min_difference: float = Field(
        default=0.05, gt=0, le=1,
        description="A sign fails the canary when its share of the canary's answers is over "
        "stable's by more than this and the samples show it (Wilson bounds, one-sided 95 % "
        "each).")
    min_samples: int = Field(
        default=50, ge=1, le=1_000_000,
        description="Checked answers each revision needs in the window; with fewer the signs "
        "are not judged (they never hold a step back).")


class Analysis(KubeModel):
    """How steps are judged."""

    interval_seconds: int = Field(default=30, ge=1, le=3600, description="Evaluation period.")
    warmup_seconds: int = Field(
        default=0, ge=0, le=3600,
        description="Traffic at the start of a step that no window includes.")
    failure_limit: int = Field(
        default=1, ge=1, le=100, description="Failed evaluations in a step that fail it.")
    max_wait_seconds: int = Field(
        default=600, ge=1, le=86400,
        description="How long a step may go without a conclusive evaluation (too few "
        "samples, inconclusive, query errors) before onTimeout applies.")
    on_timeout: TimeoutAction = Field(
        default=TimeoutAction.HOLD_AT_ZERO,
        description="What a step does after maxWaitSeconds without a conclusion: HoldAtZero "
        "(live and shadow traffic back on stable, canary pods kept, Degraded; resume tries "
        "the step again), Rollback, or Hold (pause keeping the weight).")
    scrape_delay_seconds: int = Field(
        default=30, ge=0, le=600,
        description="How long after a window ends it is queried: at least Prometheus's scrape "
        "interval plus a margin, so the window's last requests are in it and a query "
        "repeated after an operator restart gives the same answer.")
    metrics: list[Metric] = Field(
        default_factory=list, max_length=MAX_METRICS,
        description="Metrics; empty: the built-in ones for the SLOs the pool declares.")
    output_agreement: OutputAgreement = Field(
        default_factory=OutputAgreement,
        description="Greedy answer agreement with stable, judged beside the metrics.",
        json_schema_extra={"default": {}})
    by_prompt_length: PromptLengthSplit = Field(
        default_factory=PromptLengthSplit,
        description="Latency and errors per prompt-length class, canary against stable, "
        "judged beside the metrics.",
        json_schema_extra={"default": {}})
    probe_prompts: list[Annotated[str, Field(min_length=1, max_length=PROBE_PROMPT_CHARS)]] = \
        Field(default_factory=list, max_length=MAX_PROBE_PROMPTS,
              description="For a quiet pool: user messages the routers send themselves, "
              "routed as live requests are (canary by weight, shadow copies, probes), while a "
              "step is judged and live requests arrive slower than probeRatePerSecond; so the "
              "rollout finishes on evidence instead of waiting out maxWaitSeconds. Counted as "
              "traffic \"synthetic\", which the built-in metrics judge with the live.")
    probe_rate_per_second: float = Field(
        default=1.0, gt=0, le=20,
        description="The request rate each router keeps a judged pool at with probePrompts "
        "(live requests count first; the rest are synthetic).")
    probe_max_tokens: int = Field(default=64, ge=1, le=1024,
                                  description="max_tokens of each synthetic request.")
    answer_checks: AnswerChecks = Field(
        default_factory=AnswerChecks,
        description="The live answers' signs (empty, unfinished, looping, garbled), canary "
        "against stable, judged beside the metrics in canary steps.",
        json_schema_extra={"default": {}})
    max_canary_restarts: int = Field(
        default=0, ge=0, le=1000,
        description="Container restarts the canary's pods may have (a crash, an OOM kill, a "
        "failed liveness probe) over the whole rollout, bake included; one more fails the "
        "rollout at once, whatever the metrics say, naming the pod and why it restarted.")


class Step(KubeModel):
    """One canary step: route `weight` percent of conversations to the new revision, stay at
    least `pauseSeconds`, and pass analysis when it is on."""

    weight: int = Field(ge=1, le=100, description="Percent of conversations to the canary.")
    pause_seconds: int = Field(
        default=0, ge=0, le=86400 * 7, description="Least time at this step.")
    analysis: bool = Field(default=True, description="Judge this step with the analysis.")


class Shadow(KubeModel):
    """Mirror live requests to the new revision before any canary; answers are discarded."""

    percent: int = Field(ge=1, le=100, description="Percent of live requests mirrored.")
    duration_seconds: int = Field(ge=1, le=86400 * 7, description="Least time mirroring.")
    analysis: bool = Field(
        default=True, description="Judge the shadow answers (error rate, latency) too.")


class RolloutSpec(KubeModel):
    """How one pool moves to a new artifact whenever its artifactRef changes."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.steps.size() > 0 && self.steps[self.steps.size() - 1].weight == 100",
                    "canary steps must end at weight 100",
                    ".steps",
                ),
                cel(
                    "self.steps.map(s, s.weight).isSorted() && self.steps.all(s, "
                    "self.steps.exists_one(t, t.weight == s.weight))",
                    "canary step weights must strictly increase",
                    ".steps",
                ),
                cel(
                    "self.poolRef == oldSelf.poolRef",
                    "poolRef is immutable; create a new Rollout",
                    ".poolRef",
                ),
            ]
        }
    )

    pool_ref: PoolRef = Field(description="The ServingPool this policy governs. Immutable.")
    steps: list[Step] = Field(
        min_length=1,
        max_length=MAX_STEPS,
        description="Canary steps; weights strictly increase and the last is 100.",
    )
    shadow: Shadow | None = Field(default=None, description="Optional shadow phase first.")
    analysis: Analysis = Field(
        default_factory=Analysis, description="How steps are judged.",
        json_schema_extra={"default": {}})
    auto_promote: bool = Field(
        default=True, description="Advance past passing steps without a manual promote.")
    auto_rollback: bool = Field(
        default=True,
        description="Return all traffic to stable when a step fails; false: pause instead.")
    capacity_wait_seconds: int = Field(
        default=600, ge=1, le=86400,
        description="How long a step may wait for its canary pods to be placed (free GPUs) "
        "and Ready (model download and load) before analysis.onTimeout applies "
        "(InsufficientCapacity or CanaryNotReady); stable is untouched.")
    drain_seconds: int = Field(
        default=30, ge=0, le=3600,
        description="How long a revision that lost its traffic keeps running for its "
        "in-flight streams before it is scaled down.")
    bake_seconds: int = Field(
        default=300, ge=0, le=86400 * 7,
        description="Least time the canary serves live traffic before it is promoted: its "
        "last step, passed, waits out the rest. A revision that crashes, leaks memory or "
        "slows down after some minutes must show it before stable goes; its restarts and "
        "the last step's analysis are watched meanwhile. A person's promote skips it.")
    keep_previous_seconds: int = Field(
        default=600, ge=0, le=86400 * 7,
        description="How long the revision that served before a promotion is kept after it "
        "(scaled to keepPreviousReplicas, with no traffic), so that `kvfleet rollout undo` "
        "takes the pool back to it with a scale-up instead of a cold start: a fault that "
        "shows only after promotion is undone in seconds. 0: it is deleted at promotion.")
    keep_previous_replicas: int = Field(
        default=1, ge=1, le=64,
        description="Replicas the kept previous revision runs, Ready to take all the traffic "
        "back at an undo while the rest of the pool's count starts.")

    @field_validator("steps")
    @classmethod
    def _weights(cls, steps: list[Step]) -> list[Step]:
        weights = [step.weight for step in steps]
        if any(b <= a for a, b in itertools.pairwise(weights)):
            raise ValueError(f"canary step weights must strictly increase, got {weights}")
        if weights and weights[-1] != 100:
            raise ValueError(f"canary steps must end at weight 100, got {weights}")
        return steps

    def analysed(self) -> bool:
        return any(s.analysis for s in self.steps) or bool(self.shadow and self.shadow.analysis)


class RequestAction(StrEnum):
    PROMOTE = "promote"  # the current step passes now (needs `step`)
    PROMOTE_FULL = "promote-full"  # skip the remaining steps and analysis
    ABORT = "abort"  # all traffic back to stable; the canary is drained and removed
    RETRY = "retry"  # start an aborted, rolled back or paused rollout again from the start
    PAUSE = "pause"
    RESUME = "resume"
    # After a promotion, while the previous revision is kept: all traffic back to it, and the
    # promoted revision rolled back (refused as any rolled-back revision is).
    UNDO = "undo"


class RolloutRequest(BaseModel):
    """A person's request, written as JSON into the `kvfleet.io/rollout-request` annotation
    (by `kvfleet rollout ...`). `id` makes it idempotent; a promote applies only to `step`
    (-1: the shadow phase), so a repeated promote never skips two steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    action: RequestAction
    id: str = Field(min_length=1, max_length=64)
    step: int | None = Field(default=None, ge=-1, le=MAX_STEPS)

    @classmethod
    def parse(cls, text: str) -> RolloutRequest:
        try:
            return cls.model_validate(json.loads(text))
        except (ValueError, ValidationError) as exc:
            raise ValueError(
                f"annotation {REQUEST_ANNOTATION} is not a rollout request "
                f'(e.g. {{"action": "promote", "id": "1", "step": 0}}): {exc}') from exc

    def to_annotation(self) -> str:
        return json.dumps(self.model_dump(exclude_none=True, mode="json"), sort_keys=True)


class Phase(StrEnum):
    IDLE = "Idle"  # nothing to roll out: the pool serves its artifactRef
    SHADOW = "Shadow"
    PROGRESSING = "Progressing"  # canary steps
    PAUSED = "Paused"
    PROMOTED = "Promoted"
    ROLLING_BACK = "RollingBack"  # traffic is back on stable; the canary drains
    ROLLED_BACK = "RolledBack"
    ABORTED = "Aborted"


class Outcome(StrEnum):
    PASS = "Pass"
    FAIL = "Fail"
    WAITING = "Waiting"  # too few samples
    INCONCLUSIVE = "Inconclusive"  # no data, NaN
    ERROR = "Error"  # Prometheus unreachable, bad query: says nothing about the canary
    # An optional metric (a prompt-length class) with too few samples: it does not count.
    NOT_JUDGED = "NotJudged"


class MetricEvaluation(KubeModel):
    """One metric in one evaluation."""

    name: str = Field(description="Metric name.")
    outcome: Outcome = Field(
        description="Pass, Fail, Waiting, Inconclusive, Error or NotJudged.")
    value: float | None = Field(default=None, description="Canary value, or canary/stable.")
    canary_value: float | None = Field(default=None, description="Canary value.")
    stable_value: float | None = Field(default=None, description="Stable value.")
    threshold: float | None = Field(default=None, description="Threshold applied.")
    samples: int = Field(default=0, ge=0, description="Canary requests in the window.")
    stable_samples: int | None = Field(default=None, ge=0, description="Stable requests.")
    message: str = Field(default="", max_length=512, description="Why, in words.")


class Evaluation(KubeModel):
    """One evaluation, keyed by (revision, step, index): recomputed after a restart it covers
    the same window and is never counted twice."""

    revision: str = Field(pattern=SHA256_PATTERN, description="The canary revision.")
    step: int = Field(ge=-1, description="Step index; -1 is the shadow phase.")
    index: int = Field(ge=1, description="Evaluation number in the step (window slot).")
    window_start: datetime = Field(description="Start of the queried window.")
    window_end: datetime = Field(description="End of the window: the query time.")
    outcome: Outcome = Field(description="The evaluation's outcome (worst of its metrics).")
    metrics: list[MetricEvaluation] = Field(
        default_factory=list, max_length=MAX_EVALUATED, description="Per metric.")


class StepCounts(KubeModel):
    """Evaluations of the current step attempt by outcome."""

    passed: int = Field(default=0, ge=0, description="Pass.")
    failed: int = Field(default=0, ge=0, description="Fail.")
    waiting: int = Field(default=0, ge=0, description="Too few samples.")
    inconclusive: int = Field(default=0, ge=0, description="No data or NaN.")
    errors: int = Field(default=0, ge=0, description="Query errors, Prometheus down.")


class RolloutStatus(KubeModel):
    """Progress; the operator's only memory of a rollout."""

    phase: Phase = Field(default=Phase.IDLE, description="Where the rollout stands.")
    message: str = Field(default="", max_length=1024, description="Where and why, in words.")
    stable_revision: str | None = Field(
        default=None, pattern=SHA256_PATTERN, description="The revision serving stable traffic.")
    canary_revision: str | None = Field(
        default=None, pattern=SHA256_PATTERN,
        description="The revision being rolled out (the pool's status.revision).")
    canary_artifact: str | None = Field(default=None, description="Its ModelArtifact.")
    canary_change: str | None = Field(
        default=None, max_length=2048,
        description="What the canary changes against stable: its artifact, engine image, "
        "engine settings (e.g. \"settings KVFLEET_KV_CACHE_DTYPE auto -> fp8\").")
    wave: str | None = Field(
        default=None, max_length=512,
        description="The operator's engine image, when this rollout is part of the fleet "
        "wave that brings it (at most --max-concurrent-rollouts pools at a time).")
    rollout_hash: str | None = Field(
        default=None, description="Digest of the policy the rollout runs. An edit applies "
        "from the current step of a running rollout and never restarts a finished one: a "
        "rollout is (pool, canaryRevision).")
    started_at: datetime | None = Field(default=None, description="When this rollout began.")
    current_step: int | None = Field(
        default=None, ge=-1, description="Step index; -1 is the shadow phase.")
    current_weight: int = Field(default=0, ge=0, le=100, description="Canary traffic percent.")
    shadow_percent: int = Field(default=0, ge=0, le=100, description="Mirrored percent.")
    canary_restarts_base: int = Field(
        default=0, ge=0, description="The canary pods' container restarts when this rollout "
        "(or its last resume) began: the restart watch counts those after it.")
    live_since: datetime | None = Field(
        default=None, description="When the canary first had live traffic in this rollout "
        "(its bake counts from then).")
    step_started_at: datetime | None = Field(
        default=None, description="When the current step's traffic took effect (window base).")
    canary_waiting_since: datetime | None = Field(
        default=None, description="Since when the current step has waited for its canary "
        "pods to be placed and Ready (bounded by spec.capacityWaitSeconds).")
    pause_reason: str | None = Field(default=None, description="Why the rollout is paused.")
    promote_full: bool = Field(
        default=False, description="A promote-full request is being carried out: the canary "
        "goes to 100% and is promoted without analysis.")
    drain_started_at: datetime | None = Field(
        default=None, description="When the canary lost its traffic (rollback or abort).")
    previous_revision: str | None = Field(
        default=None, pattern=SHA256_PATTERN,
        description="After a promotion: the revision that served before it, kept until "
        "previousKeptUntil for an undo.")
    previous_artifact: str | None = Field(default=None, description="Its ModelArtifact.")
    previous_kept_until: datetime | None = Field(
        default=None, description="When the kept previous revision is released (deleted).")
    finished_at: datetime | None = Field(default=None, description="When it ended.")
    counts: StepCounts = Field(
        default_factory=StepCounts, description="Evaluations of the current step attempt.")
    evaluations: list[Evaluation] = Field(
        default_factory=list, max_length=MAX_EVALUATIONS,
        description="The latest evaluations, oldest first.")
    last_request_id: str | None = Field(
        default=None, description="Id of the last rollout-request handled.")
    observed_generation: int | None = Field(default=None, ge=0, description="Generation seen.")
    conditions: list[Condition] = conditions_field()


class Rollout(KubeModel):
    """The rollout policy of one ServingPool: when the pool's artifactRef changes, the new
    revision gets optional shadow traffic, then canary steps judged on SLOs read from
    Prometheus, and is promoted or rolled back. Progress lives in status."""

    crd: ClassVar[CRDNames] = CRDNames(
        plural="rollouts",
        # Not "ro": Argo Rollouts has it, and kubectl warns on every ambiguous short name.
        short_names=("kro",),
        printer_columns=(
            PrinterColumn("Pool", ".spec.poolRef.name"),
            PrinterColumn("Phase", ".status.phase"),
            PrinterColumn("Step", ".status.currentStep", type="integer"),
            PrinterColumn("Weight", ".status.currentWeight", type="integer"),
            PrinterColumn("Canary", ".status.canaryArtifact"),
            PrinterColumn("Message", ".status.message", priority=1),
            age_column(),
        ),
    )

    api_version: Literal["kvfleet.io/v1alpha1"] = Field(
        default="kvfleet.io/v1alpha1", description="kvfleet.io/v1alpha1"
    )
    kind: Literal["Rollout"] = Field(default="Rollout", description="Rollout")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: RolloutSpec = Field(description="The policy.")
    status: RolloutStatus | None = Field(default=None, description="Progress.")
