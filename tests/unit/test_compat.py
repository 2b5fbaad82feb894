"""The compatibility checker: each rule rejects what it should, names the field and the version."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.api import ModelArtifactSpec, ServingPoolSpec, base_hash
from kvfleet.api.builders import fake_sha256, make_artifact, make_pool
from kvfleet.compat import (
    DriverInfo,
    MatrixError,
    check,
    default_matrix,
    load_matrix,
    matrix_from_dict,
    minimum_cuda_and_driver,
)
from kvfleet.compat.matrix import DEFAULT_MATRIX_PATH

MATRIX = default_matrix()


def _artifact(**changes: Any) -> ModelArtifactSpec:
    builder = make_artifact()
    for path, value in changes.items():
        builder.set("spec." + path.replace("__", "."), value)
    return builder.obj().spec


def _pool(**changes: Any) -> ServingPoolSpec:
    builder = make_pool()
    for path, value in changes.items():
        builder.set("spec." + path.replace("__", "."), value)
    return builder.obj().spec


def _fields(found: list[Any]) -> list[str]:
    return [f"{i.kind} {i.field}" for i in found]


def test_good_artifact_on_l4_is_compatible() -> None:
    assert check(_artifact(), _pool(), engine_version="0.1.0") == []


def test_bf16_on_t4_is_rejected_with_compute_capability_and_version() -> None:
    found, kv = check(_artifact(), _pool(gpu__product="Tesla-T4"), engine_version="0.1.0")
    assert (found.kind, found.field) == ("ServingPool", "spec.gpu.product")
    assert "dtype bfloat16 needs compute capability 8.0+, sm75 is 7.5" in found.reason
    assert "the artifact's spec.dtype" in found.reason
    # kvCacheDtype auto follows the model dtype, so the KV cache is bf16 too.
    assert "kvCacheDtype bfloat16 needs compute capability 8.0+" in kv.reason
    assert found.matrix_version == MATRIX.version
    assert str(found).endswith(f"(compatibility matrix {MATRIX.version})")


def test_float16_runs_on_v100() -> None:
    spec = _artifact(dtype="float16")
    assert check(spec, _pool(gpu__product="Tesla-V100-SXM2-16GB"), engine_version="0.1") == []


def test_fp8_kv_cache_needs_sm89_and_engine_support() -> None:
    found = check(
        _artifact(),
        _pool(gpu__product="NVIDIA-A100-SXM4-80GB", engine__kvCacheDtype="fp8"),
        engine_version="0.1",
    )
    reasons = " | ".join(i.reason for i in found)
    assert "fp8 needs compute capability 8.9+, sm80 is 8.0" in reasons
    assert "KV cache dtype fp8 is not supported by engine >=0.1,<0.2" in reasons


def test_unsupported_architecture_dtype_and_quantization() -> None:
    spec = _artifact(
        architecture__name="mamba",
        dtype="fp8",
        quantization={"method": "awq", "bits": 4, "groupSize": 128},
    )
    assert _fields(check(spec, engine_version="0.1")) == [
        "ModelArtifact spec.architecture.name",
        "ModelArtifact spec.dtype",
        "ModelArtifact spec.quantization.method",
    ]


def test_engine_version_range_is_enforced() -> None:
    [found] = check(_artifact(engineVersions={"min": "0.2"}), engine_version="0.1.0")
    assert found.field == "spec.engineVersions"
    assert "requires engine >=0.2 but the fleet runs 0.1.0" in found.reason
    [found] = check(_artifact(), engine_version="9.0")
    assert "engine 9.0 has no matrix row" in found.reason


def test_unknown_gpu_product_lists_known_ones() -> None:
    [found] = check(_artifact(), _pool(gpu__product="NVIDIA-GTX-1080"), engine_version="0.1")
    assert "unknown GPU product 'NVIDIA-GTX-1080'" in found.reason
    assert "NVIDIA-L4" in found.reason


def test_tensor_parallel_limit_and_head_split() -> None:
    found = check(_artifact(), _pool(gpu__count=3), engine_version="0.1")
    reasons = " | ".join(i.reason for i in found)
    assert "tensor parallelism limit of 1" in reasons
    assert "32 query heads do not split evenly over 3 GPUs" in reasons


def test_max_model_length_beyond_context_is_rejected() -> None:
    [found] = check(_artifact(), _pool(engine__maxModelLength=65536), engine_version="0.1")
    assert found.field == "spec.engine.maxModelLength"


def test_artifact_qualified_architectures() -> None:
    [found] = check(_artifact(gpuArchitectures=["sm75"]), engine_version="0.1")
    assert found.field == "spec.gpuArchitectures[0]"
    assert "bfloat16 needs compute capability 8.0+" in found.reason
    [found] = check(_artifact(gpuArchitectures=["sm90"]), _pool(), engine_version="0.1")
    assert "qualified only on ['sm90']" in found.reason


def test_smollm2_tokenizer_and_template_hashes_are_checked() -> None:
    family = MATRIX.model_families["smollm2"]
    good = _artifact(
        family="smollm2",
        tokenizer={"type": "gpt2", "sha256": next(iter(family.tokenizer_sha256))},
        chatTemplate={"sha256": next(iter(family.chat_template_sha256))},
    )
    assert check(good, engine_version="0.1") == []
    bad = _artifact(family="smollm2")
    assert _fields(check(bad, engine_version="0.1")) == [
        "ModelArtifact spec.tokenizer.sha256",
        "ModelArtifact spec.chatTemplate.sha256",
    ]


def test_adapter_base_hash_must_match_this_artifact() -> None:
    spec = _artifact()
    adapter = {
        "name": "sql",
        "uri": "s3://a/sql",
        "sha256": fake_sha256("sql"),
        "baseHash": base_hash(spec),
    }
    assert check(_artifact(adapters=[adapter]), engine_version="0.1") == []
    wrong = {**adapter, "baseHash": fake_sha256("other-base")}
    [found] = check(_artifact(adapters=[wrong]), engine_version="0.1")
    assert found.field == "spec.adapters[0].baseHash"
    assert "was trained on base" in found.reason


def test_matrix_adapter_row_overrides_a_self_declared_base() -> None:
    spec = _artifact()
    data = yaml.safe_load(DEFAULT_MATRIX_PATH.read_text())
    data["adapters"] = [{"sha256": fake_sha256("sql"), "baseHash": fake_sha256("real-base")}]
    matrix = matrix_from_dict(data)
    adapter = {
        "name": "sql",
        "uri": "s3://a/sql",
        "sha256": fake_sha256("sql"),
        "baseHash": base_hash(spec),
    }
    [found] = check(_artifact(adapters=[adapter]), matrix=matrix, engine_version="0.1")
    assert "matrix records adapter sql" in found.reason


def test_driver_minimums_are_the_newest_requirement() -> None:
    fp8 = _artifact(dtype="float16")
    pool = _pool(gpu__product="NVIDIA-B200")
    assert minimum_cuda_and_driver(MATRIX, fp8, pool, "0.1") == ("12.8", "570.26")
    found = check(
        fp8,
        pool,
        engine_version="0.1",
        driver=DriverInfo(driver_version="550.54.15", cuda_version="12.4"),
    )
    assert [i.reason for i in found] == [
        "node CUDA 12.4 is older than the required 12.8",
        "node driver 550.54.15 is older than the required 570.26",
    ]


def test_checked_in_matrix_validates_and_covers_the_gpus() -> None:
    matrix = load_matrix(DEFAULT_MATRIX_PATH)
    capability = {a.name: a.compute_capability for a in matrix.gpu_architectures.values()}
    product_cc = {
        p: capability[matrix.gpu_products[p].architecture]
        for p in (
            "Tesla-V100-SXM2-16GB",
            "Tesla-T4",
            "NVIDIA-A100-SXM4-80GB",
            "NVIDIA-A10",
            "NVIDIA-L4",
            "NVIDIA-L40S",
            "NVIDIA-H100-80GB-HBM3",
            "NVIDIA-H200",
            "NVIDIA-B200",
        )
    }
    assert product_cc == {
        "Tesla-V100-SXM2-16GB": "7.0",
        "Tesla-T4": "7.5",
        "NVIDIA-A100-SXM4-80GB": "8.0",
        "NVIDIA-A10": "8.6",
        "NVIDIA-L4": "8.9",
        "NVIDIA-L40S": "8.9",
        "NVIDIA-H100-80GB-HBM3": "9.0",
        "NVIDIA-H200": "9.0",
        "NVIDIA-B200": "10.0",
    }
    assert matrix.gpu_products["NVIDIA-L4"].memory_bytes == 24 * 1024**3


def test_schema_violation_names_the_path(tmp_path: Path) -> None:
    data = yaml.safe_load(DEFAULT_MATRIX_PATH.read_text())
    broken = copy.deepcopy(data)
    broken["gpuArchitectures"][0]["computeCapability"] = "seven"
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(broken))
    with pytest.raises(MatrixError, match=r"gpuArchitectures/0/computeCapability: 'seven'"):
        load_matrix(path)


def test_product_with_unlisted_architecture_is_rejected() -> None:
    data = yaml.safe_load(DEFAULT_MATRIX_PATH.read_text())
    data["gpuProducts"].append({"label": "X", "architecture": "sm120", "memory": "32Gi"})
    with pytest.raises(MatrixError, match="architecture sm120 is not listed"):
        matrix_from_dict(data, "m.yaml")


def test_missing_matrix_file_says_how_to_point_at_one(tmp_path: Path) -> None:
    with pytest.raises(MatrixError, match="KVFLEET_COMPAT_MATRIX"):
        load_matrix(tmp_path / "nope.yaml")
