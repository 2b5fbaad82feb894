"""A real `kvfleet serve` refuses weights that differ from the manifest, and reports the
manifest hash as its revision when they match (what the operator passes to every pod)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import httpx
import pytest
from engine_server import free_port, running_server

from kvfleet.engine.model.loader import default_model_path, file_sha256

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_digest_mismatch_exits_non_zero_and_says_why() -> None:
    wrong = hashlib.sha256(b"another file").hexdigest()
    env = {**os.environ, "KVFLEET_EXPECTED_SHA256": wrong}
    result = subprocess.run(
        [sys.executable, "-m", "kvfleet", "serve", "--port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 1
    last = (result.stdout + result.stderr).strip().splitlines()[-1]
    assert "does not match the manifest" in last and wrong in last
    assert default_model_path().name in last


def test_matching_weights_serve_under_the_manifest_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    manifest_hash = "f" * 64
    monkeypatch.setenv("KVFLEET_EXPECTED_SHA256", file_sha256(default_model_path()))
    monkeypatch.setenv("KVFLEET_MANIFEST_HASH", manifest_hash)
    with running_server() as server:
        model = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "Hi", "max_tokens": 2}).json()
    assert body["system_fingerprint"] == manifest_hash
