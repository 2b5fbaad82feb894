"""crds/ is generated from kvfleet.api, structurally valid, and never hand-edited."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.api.crdgen import RESOURCES, build_crd, render_crds, stale_crds, structural_problems

CRD_DIR = Path(__file__).resolve().parents[2] / "crds"


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_checked_in_crds_match_the_models() -> None:
    stale = stale_crds(CRD_DIR)
    assert stale == [], f"regenerate with `kvfleet crds generate`: stale {stale}"


def test_stale_file_is_detected(tmp_path: Path) -> None:
    for name, text in render_crds().items():
        (tmp_path / name).write_text(text)
    name = next(iter(render_crds()))
    (tmp_path / name).write_text((tmp_path / name).read_text() + "# edited\n")
    (tmp_path / "kvfleet.io_leftovers.yaml").write_text("{}")
    assert stale_crds(tmp_path) == [name, "kvfleet.io_leftovers.yaml"]


@pytest.mark.parametrize("resource", RESOURCES, ids=lambda r: r.__name__)
def test_crd_is_structural_and_documented(resource: type[Any]) -> None:
    crd = build_crd(resource)
    assert structural_problems(_schema(crd)) == []
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["additionalPrinterColumns"]
    assert crd["spec"]["names"]["shortNames"]
    assert crd["spec"]["names"]["categories"] == ["kvfleet"]


def test_structural_checker_catches_refs_and_missing_descriptions() -> None:
    bad = {
        "type": "object",
        "properties": {"spec": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}},
    }
    bad["properties"]["metadata"] = {"type": "object", "description": "meta"}
    problems = structural_problems(bad)
    assert ".metadata: must be exactly {type: object} (the apiserver owns it)" in problems
    assert ".spec.a: uses $ref" in problems
    assert ".spec.a: no type" in problems
    assert ".spec.a: no description" in problems


def test_crd_yaml_parses_back_identically() -> None:
    for resource in RESOURCES:
        text = render_crds()[f"kvfleet.io_{resource.crd.plural}.yaml"]
        assert yaml.safe_load(text) == build_crd(resource)


def test_artifact_spec_is_immutable_by_cel() -> None:
    spec = _schema(build_crd(RESOURCES[0]))["properties"]["spec"]
    assert {
        "rule": "self == oldSelf",
        "message": "spec is immutable; create a new ModelArtifact instead",
    } in spec["x-kubernetes-validations"]


def test_rollout_weights_rule_and_bounds() -> None:
    spec = _schema(build_crd(RESOURCES[3]))["properties"]["spec"]
    rules = {v["message"]: v["rule"] for v in spec["x-kubernetes-validations"]}
    assert "isSorted()" in rules["canary step weights must strictly increase"]
    assert "== 100" in rules["canary steps must end at weight 100"]
    # CEL cost estimation needs bounded lists.
    assert spec["properties"]["steps"]["maxItems"] == 20
    weight = spec["properties"]["steps"]["items"]["properties"]["weight"]
    assert (weight["minimum"], weight["maximum"]) == (1, 100)  # weight 0 is no step


def test_defaults_enums_and_exclusive_bounds_are_openapi_v3() -> None:
    pool = _schema(build_crd(RESOURCES[1]))["properties"]["spec"]["properties"]
    engine = pool["engine"]
    assert engine["default"] == {}
    assert engine["properties"]["blockSize"] == {
        "type": "integer",
        "description": "Tokens per KV block.",
        "default": 16,
        "enum": [8, 16, 32],
    }
    assert engine["properties"]["kvCacheDtype"]["enum"] == ["auto", "float16", "bfloat16", "fp8"]
    ttft = pool["slos"]["properties"]["ttftP95Seconds"]
    assert ttft["exclusiveMinimum"] is True and ttft["minimum"] == 0


def test_conditions_are_a_list_map_by_type() -> None:
    for resource in RESOURCES:
        status = _schema(build_crd(resource))["properties"]["status"]
        conditions = status["properties"]["conditions"]
        assert conditions["x-kubernetes-list-type"] == "map"
        assert conditions["x-kubernetes-list-map-keys"] == ["type"]
        item = conditions["items"]
        assert set(item["required"]) == {"type", "status", "reason", "lastTransitionTime"}
        assert item["properties"]["lastTransitionTime"]["format"] == "date-time"


# Short names clusters already have: Kubernetes' own (kubectl api-resources on v1.34) and
# the CRDs a serving fleet commonly runs beside kvfleet (Argo CD, Argo Rollouts, KServe,
# Prometheus Operator, cert-manager). kubectl warns on every ambiguous one.
TAKEN_SHORT_NAMES = {
    "cs", "cm", "ep", "ev", "limits", "ns", "no", "pvc", "pv", "po", "rc", "quota", "sa", "svc",
    "crd", "crds", "ds", "deploy", "rs", "sts", "hpa", "cj", "csr", "ing", "netpol", "pdb", "pc",
    "sc", "app", "apps", "appproj", "appprojects", "appset", "appsets", "ro", "ar", "at",
    "isvc", "prom", "smon", "pmon", "am", "cert", "certs", "cr", "crs",
}


def test_no_short_name_is_ambiguous_with_what_clusters_already_have() -> None:
    names = [n for r in RESOURCES for n in r.crd.short_names]
    assert len(names) == len(set(names))
    assert not set(names) & TAKEN_SHORT_NAMES, sorted(set(names) & TAKEN_SHORT_NAMES)
