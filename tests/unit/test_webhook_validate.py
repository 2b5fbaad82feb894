"""Admission rules: what is refused, on which field, with which rule and matrix version."""

from __future__ import annotations

import asyncio
from typing import Any

from kvfleet.api import ModelArtifact, ServingPool
from kvfleet.api.builders import fake_sha256, make_artifact, make_pool, make_quota, make_rollout
from kvfleet.compat import default_matrix
from kvfleet.webhooks import (
    Decision,
    FetchError,
    admit,
    validate_modelartifact,
    validate_rollout,
    validate_servingpool,
    validate_tenantquota,
)

MATRIX = default_matrix()
V = MATRIX.version


def _pool(**changes: Any) -> ServingPool:
    builder = make_pool()
    for path, value in changes.items():
        builder.set("spec." + path.replace("__", "."), value)
    return builder.obj()


def _artifact(**changes: Any) -> ModelArtifact:
    builder = make_artifact()
    for path, value in changes.items():
        builder.set("spec." + path.replace("__", "."), value)
    return builder.obj()


def test_good_objects_are_admitted() -> None:
    artifact = _artifact()
    assert validate_modelartifact(artifact, None, matrix=MATRIX) == []
    assert validate_servingpool(_pool(), None, artifact=artifact, matrix=MATRIX) == []
    assert validate_tenantquota(make_quota().obj(), None) == []
    rollout = make_rollout().obj()
    assert validate_rollout(rollout, None, pool=_pool()) == []


def test_artifact_spec_change_is_refused_naming_the_fields() -> None:
    old = _artifact()
    new = _artifact(dtype="float16", architecture__numLayers=35)
    [error] = validate_modelartifact(new, old, matrix=MATRIX)
    assert (error.field, error.rule) == ("spec", "immutable")
    assert "changed: architecture, dtype" in error.message


def test_artifact_metadata_change_is_not_a_spec_change() -> None:
    old = _artifact()
    new = make_artifact().set("metadata.labels", {"team": "a"}).obj()
    assert validate_modelartifact(new, old, matrix=MATRIX) == []


def test_incompatible_artifact_message_has_field_rule_and_version() -> None:
    [error] = validate_modelartifact(_artifact(dtype="fp8"), None, matrix=MATRIX)
    assert error.field == "spec.dtype"
    assert str(error) == (
        f"spec.dtype: dtype fp8 is not supported by engine >=0.1,<0.2 (supported: ['bfloat16',"
        f" 'float16', 'float32']) (compatibility matrix {V}) [rule: compatibility]"
    )


def test_adapter_with_wrong_base_is_refused() -> None:
    adapter = {
        "name": "sql",
        "uri": "s3://x",
        "sha256": fake_sha256("a"),
        "baseHash": fake_sha256("not-this-base"),
    }
    [error] = validate_modelartifact(_artifact(adapters=[adapter]), None, matrix=MATRIX)
    assert error.field == "spec.adapters[0].baseHash"


def test_pool_without_artifact_is_refused() -> None:
    [error] = validate_servingpool(_pool(), None, artifact=None, matrix=MATRIX)
    assert (error.field, error.rule) == ("spec.artifactRef.name", "reference")
    assert "ModelArtifact 'qwen3-8b' not found in namespace 'default'" in error.message


def test_pool_on_gpu_too_old_for_bf16_is_refused() -> None:
    errors = validate_servingpool(
        _pool(gpu__product="Tesla-T4"), None, artifact=_artifact(), matrix=MATRIX
    )
    assert {e.field for e in errors} == {"spec.gpu.product"}
    assert "needs compute capability 8.0+, sm75 is 7.5" in errors[0].message
    assert f"(compatibility matrix {V})" in errors[0].message


def test_pool_whose_model_and_kv_do_not_fit_is_refused() -> None:
    # 16 GiB - 3 GiB reserved - 14.901 GiB of weights leaves nothing for an 8,192-token sequence.
    pool = _pool(gpu__memory="16Gi")
    [error] = validate_servingpool(pool, None, artifact=_artifact(), matrix=MATRIX)
    assert (error.field, error.rule) == ("spec.gpu", "capacity")
    assert "does not fit on 1× NVIDIA-L4" in error.message
    assert "weights 14.901 GiB" in error.message and "1.125 GiB" in error.message


def test_pool_fit_is_warning_when_parameter_count_is_unknown() -> None:
    artifact = make_artifact().delete("spec.architecture.numParameters").obj()
    [warning] = validate_servingpool(_pool(), None, artifact=artifact, matrix=MATRIX)
    assert warning.severity == "warning" and "unknown params" in warning.message


def test_pool_with_incompatible_artifact_reports_on_the_reference() -> None:
    errors = validate_servingpool(
        _pool(), None, artifact=_artifact(architecture__name="rwkv"), matrix=MATRIX
    )
    assert [e.field for e in errors] == ["spec.artifactRef.name"]
    assert "ModelArtifact qwen3-8b is incompatible: spec.architecture.name" in errors[0].message


def test_quota_tenant_is_immutable_and_borrowing_needs_limits() -> None:
    old = make_quota("team-a").obj()
    new = make_quota("team-a").set("spec.tenant", "team-b").obj()
    [error] = validate_tenantquota(new, old)
    assert (error.field, error.rule) == ("spec.tenant", "immutable")
    borrow = make_quota().set("spec.borrowing", {"resources": ["kvBlocks"], "maxPercent": 50})
    [error] = validate_tenantquota(borrow.obj(), None)
    assert error.field == "spec.borrowing.resources[0]"


def test_rollout_that_could_never_judge_a_step_is_refused() -> None:
    no_slos = make_pool().obj()
    with_slos = make_pool().set("spec.slos", {"ttftP95Seconds": 0.5}).obj()
    rollout = make_rollout().set("spec.analysis.metrics", []).set(
        "spec.analysis.outputAgreement", {"enabled": False}).obj()
    [error] = validate_rollout(rollout, None, pool=no_slos)
    assert error.field == "spec.analysis.metrics"
    assert "pool declares no spec.slos" in error.message
    # The pool's SLOs are enough; or steps without analysis.
    assert validate_rollout(rollout, None, pool=with_slos) == []
    steps = [{"weight": 50, "analysis": False}, {"weight": 100, "analysis": False}]
    assert validate_rollout(rollout.model_copy(update={"spec": rollout.spec.model_copy(
        update={"steps": make_rollout().set("spec.steps", steps).obj().spec.steps})}),
        None, pool=no_slos) == []
    # Answer agreement (on by default) judges a step even without SLOs.
    agreeing = make_rollout().set("spec.analysis.metrics", []).obj()
    assert validate_rollout(agreeing, None, pool=no_slos) == []


def test_rollout_references_and_immutable_refs() -> None:
    errors = validate_rollout(make_rollout().obj(), None, pool=None)
    assert [e.field for e in errors] == ["spec.poolRef.name"]
    old = make_rollout().obj()
    new = make_rollout().set("spec.poolRef.name", "other").obj()
    errors = validate_rollout(new, old, pool=_pool())
    assert [(e.field, e.rule) for e in errors] == [("spec.poolRef", "immutable")]


def _store(*objects: Any) -> Any:
    by_key = {(o.kind, o.metadata.name): o.to_wire() for o in objects}

    async def fetch(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return by_key.get((kind, name))

    return fetch


def _admit(kind: str, new: dict[str, Any], old: dict[str, Any] | None, fetch: Any) -> Decision:
    return asyncio.run(admit(kind, new, old, fetch=fetch, matrix=MATRIX))


def test_admit_resolves_references_through_fetch() -> None:
    fetch = _store(_artifact())
    assert _admit("ServingPool", _pool().to_wire(), None, fetch).allowed
    denied = _admit("ServingPool", _pool().to_wire(), None, _store())
    assert not denied.allowed
    assert denied.message("ServingPool", "default/chat").startswith(
        "ServingPool default/chat is invalid: spec.artifactRef.name: ModelArtifact 'qwen3-8b'"
    )


def test_admit_reports_schema_errors_with_paths() -> None:
    data = make_pool().set("spec.replicas", -3).data()
    [error] = _admit("ServingPool", data, None, _store()).errors
    assert (error.field, error.rule) == ("spec.replicas", "schema")


def test_metadata_only_update_and_deletion_are_admitted_without_references() -> None:
    old = _pool().to_wire()
    new = make_pool().set("metadata.finalizers", ["kvfleet.io/cleanup"]).data()
    assert _admit("ServingPool", new, old, _store()).allowed
    deleting = (
        make_pool()
        .set("spec.replicas", 0)
        .set("metadata.deletionTimestamp", "2026-01-01T00:00:00Z")
        .data()
    )
    assert _admit("ServingPool", deleting, old, _store()).allowed


def test_a_stored_object_a_stricter_schema_refuses_blocks_no_update() -> None:
    """After an upgrade that tightens the schema, the stored pool no longer parses: annotation
    and label patches go through, a spec change that fixes it is validated on its own (with a
    warning), and one that is still invalid is refused for the new object's own fault."""
    stored = make_pool().set("spec.replicas", -1).data()  # what the old schema let in
    annotated = make_pool().set("spec.replicas", -1).set(
        "metadata.annotations", {"kvfleet.io/rollout-request": "{}"}).data()
    assert _admit("ServingPool", annotated, stored, _store(_artifact())).allowed
    fixed = _admit("ServingPool", _pool().to_wire(), stored, _store(_artifact()))
    assert fixed.allowed, fixed.errors
    assert [(w.field, w.rule) for w in fixed.warnings] == [("spec.replicas", "schema")]
    assert "stored ServingPool no longer validates" in fixed.warnings[0].message
    still = make_pool().set("spec.replicas", -2).data()
    [error] = _admit("ServingPool", still, stored, _store(_artifact())).errors
    assert (error.field, error.rule) == ("spec.replicas", "schema")


def test_fetch_failure_propagates() -> None:
    async def broken(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        raise FetchError("connection refused")

    try:
        _admit("ServingPool", _pool().to_wire(), None, broken)
    except FetchError as error:
        assert "connection refused" in str(error)
    else:
        raise AssertionError("FetchError was swallowed")


def test_the_names_kvfleet_uses_itself_are_no_tenants_name() -> None:
    """The router's probes run as `kvfleet-probe`; the engine scopes shared prefix caching as
    `kvfleet-shared` and serves header-less requests as `default`. A TenantQuota claiming one
    would read `cached_tokens` for prompts the probes copied there."""
    from kvfleet.api.tenantquota import RESERVED_TENANTS
    from kvfleet.engine.server import ServerSettings
    from kvfleet.router.probes import PROBE_TENANT

    settings = ServerSettings()
    assert {PROBE_TENANT, settings.shared_prefix_scope, settings.default_tenant} == set(
        RESERVED_TENANTS)
    for name in (*RESERVED_TENANTS, "kvfleet-anything"):
        [error] = validate_tenantquota(make_quota().set("spec.tenant", name).obj(), None)
        assert (error.field, error.rule) == ("spec.tenant", "reserved"), error
        assert "choose another tenant name" in error.message
