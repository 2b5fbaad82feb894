"""ServingPool: N replicas of the engine serving one ModelArtifact on one GPU product."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from kvfleet.api.meta import (
    DNS_LABEL_PATTERN,
    QUANTITY_PATTERN,
    SHA256_PATTERN,
    Condition,
    CRDNames,
    KubeModel,
    ObjectMeta,
    PrinterColumn,
    age_column,
    cel,
    conditions_field,
    ready_column,
)
from kvfleet.api.podsettings import PodSettings


class ArtifactRef(KubeModel):
    """A ModelArtifact in the same namespace."""

    name: str = Field(min_length=1, max_length=253, description="ModelArtifact name.")


class GPU(KubeModel):
    """The GPUs of one replica."""

    product: str = Field(
        min_length=1,
        max_length=128,
        description="GPU product as labelled on nodes (nvidia.com/gpu.product), e.g. NVIDIA-L4.",
    )
    count: int = Field(
        default=1, ge=1, le=16, description="GPUs per replica; the tensor-parallel degree."
    )
    memory: str | None = Field(
        default=None,
        pattern=QUANTITY_PATTERN,
        description="Memory of one GPU (e.g. 24Gi); defaults to the product's in the matrix.",
    )


class PrefixCacheScope(StrEnum):
    TENANT = "tenant"
    SHARED = "shared"


class PrefixCache(KubeModel):
    """Prefix caching of full KV blocks."""

    enabled: bool = Field(default=True, description="Reuse KV blocks of identical prefixes.")
    scope: PrefixCacheScope = Field(
        default=PrefixCacheScope.TENANT,
        description="tenant: hits only within a tenant; shared: across tenants whose "
        "TenantQuota allows shared caching.",
    )


class KVCacheDType(StrEnum):
    AUTO = "auto"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FP8 = "fp8"


class EngineSettings(KubeModel):
    """Settings of the bundled engine in every replica."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.chunkedPrefillSize) || self.chunkedPrefillSize <= "
                    "self.maxBatchedTokens",
                    "chunkedPrefillSize must not exceed maxBatchedTokens",
                ),
            ]
        }
    )

    block_size: Literal[8, 16, 32] = Field(default=16, description="Tokens per KV block.")
    max_batched_tokens: int = Field(
        default=8192, ge=16, le=1048576, description="Token budget of one scheduler step."
    )
    max_running_requests: int = Field(
        default=256, ge=1, le=65536, description="Requests decoding concurrently."
    )
    chunked_prefill_size: int | None = Field(
        default=None, ge=16, description="Longest prefill chunk per step (unset: no limit)."
    )
    prefill_tokens_per_step: int | None = Field(
        default=None,
        ge=0,
        description="Prompt tokens of one step's prefill chunks together (a step's first chunk "
        "always runs): a low cap spreads a burst of arrivals over steps, so requests stop "
        "starting and finishing in waves. Unset: 64 on CPU replicas, no cap on GPUs; 0: no cap.",
    )
    max_model_length: int | None = Field(
        default=None,
        ge=1,
        description="Longest sequence (prompt + output) admitted; defaults to the artifact's "
        "max context. The capacity plan reserves KV for at least one such sequence.",
    )
    kv_cache_dtype: KVCacheDType = Field(
        default=KVCacheDType.AUTO, description="KV cache dtype; auto = the model's compute dtype."
    )
    int8_activations: bool = Field(
        default=False,
        description="CPU replicas: decode steps of 1-2 running requests round the 4-bit layer "
        "matmuls' input to 8 bits (llama.cpp's numerics): faster, not float32-exact. Ignored "
        "on GPUs.",
    )
    int16_activations: bool = Field(
        default=False,
        description="CPU replicas: the 4-bit weight matmuls round their input to 16 bits and "
        "sum in integers: 1.1-1.9x faster on AVX-512 VNNI, logits within ~7e-3 of float32. "
        "With int8Activations, 1-2 row steps keep 8 bits. Ignored on GPUs.",
    )
    prefix_cache: PrefixCache = Field(
        default_factory=PrefixCache,
        description="Prefix caching.",
        json_schema_extra={"default": {}},
    )
    workspace: str = Field(
        default="2Gi",
        pattern=QUANTITY_PATTERN,
        description="GPU memory per rank for activations, CUDA graphs and kernels' scratch.",
    )
    safety_margin: str = Field(
        default="1Gi",
        pattern=QUANTITY_PATTERN,
        description="GPU memory per rank held back (driver, fragmentation).",
    )
    drain_seconds: int = Field(
        default=30,
        ge=0,
        le=3600,
        description="How long a replica that is going away (scale-down, rollout, node drain) "
        "lets its in-flight requests finish before they are cut: it takes no new ones and "
        "exits as soon as none is left. Set it above the pool's longest generation "
        "(max_tokens / tokens a second) so that no stream fails on the way down; the pod's "
        "termination grace period follows it.",
    )


class SLOs(KubeModel):
    """Service level objectives the rollout analysis and the autoscaler hold the pool to."""

    ttft_p95_seconds: float | None = Field(
        default=None, gt=0, description="95th percentile time to first token."
    )
    tpot_p95_seconds: float | None = Field(
        default=None, gt=0, description="95th percentile time per output token (N>1 tokens)."
    )
    error_rate: float | None = Field(
        default=None, ge=0, le=1, description="Largest tolerated fraction of failed requests."
    )


class Reserves(KubeModel):
    """Replicas kept beyond what the load needs."""

    failover: int = Field(default=0, ge=0, description=(
        "Spare replicas for node/GPU failure (with autoscaling: kept above the load's count)."))
    deployment: int = Field(default=0, ge=0, description="Surge replicas during rollouts.")
    burst: int = Field(default=0, ge=0, description=(
        "Replicas for traffic bursts (with autoscaling: kept above the load's count)."))


class ScaleToZero(KubeModel):
    """A pool with no replicas while nobody uses it. It stays listed in the routers'
    /v1/models; a request for it is held by the router (bounded per pool and per tenant)
    while the operator brings one replica up, then served; a full hold or a wake longer than
    the request may wait is a 503 with Retry-After, never a 404."""

    idle_seconds: int = Field(
        default=600, ge=30, le=7 * 86400,
        description="Seconds without a request (over every router) before the replicas go "
        "to 0.")


_SURGE_RULE = ("maxReplicas + rolloutSurge must be at least 2: a rollout runs one stable and "
               "one canary replica at the least")


class Autoscaling(KubeModel):
    """Replicas from the load the engines and routers measure (absent: spec.replicas, or
    whatever writes the /scale subresource: HPA, KEDA, `kubectl scale`). The operator writes
    spec.replicas itself, as HPA writes a Deployment's: leave it out of Git (or ignore its
    difference) so a GitOps sync does not fight it.

    Each interval the desired count is the largest of: the load signal (the same load score
    the router picks replicas by, so the two agree on what saturated means), the KV-cache
    signal, and one more replica while the TTFT or TPOT p95 misses the pool's spec.slos; then
    bounded, stabilised (a scale-down takes the highest count recommended over its window)
    and moved at most maxStep. Missing or stale signals hold the count (AutoscalingActive
    False says which); replicas the scheduler cannot place stop it growing (ScalingLimited)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.minReplicas <= self.maxReplicas",
                    "minReplicas must not exceed maxReplicas", ".minReplicas"),
                cel("has(self.scaleToZero) == (self.minReplicas == 0)",
                    "minReplicas 0 goes with scaleToZero (its idleSeconds), and scaleToZero "
                    "with minReplicas 0", ".scaleToZero"),
                cel("self.maxReplicas + self.rolloutSurge >= 2", _SURGE_RULE,
                    ".rolloutSurge"),
            ]
        }
    )

    min_replicas: int = Field(
        default=1, ge=0, le=10000,
        description="Fewest replicas; 0 (with scaleToZero) once the pool is idle.")
    max_replicas: int = Field(ge=1, le=10000, description="Most replicas.")
    target_load: float = Field(
        default=4.0, gt=0, le=100000,
        description="Load per replica the pool is sized for, in the router's load score: 2 "
        "per waiting request, 1 per running request, and 50 per unit of KV-cache use over "
        "80 %. 4: some 4 concurrent streams per replica, none queued.")
    target_kv_cache_usage: float | None = Field(
        default=None, gt=0, le=1,
        description="Mean KV-cache use per replica the pool is sized for (0-1); unset: not "
        "a signal.")
    slo_scaling: bool = Field(
        default=True,
        description="Add a replica while the pool's TTFT or TPOT p95 (over the last minute, "
        "live traffic) misses spec.slos, once every replica asked for is Ready and a minute "
        "has passed since the last scale-up.")
    scale_up_stabilization_seconds: int = Field(
        default=0, ge=0, le=3600,
        description="A scale-up takes the lowest count recommended over this window.")
    scale_down_stabilization_seconds: int = Field(
        default=300, ge=0, le=86400,
        description="A scale-down takes the highest count recommended over this window.")
    max_step: int = Field(default=4, ge=1, le=1000, description="Most replicas one decision "
                          "adds or removes.")
    stale_after_seconds: int = Field(
        default=60, ge=5, le=3600,
        description="Signals older than this hold the count (AutoscalingActive False).")
    pending_grace_seconds: int = Field(
        default=120, ge=10, le=3600,
        description="How long replicas may stay unschedulable (no node with a free GPU) "
        "before the count stops growing (ScalingLimited): time for a node autoscaler to add "
        "one; after it, pods that cannot be placed are not asked for again and again.")
    scale_to_zero: ScaleToZero | None = Field(
        default=None, description="Go to 0 replicas when idle (needs minReplicas 0); "
        "requests wake the pool.")
    rollout_surge: int = Field(
        default=1, ge=0, le=1000,
        description="Replicas a rollout may run beyond maxReplicas. While a Rollout runs, "
        "the autoscaler's count is shared by stable and canary in proportion to the canary's "
        "weight (at least 1 each), and their sum stays within maxReplicas + rolloutSurge. A "
        "rollback then has stable's share to serve on until it grows back.")

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        # (the CRD's CEL rules, for the webhook and every other reader of the models)
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas must not exceed maxReplicas ({self.min_replicas} > "
                             f"{self.max_replicas})")
        if (self.scale_to_zero is not None) != (self.min_replicas == 0):
            raise ValueError("minReplicas 0 goes with scaleToZero (its idleSeconds), and "
                             "scaleToZero with minReplicas 0")
        if self.max_replicas + self.rollout_surge < 2:
            raise ValueError(f"{_SURGE_RULE} (maxReplicas {self.max_replicas}, rolloutSurge "
                             f"{self.rollout_surge})")
        return self


class AutoscalingStatus(KubeModel):
    """The autoscaler's last decision."""

    desired_replicas: int = Field(ge=0, description="The count it decided.")
    signal: str = Field(max_length=32, description="What decided it: load, kvCache, slo, "
                        "min, max, idle (to zero), rollout (idle, but a rollout runs: not to "
                        "zero), held (a held request woke it), hold (no replica measured), "
                        "stale (signals missing).")
    message: str = Field(default="", max_length=1024, description="The deciding numbers.")
    last_scale_time: str | None = Field(default=None, description="When it last changed "
                                        "spec.replicas (RFC 3339).")


class DataClass(StrEnum):
    PUBLIC = "public"
    INTERNAL = "internal"
    CONFIDENTIAL = "confidential"
    RESTRICTED = "restricted"


class ServingPoolSpec(KubeModel):
    """Desired state of the pool."""

    artifact_ref: ArtifactRef = Field(description="The ModelArtifact served.")
    replicas: int = Field(default=1, ge=0, le=10000, description="Engine replicas.")
    gpu: GPU = Field(description="GPUs per replica.")
    engine: EngineSettings = Field(
        default_factory=EngineSettings,
        description="Engine settings.",
        json_schema_extra={"default": {}},
    )
    slos: SLOs | None = Field(default=None, description="Service level objectives.")
    autoscaling: Autoscaling | None = Field(
        default=None, description="Replicas from measured load (absent: spec.replicas).")
    reserves: Reserves = Field(
        default_factory=Reserves, description="Reserve replicas.", json_schema_extra={"default": {}}
    )
    region: str | None = Field(
        default=None, pattern=DNS_LABEL_PATTERN, max_length=63, description="Region (zone set)."
    )
    data_class: DataClass = Field(
        default=DataClass.INTERNAL, description="Most sensitive data the pool may process."
    )
    pod: PodSettings = Field(
        default_factory=PodSettings,
        description="Engine pod settings: node selection, tolerations, priority, resources, "
        "model cache, image, env.",
        json_schema_extra={"default": {}},
    )


class PoolCapacity(KubeModel):
    """What the capacity planner computed for one replica."""

    kv_tokens_per_replica: int | None = Field(
        default=None, ge=0, description="Tokens of KV cache one replica holds (whole blocks)."
    )
    candidate_concurrency: int | None = Field(
        default=None, ge=0, description="Concurrent max-length sequences one replica fits."
    )


class TrafficRole(StrEnum):
    """What a revision's traffic is: the one serving (stable), the one being tried on a share of
    live traffic (canary), or one that gets copies of live requests whose answers are discarded
    (shadow)."""

    STABLE = "stable"
    CANARY = "canary"
    SHADOW = "shadow"


class TrafficTarget(KubeModel):
    """One revision of the pool in the router's traffic table."""

    revision: str = Field(pattern=SHA256_PATTERN, description="A revision (status.revision).")
    role: TrafficRole = Field(description="stable, canary or shadow.")
    weight: int = Field(
        default=0, ge=0, le=100,
        description="Percent of live conversations routed here (stable and canary entries add "
        "up to 100; shadow entries take none).")
    shadow_percent: int = Field(
        default=0, ge=0, le=100,
        description="For a shadow entry: percent of live requests copied to it.")
    probe_percent: int = Field(
        default=0, ge=0, le=100,
        description="For a canary or shadow entry: percent of live requests mirrored as "
        "greedy probes to it and to stable, whose answers are compared token by token.")


MAX_PROBE_PROMPTS = 16
PROBE_PROMPT_CHARS = 2048


class SyntheticTraffic(KubeModel):
    """Requests the routers send themselves while a rollout is judged and live traffic is
    thinner than `ratePerSecond` (the Rollout's analysis.probePrompts): the quiet pool's
    evidence. Written by the Rollout controller."""

    prompts: list[Annotated[str, Field(max_length=PROBE_PROMPT_CHARS)]] = Field(
        min_length=1, max_length=MAX_PROBE_PROMPTS, description="User messages, in turn.")
    rate_per_second: float = Field(gt=0, le=20, description="Requests a second each router "
                                   "keeps up (live ones count first).")
    max_tokens: int = Field(ge=1, le=1024, description="max_tokens of each.")


MAX_REFUSED = 10
RETRY_ANNOTATION = "kvfleet.io/retry-revision"
# "true": another autoscaler (KEDA, an HPA) may take the pool to 0 replicas and back, so the
# routers hold its requests at zero (and export the held count it can scale on), as they do for
# a pool whose own spec.autoscaling has minReplicas 0.
WAKE_ANNOTATION = "kvfleet.io/wake-on-request"
# On a ServingPool: the other namespaces (comma-separated, or "*") whose tenants may use it,
# when their TenantQuota's allowedPools also names it as namespace/name (kvfleet.router.access).
SHARED_WITH_ANNOTATION = "kvfleet.io/shared-with"


class RefusalReason(StrEnum):
    """Why a revision is refused: a Rollout rolled it back or aborted it, or the Rollout trying
    it was deleted before it finished."""

    ROLLED_BACK = "RolledBack"
    ABORTED = "Aborted"
    ROLLOUT_DELETED = "RolloutDeleted"


class RefusedRevision(KubeModel):
    """A revision the pool will not serve again until a person retries it: whatever Git, a
    deleted or new Rollout, or a restore of the pool does."""

    revision: str = Field(pattern=SHA256_PATTERN, description="A revision (status.revision).")
    artifact: str = Field(default="", max_length=253, description="Its ModelArtifact, then.")
    reason: RefusalReason = Field(description="RolledBack, Aborted or RolloutDeleted.")
    rollout: str = Field(default="", max_length=253, description="The Rollout that decided.")
    message: str = Field(default="", max_length=512, description="Why, in the Rollout's words.")
    at: datetime = Field(description="When it was refused.")


class ServingPoolStatus(KubeModel):
    """Observed state of the pool."""

    replicas: int = Field(default=0, ge=0, description="Replicas created.")
    ready_replicas: int = Field(default=0, ge=0, description="Replicas passing readiness.")
    selector: str | None = Field(
        default=None, max_length=1024,
        description="Label selector of the pool's engine pods, every revision's (the /scale "
        "subresource's, which a HorizontalPodAutoscaler reads).")
    capacity: PoolCapacity | None = Field(default=None, description="Planned capacity.")
    revision: str | None = Field(
        default=None, pattern=SHA256_PATTERN,
        description="The revision the spec asks for: a hash of the artifact's manifest, the "
        "engine image and the engine settings (a change of any of them is a new revision).")
    serving_revision: str | None = Field(
        default=None,
        pattern=SHA256_PATTERN,
        description="The revision the replicas serve (see revision).",
    )
    serving_artifact: str | None = Field(
        default=None, max_length=253,
        description="The ModelArtifact whose revision serves (spec.artifactRef is the one "
        "desired; they differ while a new revision rolls out or is blocked).")
    traffic: list[TrafficTarget] = Field(
        default_factory=list, max_length=4,
        description="The router's traffic table, written by the Rollout controller; empty: "
        "every request goes to servingRevision.")
    synthetic_traffic: SyntheticTraffic | None = Field(
        default=None, description="While a rollout is judged: what the routers send "
        "themselves when live traffic is thin (the Rollout's analysis.probePrompts).")
    autoscaling: AutoscalingStatus | None = Field(
        default=None, description="The autoscaler's last decision (with spec.autoscaling).")
    refused_revisions: list[RefusedRevision] = Field(
        default_factory=list, max_length=MAX_REFUSED,
        description="Revisions rolled back, aborted, or left by a deleted Rollout: never served "
        "again until `kvfleet rollout retry` (or the kvfleet.io/retry-revision annotation "
        "naming the revision) clears them. The latest ten, oldest first.")
    handled_retry: str | None = Field(
        default=None, max_length=253,
        description="The kvfleet.io/retry-revision annotation value last acted on (once).")
    observed_generation: int | None = Field(default=None, ge=0, description="Generation seen.")
    conditions: list[Condition] = conditions_field()


class ServingPool(KubeModel):
    """N replicas of the kvfleet engine serving one ModelArtifact on one GPU product, with
    engine settings, SLOs and reserves; status reports ready replicas and the planned KV
    capacity per replica."""

    crd: ClassVar[CRDNames] = CRDNames(
        plural="servingpools",
        short_names=("sp", "pool"),
        scale=True,
        printer_columns=(
            PrinterColumn("Artifact", ".spec.artifactRef.name"),
            PrinterColumn("Serving", ".status.servingArtifact"),
            PrinterColumn("GPU", ".spec.gpu.product"),
            PrinterColumn("Desired", ".spec.replicas", type="integer"),
            PrinterColumn("Current", ".status.replicas", type="integer"),
            PrinterColumn("Ready-Replicas", ".status.readyReplicas", type="integer"),
            PrinterColumn("Scaled-By", ".status.autoscaling.signal"),
            PrinterColumn(
                "KV-Tokens", ".status.capacity.kvTokensPerReplica", type="integer", priority=1
            ),
            ready_column(),
            age_column(),
        ),
    )

    api_version: Literal["kvfleet.io/v1alpha1"] = Field(
        default="kvfleet.io/v1alpha1", description="kvfleet.io/v1alpha1"
    )
    kind: Literal["ServingPool"] = Field(default="ServingPool", description="ServingPool")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: ServingPoolSpec = Field(description="Desired state.")
    status: ServingPoolStatus | None = Field(default=None, description="Observed state.")
