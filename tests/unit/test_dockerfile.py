"""The Dockerfile is linted here, since this machine has no Docker engine to build it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def test_image_ships_the_compat_matrix_and_serves_by_default() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "KVFLEET_COMPAT_MATRIX=/opt/kvfleet/compat_matrix/matrix.yaml" in text
    assert 'ENTRYPOINT ["kvfleet"]' in text


def test_image_prebuilds_every_kernel_for_every_level_before_dropping_root() -> None:
    from kvfleet.engine import native

    text = (ROOT / "Dockerfile").read_text()
    assert f"ENV {native.CACHE_ENV}=/opt/kvfleet/kernels" in text
    build = text.index("RUN kvfleet kernels build --all-targets")
    assert build < text.index("USER 10001")  # the folder stays read-only to the engine
    assert text.index(f"ENV {native.CACHE_ENV}") < build
