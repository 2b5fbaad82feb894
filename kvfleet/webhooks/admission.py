"""From raw objects to a decision: parse, resolve references, run the pure rules.

`admit()` is shared by the HTTPS webhook (references fetched from the apiserver) and
`kvfleet check` (references found among the files given). It is async only because fetching
may be; the rules themselves are the pure functions in kvfleet.webhooks.validate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvfleet.api import KINDS, ModelArtifact, Rollout, ServingPool, TenantQuota
from kvfleet.api.documents import error_path
from kvfleet.compat import Matrix
from kvfleet.webhooks.validate import (
    FieldError,
    validate_modelartifact,
    validate_rollout,
    validate_servingpool,
    validate_tenantquota,
)

# (kind, namespace, name) -> the object as stored, or None when it does not exist.
Fetch = Callable[[str, str, str], Awaitable[dict[str, Any] | None]]
# (kind, namespace or None for all) -> the objects stored: for the rules across objects (a
# tenant owned by one namespace; the Rollouts that judge a pool by its slos).
List = Callable[[str, str | None], Awaitable[list[dict[str, Any]]]]


class FetchError(RuntimeError):
    """A referenced object could not be read (apiserver unreachable, forbidden, ...)."""


@dataclass(frozen=True)
class Decision:
    errors: list[FieldError] = field(default_factory=list)
    warnings: list[FieldError] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return not self.errors

    def message(self, kind: str, name: str) -> str:
        details = "; ".join(str(e) for e in self.errors)
        return f"{kind} {name} is invalid: {details}"


def _schema_errors(error: ValidationError) -> list[FieldError]:
    return [
        FieldError(
            error_path(tuple(e["loc"])) or "(object)",
            "schema",
            e["msg"].removeprefix("Value error, "),
        )
        for e in error.errors()
    ]


def _parse(kind: str, data: dict[str, Any]) -> Any:
    return KINDS[kind].model_validate(data)


async def _get(fetch: Fetch, cls: type[Any], namespace: str, name: str) -> Any:
    data = await fetch(cls.__name__, namespace, name)
    if data is None:
        return None
    try:
        return cls.model_validate(data)
    except ValidationError:
        # A stored object that no longer parses is treated as absent: admitting a reference to
        # it would hand the operator something it cannot use.
        return None


async def admit(
    kind: str,
    new_data: dict[str, Any],
    old_data: dict[str, Any] | None,
    *,
    fetch: Fetch,
    matrix: Matrix,
    namespace: str | None = None,
    list_objects: List | None = None,
) -> Decision:
    """The decision for creating (old_data None) or updating an object of `kind`.

    `namespace` is the request's namespace, used when the object does not carry one.
    `list_objects` (None: those rules are skipped) reads the objects the rules across
    objects need.
    """
    if kind not in KINDS:
        return Decision([FieldError("kind", "schema", f"{kind} is not a kvfleet kind")])
    if new_data.get("metadata", {}).get("deletionTimestamp"):
        # Finalizer removal during deletion must never be blocked by a missing reference.
        return Decision()
    if old_data is not None and old_data.get("spec") == new_data.get("spec"):
        # Metadata-only updates (labels, annotations such as a rollout request, finalizers)
        # keep an admitted spec admitted: even if a referenced object has since gone away, and
        # even if a stricter schema after an upgrade no longer accepts the stored spec (the
        # spec's owner fixes it with a spec change, which is validated).
        return Decision()
    try:
        new = _parse(kind, new_data)
    except ValidationError as error:
        return Decision(_schema_errors(error))
    old = None
    warnings: list[FieldError] = []
    if old_data is not None:
        # The stored object is best effort: one that a newer schema refuses must not block the
        # update that fixes it. Its immutable fields then rest on the CRD's CEL rules alone.
        try:
            old = _parse(kind, old_data)
        except ValidationError as error:
            first = _schema_errors(error)[0]
            warnings.append(FieldError(
                first.field, "schema", f"the stored {kind} no longer validates ({first.message});"
                " checked the new object alone", severity="warning"))
        if old is not None and old.spec == new.spec:  # the same spec, spelled otherwise
            return Decision()
    new.metadata.namespace = new.metadata.namespace or namespace or "default"
    namespace = new.metadata.namespace
    found: list[FieldError]
    if isinstance(new, ModelArtifact):
        found = validate_modelartifact(new, old, matrix=matrix)
    elif isinstance(new, ServingPool):
        artifact = await _get(fetch, ModelArtifact, namespace, new.spec.artifact_ref.name)
        found = validate_servingpool(new, old, artifact=artifact, matrix=matrix)
        if list_objects is not None and old is not None and old.spec.slos != new.spec.slos:
            found += _rollouts_judging(new, _parsed(Rollout, await list_objects(
                "Rollout", namespace)))
    elif isinstance(new, TenantQuota):
        found = validate_tenantquota(new, old)
        if list_objects is not None:
            found += _tenant_owned_elsewhere(new, _parsed(TenantQuota, await list_objects(
                "TenantQuota", None)))
    elif isinstance(new, Rollout):
        pool = await _get(fetch, ServingPool, namespace, new.spec.pool_ref.name)
        found = validate_rollout(new, old, pool=pool)
        if list_objects is not None and old is None:
            found += _second_rollout(new, _parsed(Rollout, await list_objects(
                "Rollout", namespace)))
    else:
        raise TypeError(f"no admission rules for {type(new).__name__}")
    return Decision(
        errors=[e for e in found if e.severity == "error"],
        warnings=warnings + [e for e in found if e.severity == "warning"],
    )


def _parsed(cls: type[Any], items: list[dict[str, Any]]) -> list[Any]:
    """The objects that parse and are not being deleted (a namespace going away takes its
    TenantQuotas and Rollouts with it)."""
    out = []
    for data in items:
        if (data.get("metadata") or {}).get("deletionTimestamp"):
            continue
        try:
            out.append(cls.model_validate(data))
        except ValidationError:
            continue  # one that no longer parses claims nothing and judges nothing
    return out


def _rollouts_judging(pool: ServingPool, rollouts: list[Rollout]) -> list[FieldError]:
    """The pool's new slos leave each of its Rollouts something to judge its steps by: a
    Rollout whose built-in metrics take their thresholds from the slos cannot run without
    them (and once running it would hold its canary until maxWaitSeconds)."""
    found = []
    for rollout in rollouts:
        if rollout.spec.pool_ref.name != pool.metadata.name:
            continue
        for error in validate_rollout(rollout, None, pool=pool):
            if error.rule == "consistency" and error.field == "spec.analysis.metrics":
                found.append(FieldError("spec.slos", "consistency",
                                        f"Rollout {rollout.metadata.name} could no longer "
                                        f"judge its {error.message}; give that Rollout "
                                        "spec.analysis.metrics first"))
    return found


def _second_rollout(new: Rollout, rollouts: list[Rollout]) -> list[FieldError]:
    """One Rollout per pool: the operator follows the oldest, so a second one would sit
    unread beside it, and a renamed copy would look like a fresh policy with no history."""
    for other in rollouts:
        if other.spec.pool_ref.name == new.spec.pool_ref.name and \
                other.metadata.name != new.metadata.name:
            return [FieldError("spec.poolRef.name", "uniqueness",
                               f"pool {new.spec.pool_ref.name!r} already has Rollout "
                               f"{other.metadata.name!r}; edit that one, or delete it first "
                               "(the pool keeps its refused revisions either way)")]
    return []


def _tenant_owned_elsewhere(new: TenantQuota, quotas: list[TenantQuota]) -> list[FieldError]:
    """A tenant belongs to one namespace: its quota and its keys live there. A TenantQuota
    claiming a tenant that another namespace's TenantQuota names would let whoever can write
    in this namespace spend that tenant's budget and share its prefix cache."""
    for other in quotas:
        if other.spec.tenant == new.spec.tenant and \
                other.metadata.namespace != new.metadata.namespace:
            return [FieldError("spec.tenant", "ownership",
                               f"tenant {new.spec.tenant!r} belongs to namespace "
                               f"{other.metadata.namespace!r} (TenantQuota "
                               f"{other.metadata.namespace}/{other.metadata.name}); choose "
                               "another tenant name, or change that TenantQuota there")]
    return []
