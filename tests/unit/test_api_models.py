"""The four kinds parse what users write, reject what they must not, and speak camelCase."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

import kvfleet.api
from kvfleet.api import DocumentError, load_yaml_documents, parse_object
from kvfleet.api.builders import make_artifact, make_pool, make_quota, make_rollout
from kvfleet.api.documents import error_path
from kvfleet.api.rollout import Rollout, RolloutRequest


def test_public_surface_is_complete() -> None:
    for name in kvfleet.api.__all__:
        assert hasattr(kvfleet.api, name), name


def test_artifact_round_trips_in_camel_case() -> None:
    artifact = make_artifact().obj()
    wire = artifact.to_wire()
    assert wire["spec"]["architecture"]["numKVHeads"] == 8
    assert wire["spec"]["specialTokens"]["eosTokenId"] == 151645
    assert type(artifact).model_validate(wire) == artifact


def test_snake_case_names_are_accepted_in_python() -> None:
    spec = make_artifact().obj().spec
    assert spec.architecture.num_kv_heads == 8
    assert spec.engine_versions.min == "0.1"


def test_unknown_field_is_rejected_with_its_path() -> None:
    with pytest.raises(ValidationError) as info:
        make_pool().set("spec.gpu.prodcut", "NVIDIA-L4").obj()
    assert "spec.gpu.prodcut" in {error_path(tuple(e["loc"])) for e in info.value.errors()}


def test_query_heads_must_be_a_multiple_of_kv_heads() -> None:
    with pytest.raises(ValidationError, match="multiple of numKVHeads"):
        make_artifact().set("spec.architecture.numKVHeads", 5).obj()


def test_bad_digest_is_rejected() -> None:
    with pytest.raises(ValidationError, match="sha256"):
        make_artifact().set("spec.weights.files.0.sha256", "ABC").obj()


def test_pool_defaults_are_filled() -> None:
    pool = make_pool().delete("spec.engine").obj()
    assert pool.spec.engine.block_size == 16
    assert pool.spec.engine.prefix_cache.enabled is True
    assert pool.spec.engine.workspace == "2Gi"
    assert pool.spec.reserves.failover == 0


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([10, 10, 100], "strictly increase"),
        ([50, 20, 100], "strictly increase"),
        ([10, 50], "end at weight 100"),
    ],
)
def test_rollout_weights_increase_and_end_at_100(weights: list[int], message: str) -> None:
    builder = make_rollout().set("spec.steps", [{"weight": w} for w in weights])
    with pytest.raises(ValidationError, match=message) as info:
        builder.obj()
    assert error_path(tuple(info.value.errors()[0]["loc"])) == "spec.steps"


def test_rollout_analysis_defaults_to_the_pools_slos() -> None:
    rollout = make_rollout().delete("spec.analysis").obj()
    assert rollout.spec.analysis.metrics == []
    assert rollout.spec.analysis.interval_seconds == 30


def test_rollout_metric_is_a_slo_or_a_query_with_a_threshold() -> None:
    assert make_rollout().obj().spec.analysis.metrics[0].slo == "TTFTP95"
    rules = [r["rule"] for r in Rollout.model_json_schema()["$defs"]["Metric"][
        "x-kubernetes-validations"]]
    assert rules == ["has(self.slo) != has(self.query)", "has(self.slo) || has(self.threshold)"]


def test_rollout_request_parses_and_names_the_annotation() -> None:
    request = RolloutRequest.parse('{"action": "promote", "id": "a1", "step": 2}')
    assert (request.action, request.step) == ("promote", 2)
    assert RolloutRequest.parse(request.to_annotation()) == request
    with pytest.raises(ValueError, match=r"kvfleet\.io/rollout-request is not a rollout request"):
        RolloutRequest.parse('{"action": "skip-ahead", "id": "a1"}')


def test_quota_is_parsed_by_kind() -> None:
    obj = parse_object(make_quota("team-b").data())
    assert obj.kind == "TenantQuota"
    assert obj.spec.tenant == "team-b"


def test_unknown_kind_names_the_kinds() -> None:
    with pytest.raises(DocumentError, match="ModelArtifact, ServingPool, TenantQuota, Rollout"):
        parse_object({"apiVersion": "v1", "kind": "ConfigMap"}, "x.yaml")


def test_invalid_object_error_names_file_and_field() -> None:
    with pytest.raises(DocumentError, match=r"pool.yaml: invalid ServingPool:\n  spec.replicas"):
        parse_object(make_pool().set("spec.replicas", -1).data(), "pool.yaml")


def test_yaml_numbers_follow_yaml_1_2() -> None:
    # PyYAML alone reads 1e0 as a string; the apiserver reads it as a number.
    [doc] = load_yaml_documents("a: 1e0\nb: 12\nc: .5\nd: '1e0'\ne: -.inf\n")
    assert doc == {"a": 1.0, "b": 12, "c": 0.5, "d": "1e0", "e": float("-inf")}
    assert isinstance(doc["b"], int)


def test_non_mapping_document_is_an_error() -> None:
    with pytest.raises(DocumentError, match="document 0 is not a mapping"):
        load_yaml_documents("- a\n- b\n", "list.yaml")
