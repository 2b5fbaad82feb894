"""The engine refuses weights whose sha256 differs from the ModelArtifact manifest."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import pytest

from kvfleet.commands.serve import _sha256_list
from kvfleet.engine.errors import ModelVerificationError
from kvfleet.engine.model.verify import verify_weights


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def test_a_file_with_the_manifest_digest_passes(tmp_path: Path) -> None:
    digest = _write(tmp_path / "m.gguf", b"weights")
    verify_weights(tmp_path / "m.gguf", (digest,))
    verify_weights(tmp_path / "m.gguf", ())  # no manifest: nothing to check


def test_a_file_with_another_digest_is_refused_naming_file_and_both_digests(
    tmp_path: Path,
) -> None:
    actual = _write(tmp_path / "m.gguf", b"tampered")
    expected = hashlib.sha256(b"weights").hexdigest()
    with pytest.raises(ModelVerificationError) as info:
        verify_weights(tmp_path / "m.gguf", (expected,))
    message = str(info.value)
    assert "m.gguf" in message and actual in message and expected in message
    assert "ModelArtifact" in message


def test_a_directory_must_hold_exactly_the_manifest_files(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.safetensors", b"a")
    b = _write(tmp_path / "b.safetensors", b"b")
    (tmp_path / "config.json").write_text("{}")  # not a weight file: need not be listed
    verify_weights(tmp_path, (b, a))  # order-free
    with pytest.raises(ModelVerificationError, match="no file has"):
        verify_weights(tmp_path, (a, b, hashlib.sha256(b"c").hexdigest()))
    with pytest.raises(ModelVerificationError, match=r"b\.safetensors has sha256"):
        verify_weights(tmp_path, (a,))


def test_the_cli_flag_takes_comma_separated_hex_digests() -> None:
    digest = "AB" * 32
    assert _sha256_list(f"{digest}, {digest.lower()}") == (digest.lower(), digest.lower())
    assert _sha256_list("") == ()
    with pytest.raises(argparse.ArgumentTypeError, match="64 hex"):
        _sha256_list("not-a-digest")


def test_a_listed_config_file_is_checked_too(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.safetensors", b"a")
    config = _write(tmp_path / "config.json", b"{}")
    verify_weights(tmp_path, (a, config))
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 1}')
    with pytest.raises(ModelVerificationError, match=f"no file has the manifest's sha256 {config}"):
        verify_weights(tmp_path, (a, config))


def test_a_tokenizer_or_template_other_than_the_manifests_is_refused(tmp_path: Path) -> None:
    from tiny_llama import random_weights, tiny_config, write_gguf

    from kvfleet.engine.model.loader import load_model
    from kvfleet.engine.model.verify import verify_manifest

    config = tiny_config()
    loaded = load_model(write_gguf(tmp_path / "t.gguf", config, random_weights(config)),
                        show_progress=False)
    assert loaded.tokenizer_sha256 is not None and loaded.chat_template_sha256 is not None
    verify_manifest(loaded, tokenizer_sha256=loaded.tokenizer_sha256,
                    chat_template_sha256=loaded.chat_template_sha256)
    verify_manifest(loaded, tokenizer_sha256=None, chat_template_sha256=None)
    other = "9" * 64
    with pytest.raises(ModelVerificationError, match=f"tokenizer sha256 {loaded.tokenizer_sha256} "
                                                     f"does not match the manifest's {other}"):
        verify_manifest(loaded, tokenizer_sha256=other, chat_template_sha256=None)
    with pytest.raises(ModelVerificationError, match=r"chat template sha256 .* does not match"):
        verify_manifest(loaded, tokenizer_sha256=None, chat_template_sha256=other)
