"""Rollout: move a ServingPool from one ModelArtifact to another on measured SLOs.

All progress lives in `status` (current step, when it started, analysis results), so an
operator restart resumes exactly where it stopped.
"""

from __future__ import annotations

import itertools
from datetime import datetime
from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from kvfleet.api.meta import (
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
from kvfleet.api.servingpool import ArtifactRef

MAX_STEPS = 20
MAX_METRICS = 16


class PoolRef(KubeModel):
    """A ServingPool in the same namespace."""

    name: str = Field(min_length=1, max_length=253, description="ServingPool name.")


class Comparison(StrEnum):
    LESS_THAN = "LessThan"
    GREATER_THAN = "GreaterThan"


class Metric(KubeModel):
    """One analysis metric: a PromQL query judged against a threshold."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="Metric name.")
    query: str = Field(
        min_length=1,
        description="PromQL; the placeholders {{pool}}, {{revision}} select canary or stable.",
    )
    threshold: float = Field(description="Value the canary result is compared with.")
    comparison: Comparison = Field(description="Pass when the result is LessThan/GreaterThan it.")
    versus_stable: bool = Field(
        default=False,
        description="Compare canary with stable: the threshold is then the largest allowed "
        "canary/stable ratio (LessThan) or the smallest (GreaterThan).",
    )
    min_samples: int = Field(
        default=100, ge=1, description="Requests needed before the metric counts; fewer waits."
    )


class Analysis(KubeModel):
    """Metrics checked during analysis steps."""

    interval_seconds: int = Field(default=60, ge=5, le=3600, description="Evaluation period.")
    failure_limit: int = Field(
        default=1, ge=1, le=100, description="Failed evaluations that fail the rollout."
    )
    metrics: list[Metric] = Field(min_length=1, max_length=MAX_METRICS, description="Metrics.")


class Step(KubeModel):
    """One canary step: route `weight` percent to the new artifact, then pause and/or analyse."""

    weight: int = Field(ge=0, le=100, description="Percent of traffic to the canary.")
    pause_seconds: int | None = Field(
        default=None, ge=0, le=86400 * 7, description="Wait this long; unset waits for promote."
    )
    analysis: bool = Field(default=True, description="Run the analysis metrics during this step.")


class Shadow(KubeModel):
    """Mirror traffic to the new artifact before any canary; responses are discarded."""

    percent: int = Field(ge=1, le=100, description="Percent of requests mirrored.")
    duration_seconds: int = Field(ge=1, le=86400 * 7, description="How long to mirror.")


class ManualAction(StrEnum):
    NONE = ""
    ABORT = "Abort"
    PROMOTE = "Promote"


class RolloutSpec(KubeModel):
    """The move of one pool to a new artifact."""

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
                cel(
                    "self.targetArtifactRef == oldSelf.targetArtifactRef",
                    "targetArtifactRef is immutable; create a new Rollout",
                    ".targetArtifactRef",
                ),
            ]
        }
    )

    pool_ref: PoolRef = Field(description="The ServingPool moved. Immutable.")
    target_artifact_ref: ArtifactRef = Field(description="The ModelArtifact moved to. Immutable.")
    steps: list[Step] = Field(
        min_length=1,
        max_length=MAX_STEPS,
        description="Canary steps; weights strictly increase and the last is 100.",
    )
    shadow: Shadow | None = Field(default=None, description="Optional shadow phase first.")
    analysis: Analysis | None = Field(default=None, description="Analysis metrics.")
    auto_promote: bool = Field(
        default=True, description="Advance past passing steps without a manual promote."
    )
    auto_rollback: bool = Field(
        default=True, description="Return all traffic to stable when analysis fails."
    )
    action: ManualAction = Field(
        default=ManualAction.NONE,
        description="Manual action: Abort (back to stable) or Promote (next step now).",
    )

    @field_validator("steps")
    @classmethod
    def _weights(cls, steps: list[Step]) -> list[Step]:
        weights = [step.weight for step in steps]
        if any(b <= a for a, b in itertools.pairwise(weights)):
            raise ValueError(f"canary step weights must strictly increase, got {weights}")
        if weights and weights[-1] != 100:
            raise ValueError(f"canary steps must end at weight 100, got {weights}")
        return steps

    @model_validator(mode="after")
    def _analysis(self) -> RolloutSpec:
        if any(step.analysis for step in self.steps) and self.analysis is None:
            # Steps default to analysis=True; without metrics they would pass vacuously.
            raise ValueError(
                "steps request analysis but spec.analysis defines no metrics; add "
                "spec.analysis.metrics or set analysis: false on the steps"
            )
        return self


class MetricResult(KubeModel):
    """The last evaluation of one metric."""

    name: str = Field(description="Metric name.")
    value: float | None = Field(default=None, description="Canary value (or ratio to stable).")
    samples: int = Field(default=0, ge=0, description="Requests it was computed from.")
    passed: bool | None = Field(default=None, description="Unset while samples are too few.")
    failures: int = Field(default=0, ge=0, description="Failed evaluations so far.")


class RolloutStatus(KubeModel):
    """Progress; enough to resume after an operator restart."""

    stable_revision: str | None = Field(
        default=None, pattern=SHA256_PATTERN, description="Manifest hash serving stable traffic."
    )
    canary_revision: str | None = Field(
        default=None, pattern=SHA256_PATTERN, description="Manifest hash of the target."
    )
    current_step: int | None = Field(default=None, ge=0, description="Index of the step.")
    current_weight: int = Field(default=0, ge=0, le=100, description="Canary traffic percent.")
    step_started_at: datetime | None = Field(default=None, description="When the step began.")
    shadow_started_at: datetime | None = Field(default=None, description="When shadow began.")
    metric_results: list[MetricResult] = Field(
        default_factory=list, max_length=MAX_METRICS, description="Latest metric results."
    )
    observed_generation: int | None = Field(default=None, ge=0, description="Generation seen.")
    conditions: list[Condition] = conditions_field()


class Rollout(KubeModel):
    """Moves a ServingPool to another ModelArtifact: optional shadow traffic, canary steps with
    PromQL analysis, automatic promotion or rollback. Progress lives in status."""

    crd: ClassVar[CRDNames] = CRDNames(
        plural="rollouts",
        short_names=("ro",),
        printer_columns=(
            PrinterColumn("Pool", ".spec.poolRef.name"),
            PrinterColumn("Target", ".spec.targetArtifactRef.name"),
            PrinterColumn("Step", ".status.currentStep", type="integer"),
            PrinterColumn("Weight", ".status.currentWeight", type="integer"),
            PrinterColumn("Progressing", '.status.conditions[?(@.type=="Progressing")].status'),
            age_column(),
        ),
    )

    api_version: Literal["kvfleet.io/v1alpha1"] = Field(
        default="kvfleet.io/v1alpha1", description="kvfleet.io/v1alpha1"
    )
    kind: Literal["Rollout"] = Field(default="Rollout", description="Rollout")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: RolloutSpec = Field(description="Desired move.")
    status: RolloutStatus | None = Field(default=None, description="Progress.")
