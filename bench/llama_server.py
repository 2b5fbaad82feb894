"""llama.cpp's own server (`llama-server`), built once from the llama.cpp sources that the
`llama-cpp-python` sdist on PyPI vendors: the yardstick of `bench/vs_llama_cpp.py`.

    .venv/bin/python bench/llama_server.py            # build (or find) it, print its path
    .venv/bin/python bench/llama_server.py --level x86_64_v3   # the AVX2 build (see LEVELS)

The build is cached outside the checkout, keyed by the sdist's version and this CPU's ISA
flags (`-DGGML_NATIVE=ON` compiles for the host) or the level's name, under
`$KVFLEET_LLAMA_CPP_CACHE` or `~/.cache/kvfleet/llama.cpp`. It needs cmake, ninja and a C++
compiler (Debian: `apt-get install cmake ninja-build g++`); without them `BuildUnavailable`
says what is missing, and the benchmark skips llama.cpp with that message. Cold: 7-12 minutes
on 2 cores (413-748 s measured), with progress.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

# The sdist pinned here vendors llama.cpp's sources at the commit that release was made from.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CACHE_ENV = "KVFLEET_LLAMA_CPP_CACHE"
# The ISA extensions ggml's native build dispatches on: two hosts with the same set get the
# same binary, a host with other extensions gets its own.
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx_vnni", "amx_tile")


# The instruction-set levels llama-server is built for: the host's own, or x86-64-v3 (AVX2, FMA,
# F16C, BMI2, no AVX-512), which an AVX-512 host runs as well: beside kvfleet's x86_64_v3
# kernels (`KVFLEET_CPU_TARGET`), one host measures both engines at the AVX2 level. Each level:
# its cmake switches and the CPU flags it needs.
LEVELS: dict[str, tuple[list[str], set[str]]] = {
    "native": (["-DGGML_NATIVE=ON"], set()),
    "x86_64_v3": (["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
                   "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF",
                   "-DGGML_AVX_VNNI=OFF"],
                  {"avx", "avx2", "fma", "f16c", "bmi2"}),
}


class BuildUnavailable(Exception):
    """llama-server cannot be built on this machine; the message says why and what to do."""


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cache_dir(level: str = "native") -> Path:
    root = os.environ.get(CACHE_ENV)
    base = Path(root) if root else Path.home() / ".cache" / "kvfleet" / "llama.cpp"
    if level != "native":  # fixed flags: the same binary on every host that runs the level
        return base / f"{LLAMA_CPP_PYTHON_VERSION}-{level}"
    isa = ",".join(f for f in ISA_FLAGS if f in cpu_flags())
    digest = hashlib.sha256(isa.encode()).hexdigest()[:10]
    return base / f"{LLAMA_CPP_PYTHON_VERSION}-{digest}"


def _say(msg: str) -> None:
    print(f"[llama.cpp] {msg}", flush=True)


def _run(cmd: list[str], log: Path, cwd: Path, what: str) -> None:
    """Runs a build step with its output in `log`, printing progress every 30 s."""
    start = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        while True:
            try:
                proc.wait(30)
                break
            except subprocess.TimeoutExpired:
                last = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
                _say(f"{what}: {time.monotonic() - start:.0f} s, {last[0][:100]}")
    if proc.returncode != 0:
        raise BuildUnavailable(f"{what} failed (exit {proc.returncode}); see {log}")


def build(level: str = "native") -> Path:
    """The cached llama-server binary for `level` (a key of LEVELS), built first if absent."""
    if level not in LEVELS:
        raise BuildUnavailable(f"no llama-server level {level!r}; use one of {', '.join(LEVELS)}")
    switches, needs = LEVELS[level]
    lacking = sorted(needs - cpu_flags())
    if lacking:
        raise BuildUnavailable(f"this CPU cannot run llama-server's {level} build: it lacks "
                               f"{', '.join(lacking)}")
    folder = cache_dir(level)
    binary = folder / "llama-server"
    if binary.is_file():
        return binary
    missing = [tool for tool in ("cmake", "ninja", "c++") if shutil.which(tool) is None]
    if missing:
        raise BuildUnavailable(f"cannot build llama-server: {', '.join(missing)} not on PATH "
                               "(Debian: apt-get install cmake ninja-build g++)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    # The log sits beside the cache folder, so a failed build's reason outlives its sources.
    log = folder.parent / f"{folder.name}.build.log"
    log.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-cpp-build-", dir=folder.parent) as tmp:
        work = Path(tmp)
        _say(f"building llama-server ({level}) from llama-cpp-python "
             f"{LLAMA_CPP_PYTHON_VERSION}'s vendored llama.cpp into {folder} (log {log}; "
             "~7-12 min on 2 cores)")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              "--quiet", "-d", str(work), f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
             log, work, "pip download of the sdist")
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        src = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build_dir = work / "build"
        _run(["cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja",
              "-DCMAKE_BUILD_TYPE=Release", *switches, "-DBUILD_SHARED_LIBS=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF",
              # No web UI: the prebuilt one is a download this machine cannot make.
              "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"],
             log, work, "cmake configure")
        _run(["ninja", "-C", str(build_dir), "llama-server"], log, work, "ninja llama-server")
        built = build_dir / "bin" / "llama-server"
        staging = work / "out"
        staging.mkdir()
        shutil.copy2(built, staging / "llama-server")
        shutil.copy2(log, staging / "build.log")
        # A rename: a half-built folder never looks cached.
        staging.rename(folder)
    _say(f"built {binary} in {time.monotonic() - start:.0f} s")
    return binary


def server_argv(binary: Path, gguf: Path, threads: int, parallel: int, ctx_per_slot: int
                ) -> list[str]:
    """llama-server on `gguf` with `threads` threads and `parallel` slots of `ctx_per_slot`
    tokens each, continuous batching on; the port is appended by the caller."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1",
            "--threads", str(threads), "--threads-batch", str(threads),
            "--parallel", str(parallel), "--ctx-size", str(parallel * ctx_per_slot),
            "--cont-batching", "--no-webui", "--log-disable"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--level", choices=sorted(LEVELS), default="native")
    try:
        print(build(parser.parse_args().level))
    except BuildUnavailable as exc:
        print(f"[llama.cpp] {exc}", file=sys.stderr)
        sys.exit(1)
