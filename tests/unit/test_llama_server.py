"""The llama.cpp yardstick's build (`bench/llama_server.py`): where each ISA level's binary is
cached and what a level this CPU cannot run says. Nothing is built here.

Budget: well under a second.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_modules import load_bench

llama_server = load_bench("llama_server")
AVX512_HOST = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl"}


def test_each_level_has_its_own_cache_folder(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    monkeypatch.setenv(llama_server.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(llama_server, "cpu_flags", lambda: AVX512_HOST)
    native = llama_server.cache_dir()
    avx2 = llama_server.cache_dir("x86_64_v3")
    assert native.parent == avx2.parent == tmp_path
    assert native != avx2 and avx2.name.endswith("x86_64_v3")
    # The native build is keyed by the host's ISA flags: another host's set, another folder.
    monkeypatch.setattr(llama_server, "cpu_flags", lambda: {"avx", "avx2", "fma", "f16c"})
    assert llama_server.cache_dir() != native
    assert llama_server.cache_dir("x86_64_v3") == avx2


def test_the_avx2_level_builds_without_native_or_avx512_code() -> None:
    switches, needs = llama_server.LEVELS["x86_64_v3"]
    assert "-DGGML_NATIVE=OFF" in switches and "-DGGML_AVX512=OFF" in switches
    assert "-DGGML_AVX2=ON" in switches and needs <= AVX512_HOST


def test_a_level_this_cpu_cannot_run_is_refused_by_name(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    monkeypatch.setenv(llama_server.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(llama_server, "cpu_flags", lambda: {"sse4_2", "avx"})
    with pytest.raises(llama_server.BuildUnavailable, match="x86_64_v3 build: it lacks avx2"):
        llama_server.build("x86_64_v3")
    with pytest.raises(llama_server.BuildUnavailable, match="no llama-server level 'v5'"):
        llama_server.build("v5")
    assert not any(tmp_path.iterdir())  # nothing started
