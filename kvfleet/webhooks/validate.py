"""Pure admission rules: `validate_<kind>(new, old, ...) -> list[FieldError]`.

No I/O here: referenced objects (the pool's ModelArtifact, the rollout's pool) are
arguments, resolved by the caller — the HTTPS adapter reads them from the apiserver, `kvfleet
check` from the files it was given. An empty list admits the object; errors reject it;
warnings (severity "warning") admit it with a warning shown by kubectl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvfleet.api import ModelArtifact, Rollout, ServingPool, TenantQuota, manifest_hash
from kvfleet.api.analysis import AnalysisConfigError, plans
from kvfleet.api.quantity import GIB, format_bytes
from kvfleet.api.tenantquota import RESERVED_PREFIX, RESERVED_TENANTS, reserved_tenant
from kvfleet.capacity import MemoryPlan, plan_for_pool
from kvfleet.compat import ENGINE_VERSION, Incompatibility, Matrix, check


@dataclass(frozen=True)
class FieldError:
    """One reason to reject (or warn about) an object."""

    field: str  # Kubernetes field path, e.g. spec.gpu.product
    rule: str  # immutable, compatibility, capacity, reference, schema, consistency, ownership,
    # uniqueness
    message: str
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        return f"{self.field}: {self.message} [rule: {self.rule}]"


def _gib(num_bytes: int | None) -> str:
    return "unknown" if num_bytes is None else f"{num_bytes / GIB:.3f} GiB"


def _own(found: list[Incompatibility], kind: str) -> list[FieldError]:
    return [
        FieldError(
            i.field, "compatibility", f"{i.reason} (compatibility matrix {i.matrix_version})"
        )
        for i in found
        if i.kind == kind
    ]


def _referenced(found: list[Incompatibility], ref_field: str, what: str) -> list[FieldError]:
    """Problems of a referenced artifact, reported on the reference field of this object."""
    return [
        FieldError(
            ref_field,
            "compatibility",
            f"{what}: {i.field}: {i.reason} (compatibility matrix {i.matrix_version})",
        )
        for i in found
        if i.kind == "ModelArtifact"
    ]


def validate_modelartifact(
    new: ModelArtifact,
    old: ModelArtifact | None,
    *,
    matrix: Matrix,
    engine_version: str = ENGINE_VERSION,
) -> list[FieldError]:
    errors: list[FieldError] = []
    if old is not None and manifest_hash(new.spec) != manifest_hash(old.spec):
        fields = type(new.spec).model_fields
        aliases = sorted(
            info.alias or key
            for key, info in fields.items()
            if getattr(new.spec, key) != getattr(old.spec, key)
        )
        errors.append(
            FieldError(
                "spec",
                "immutable",
                f"ModelArtifact spec is immutable (changed: {', '.join(aliases)}); create a new "
                "ModelArtifact and move pools to it with a Rollout",
            )
        )
    errors += _own(check(new.spec, matrix=matrix, engine_version=engine_version), "ModelArtifact")
    return errors


def gpu_memory_bytes(pool: ServingPool, matrix: Matrix) -> int | None:
    """The pool's gpu.memory, else its product's memory in the matrix (None if unknown)."""
    product = matrix.gpu_products.get(pool.spec.gpu.product)
    return product.memory_bytes if product is not None else None


def _capacity(
    plan: MemoryPlan, pool: ServingPool, artifact: ModelArtifact, field: str
) -> list[FieldError]:
    gpu = pool.spec.gpu
    if plan.fits is None:
        return [
            FieldError(
                field,
                "capacity",
                f"cannot verify that ModelArtifact {artifact.metadata.name} fits on {gpu.product}: "
                f"unknown {', '.join(plan.unknowns)}",
                severity="warning",
            )
        ]
    if plan.fits:
        return []
    lines = ", ".join(
        f"{line.name} {_gib(line.bytes_per_rank)}"
        for line in plan.ledger[:-1]
        if line.bytes_per_rank
    )
    return [
        FieldError(
            field,
            "capacity",
            f"ModelArtifact {artifact.metadata.name} does not fit on {gpu.count}× {gpu.product}: "
            f"per GPU {lines} leave {_gib(plan.kv_budget_bytes_per_rank)} for the KV cache, but "
            f"one {plan.seq_tokens}-token sequence needs "
            f"{format_bytes(plan.kv_bytes_per_sequence or 0)} across {gpu.count} GPU(s); use a "
            "larger GPU, more GPUs per replica, a smaller engine.maxModelLength or an fp8 KV cache",
        )
    ]


def validate_servingpool(
    new: ServingPool,
    old: ServingPool | None,
    *,
    artifact: ModelArtifact | None,
    matrix: Matrix,
    engine_version: str = ENGINE_VERSION,
) -> list[FieldError]:
    ref = new.spec.artifact_ref.name
    if artifact is None:
        return [
            FieldError(
                "spec.artifactRef.name",
                "reference",
                f"ModelArtifact {ref!r} not found in namespace {new.metadata.namespace!r}; "
                "create it first",
            )
        ]
    found = check(artifact.spec, new.spec, matrix=matrix, engine_version=engine_version)
    errors = _own(found, "ServingPool")
    errors += _referenced(found, "spec.artifactRef.name", f"ModelArtifact {ref} is incompatible")
    # A GPU the matrix does not know, or cannot run the model, has no meaningful memory plan.
    if not any(e.field == "spec.gpu.product" for e in errors):
        plan = plan_for_pool(artifact.spec, new.spec, gpu_memory_bytes(new, matrix))
        errors += _capacity(plan, new, artifact, "spec.gpu")
    return errors


def validate_tenantquota(new: TenantQuota, old: TenantQuota | None) -> list[FieldError]:
    errors = []
    if old is not None and new.spec.tenant != old.spec.tenant:
        errors.append(
            FieldError(
                "spec.tenant",
                "immutable",
                f"tenant is immutable ({old.spec.tenant!r} → {new.spec.tenant!r}); create a new "
                "TenantQuota",
            )
        )
    if reserved_tenant(new.spec.tenant):
        errors.append(FieldError(
            "spec.tenant", "reserved",
            f"tenant {new.spec.tenant!r} is reserved (kvfleet keeps names starting "
            f"{RESERVED_PREFIX} and default for itself: the router's probes "
            f"({', '.join(RESERVED_TENANTS)}), the engine's shared prefix cache and its "
            "header-less requests); choose another tenant name"))
    borrowing = new.spec.borrowing
    if borrowing is not None:
        limits = new.spec.limits.model_dump(by_alias=True)
        for index, resource in enumerate(borrowing.resources):
            if limits.get(resource.value) is None:
                errors.append(
                    FieldError(
                        f"spec.borrowing.resources[{index}]",
                        "consistency",
                        f"borrowing {resource.value} needs spec.limits.{resource.value}: there "
                        "is nothing to borrow beyond an unlimited limit",
                    )
                )
    return errors


def validate_rollout(new: Rollout, old: Rollout | None, *, pool: ServingPool | None
                     ) -> list[FieldError]:
    """The policy's own consistency and its pool. The artifacts it will move the pool to are
    the pool's artifactRef, checked when the pool changes (validate_servingpool)."""
    errors = []
    spec = new.spec
    if old is not None and spec.pool_ref != old.spec.pool_ref:
        errors.append(FieldError("spec.poolRef", "immutable",
                                 "poolRef is immutable; create a new Rollout"))
    names = [m.name for m in spec.analysis.metrics]
    for index, name in enumerate(names):
        if name in names[:index]:
            errors.append(
                FieldError(
                    f"spec.analysis.metrics[{index}].name", "consistency", f"duplicate {name}"
                )
            )
    if pool is None:
        errors.append(
            FieldError(
                "spec.poolRef.name",
                "reference",
                f"ServingPool {spec.pool_ref.name!r} not found in namespace "
                f"{new.metadata.namespace!r}",
            )
        )
        return errors
    phases = [(shadow, analysed) for shadow, analysed in (
        (True, bool(spec.shadow and spec.shadow.analysis)),
        (False, any(step.analysis for step in spec.steps))) if analysed]
    for shadow, _ in phases:
        try:
            plans(spec.analysis.metrics, pool.spec.slos, shadow=shadow,
                  agreement=spec.analysis.output_agreement,
                  split=spec.analysis.by_prompt_length)
        except AnalysisConfigError as exc:
            errors.append(FieldError("spec.analysis.metrics", "consistency",
                                     f"{'shadow phase' if shadow else 'canary steps'}: {exc}"))
    return errors
