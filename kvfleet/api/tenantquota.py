"""TenantQuota: one tenant's budget, enforced by the router before the engine sees a request."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import Field

from kvfleet.api.meta import (
    DNS_LABEL_PATTERN,
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

# Tenant names kvfleet uses itself: the router's greedy probes (`kvfleet.router.probes`), the
# engine's shared prefix-cache scope and its tenant for requests without a tenant header. A
# TenantQuota claiming one would read `cached_tokens` for prompts the probes copied there.
RESERVED_TENANTS = ("kvfleet-probe", "kvfleet-shared", "default")
RESERVED_PREFIX = "kvfleet-"  # every name of this prefix is kept for kvfleet's own use


def reserved_tenant(name: str) -> bool:
    return name.startswith(RESERVED_PREFIX) or name in RESERVED_TENANTS


class PriorityClass(StrEnum):
    """Scheduling priority; higher classes preempt lower ones when KV blocks run out."""

    CRITICAL = "critical"
    HIGH = "high"
    STANDARD = "standard"
    BATCH = "batch"


class Limits(KubeModel):
    """Rates and sizes; an unset limit is unlimited."""

    requests_per_minute: int | None = Field(default=None, ge=0, description="Requests/minute.")
    input_tokens_per_minute: int | None = Field(
        default=None, ge=0, description="Prompt tokens/minute."
    )
    output_tokens_per_minute: int | None = Field(
        default=None, ge=0, description="Generated tokens/minute."
    )
    max_concurrent_requests: int | None = Field(
        default=None, ge=0, description="Requests in flight at once."
    )
    kv_blocks: int | None = Field(
        default=None, ge=0, description="KV cache blocks the tenant may hold per replica."
    )


class BorrowableResource(StrEnum):
    REQUESTS_PER_MINUTE = "requestsPerMinute"
    INPUT_TOKENS_PER_MINUTE = "inputTokensPerMinute"
    OUTPUT_TOKENS_PER_MINUTE = "outputTokensPerMinute"
    MAX_CONCURRENT_REQUESTS = "maxConcurrentRequests"
    KV_BLOCKS = "kvBlocks"


class Borrowing(KubeModel):
    """Idle capacity of other tenants this tenant may use, and how much."""

    resources: list[BorrowableResource] = Field(
        default_factory=list, max_length=5, description="Limits that may be exceeded by borrowing."
    )
    max_percent: int = Field(
        default=0, ge=0, le=1000, description="At most this percent above each limit."
    )


class TenantQuotaSpec(KubeModel):
    """The tenant's budget."""

    tenant: str = Field(
        pattern=DNS_LABEL_PATTERN,
        max_length=63,
        description="Tenant id (as authenticated by the router). Immutable.",
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self == oldSelf", "tenant is immutable"),
                cel(f'!self.startsWith("{RESERVED_PREFIX}") && self != "default"',
                    f"tenant names starting {RESERVED_PREFIX}, and default, are the router's "
                    "and the engine's own; choose another"),
            ]
        },
    )
    limits: Limits = Field(
        default_factory=Limits, description="Limits.", json_schema_extra={"default": {}}
    )
    priority_class: PriorityClass = Field(
        default=PriorityClass.STANDARD, description="Scheduling priority."
    )
    borrowing: Borrowing | None = Field(default=None, description="Borrowing of idle capacity.")
    allowed_pools: list[str] = Field(
        default_factory=list, max_length=256,
        description="ServingPools usable: a name is a pool of this TenantQuota's namespace, "
        "`namespace/name` another namespace's pool, usable only when that pool's "
        "kvfleet.io/shared-with annotation lists this namespace (or *). Empty: every pool of "
        "this namespace, and no other.")
    allowed_regions: list[str] = Field(
        default_factory=list, max_length=64, description="Regions usable; empty means all."
    )
    shared_prefix_cache: bool = Field(
        default=False,
        description="Whether this tenant's prompts may hit (and seed) KV blocks shared with "
        "other tenants. Off by default: a cache hit leaks timing about others' prompts.",
    )


class TenantUsage(KubeModel):
    """Recent usage reported by the router."""

    requests_per_minute: int | None = Field(default=None, ge=0, description="Requests/minute.")
    tokens_per_minute: int | None = Field(default=None, ge=0, description="Tokens/minute.")
    concurrent_requests: int | None = Field(default=None, ge=0, description="In flight.")


class BucketsLeft(KubeModel):
    """Allowance left in one router's share of each per-minute limit."""

    requests_per_minute: float | None = Field(default=None, description="Requests left.")
    input_tokens_per_minute: float | None = Field(default=None, description="Input tokens left.")
    output_tokens_per_minute: float | None = Field(
        default=None, description="Output tokens left.")


class RouterReport(KubeModel):
    """One router replica's part: its recent usage and what its buckets had left when it wrote
    (a restarted router starts from these, not from full buckets)."""

    at: datetime = Field(description="When the router wrote this report.")
    requests_per_minute: int = Field(default=0, ge=0, description="Requests/minute.")
    tokens_per_minute: int = Field(default=0, ge=0, description="Tokens/minute.")
    concurrent_requests: int = Field(default=0, ge=0, description="In flight.")
    remaining: BucketsLeft = Field(
        default_factory=BucketsLeft, description="What this router's buckets had left at `at`.")


class TenantQuotaStatus(KubeModel):
    """Observed state."""

    usage: TenantUsage | None = Field(
        default=None, description="Recent usage, summed over the router replicas.")
    routers: dict[str, RouterReport] = Field(
        default_factory=dict, description="Each router replica's report, by its pod name.")
    observed_generation: int | None = Field(default=None, ge=0, description="Generation seen.")
    conditions: list[Condition] = conditions_field()


class TenantQuota(KubeModel):
    """A tenant's budget, enforced by the router before the engine sees a request: request and
    token rates, concurrency, KV blocks, priority, borrowing, allowed pools and regions."""

    crd: ClassVar[CRDNames] = CRDNames(
        plural="tenantquotas",
        # Not "quota": ResourceQuota has it.
        short_names=("tq",),
        printer_columns=(
            PrinterColumn("Tenant", ".spec.tenant"),
            PrinterColumn("Priority", ".spec.priorityClass"),
            PrinterColumn("RPM", ".spec.limits.requestsPerMinute", type="integer"),
            PrinterColumn("Concurrency", ".spec.limits.maxConcurrentRequests", type="integer"),
            ready_column(),
            age_column(),
        ),
    )

    api_version: Literal["kvfleet.io/v1alpha1"] = Field(
        default="kvfleet.io/v1alpha1", description="kvfleet.io/v1alpha1"
    )
    kind: Literal["TenantQuota"] = Field(default="TenantQuota", description="TenantQuota")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: TenantQuotaSpec = Field(description="The budget.")
    status: TenantQuotaStatus | None = Field(default=None, description="Observed state.")
