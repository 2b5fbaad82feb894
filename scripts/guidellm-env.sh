#!/usr/bin/env bash
# guidellm, the vLLM project's benchmark client, in .venv-guidellm: the neutral client of the
# llama.cpp comparison (bench/vs_llama_cpp.py) and of tests/integration/test_guidellm.py.
#
# Its own environment, because its pins differ from ours (click 8.4, and uvloop, which
# uvicorn would then pick for every kvfleet server). It is layered on .venv (a .pth line), so
# torch and transformers are not installed twice: pip installs only what .venv lacks or pins
# differently, and those copies shadow .venv's for guidellm alone. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.8.1
env=.venv-guidellm
stamp=$env/.installed-$VERSION
[ -f "$stamp" ] && exit 0
[ -x .venv/bin/python ] || { echo "guidellm-env: run scripts/bootstrap.sh first (.venv)" >&2; exit 1; }
echo "guidellm-env: installing guidellm $VERSION into $env (layered on .venv)"
rm -rf "$env"
.venv/bin/python -m venv "$env"
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
purelib .venv/bin/python > "$(purelib "$env/bin/python")/kvfleet-base.pth"
"$env/bin/pip" install --progress-bar off --quiet "guidellm==$VERSION"
"$env/bin/guidellm" --version
touch "$stamp"
