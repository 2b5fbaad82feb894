"""The pure ModelArtifact reconciler: manifest hash, Verified and Compatible."""

from __future__ import annotations

from typing import Any

from operator_fakes import NOW

from kvfleet.api import ModelArtifact, base_hash, manifest_hash
from kvfleet.api.builders import fake_sha256, make_artifact
from kvfleet.compat import default_matrix
from kvfleet.operator.modelartifact import reconcile_artifact

MATRIX = default_matrix()


def _cond(status: dict[str, Any], cond_type: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == cond_type)


def test_good_artifact_gets_its_hash_and_is_ready() -> None:
    artifact = make_artifact().set("metadata.generation", 1).obj()
    status = reconcile_artifact(artifact, matrix=MATRIX, now=NOW)
    assert status["manifestHash"] == manifest_hash(artifact.spec)
    assert status["matrixVersion"] == MATRIX.version
    assert _cond(status, "Verified")["status"] == "True"
    assert status["manifestHash"] in _cond(status, "Verified")["message"]
    assert _cond(status, "Compatible")["status"] == "True"
    assert _cond(status, "Ready")["status"] == "True"
    ModelArtifact.model_validate({**artifact.to_wire(), "status": status})


def test_unsupported_architecture_is_incompatible_with_the_field() -> None:
    artifact = make_artifact().set("spec.architecture.name", "mamba").obj()
    status = reconcile_artifact(artifact, matrix=MATRIX, now=NOW)
    compatible = _cond(status, "Compatible")
    assert (compatible["status"], compatible["reason"]) == ("False", "Incompatible")
    assert "spec.architecture.name" in compatible["message"]
    assert _cond(status, "Ready")["reason"] == "Incompatible"


def test_adapter_for_another_base_is_not_verified() -> None:
    artifact = (
        make_artifact()
        .set(
            "spec.adapters",
            [
                {
                    "name": "sql",
                    "uri": "s3://a/sql.safetensors",
                    "sha256": fake_sha256("sql"),
                    "baseHash": fake_sha256("other-base"),
                }
            ],
        )
        .obj()
    )
    status = reconcile_artifact(artifact, matrix=MATRIX, now=NOW)
    verified = _cond(status, "Verified")
    assert (verified["status"], verified["reason"]) == ("False", "AdapterBaseMismatch")
    assert "spec.adapters[0].baseHash" in verified["message"]
    assert base_hash(artifact.spec)[:12] in verified["message"]


def test_duplicate_weight_file_is_not_verified() -> None:
    builder = make_artifact()
    files = builder.data()["spec"]["weights"]["files"]
    artifact = builder.set("spec.weights.files", [*files, files[0]]).obj()
    verified = _cond(reconcile_artifact(artifact, matrix=MATRIX, now=NOW), "Verified")
    assert verified["reason"] == "DuplicateFile"
    assert "spec.weights.files[5].uri" in verified["message"]
