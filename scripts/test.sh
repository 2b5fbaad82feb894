#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, static checks, then unit, integration and
# end-to-end tests (the e2e tier builds or reuses the cached Kubernetes binaries).
#
# A cold machine spends ~23 min compiling the Go tools on a slow 2-core host, and the unit and
# integration tiers need none of them: the tools build in the background, at the idle
# scheduling class, while those tiers run, and the e2e tier waits for them. Tests that run a
# tool (helm, promtool, argocd) are marked `tools` and run after the wait.
#
# `scripts/test.sh ARGS...` runs only `pytest ARGS...` after the same set-up.
# At the end it prints each tier's time and the 15 slowest tests (scripts/suite_report.py).
set -euo pipefail
cd "$(dirname "$0")/.."
suite_started=$SECONDS
reports=$(mktemp -d "${TMPDIR:-/tmp}/kvfleet-suite.XXXXXX")
tiers=$reports/tiers.tsv
tools_pid=""
cleanup() {
  [ -z "$tools_pid" ] || kill -- "-$tools_pid" 2>/dev/null || true
  rm -rf "$reports"
}
trap cleanup EXIT

# tier NAME COMMAND...: runs it, records its wall time and exit code, never stops the script.
failed=0
tier() {
  local name=$1 started=$SECONDS rc=0
  shift
  echo "== $name"
  "$@" || rc=$?
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - started))" "$rc" >> "$tiers"
  [ "$rc" = 0 ] || { echo "== $name failed (exit $rc)"; failed=1; }
}

tier bootstrap scripts/bootstrap.sh
[ "$failed" = 0 ] || exit 1  # (without .venv nothing below can run)
export PATH="$PWD/.venv/bin:$PATH"

echo "== redis-server (Argo CD's cache in the GitOps e2e test; the router's shared quota ledger), from Debian's packages"
if ! command -v redis-server >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y --no-install-recommends redis-server \
    || { $sudo apt-get update && $sudo apt-get install -y --no-install-recommends redis-server; }
fi

# With KUBECONFIG set the e2e tier runs on that cluster and nothing is built.
tools_log=$reports/tools.log
if [ -z "${KUBECONFIG:-}" ]; then
  echo "== e2e tools (Kubernetes, etcd, KWOK, helm, Prometheus, Argo CD): building or found cached in the background (log shown before the e2e tier)"
  idle=(); command -v chrt >/dev/null && idle=(chrt --idle 0)
  # setsid: its own process group, so an interrupted suite stops the Go compilers too. The
  # build's own time is how long it ran until it wrote $reports/tools.seconds.
  setsid "${idle[@]}" bash -c 'started=$(date +%s); e2e/tools/build.sh; rc=$?
    echo $(( $(date +%s) - started )) > "$1"; exit $rc' _ "$reports/tools.seconds" \
    > "$tools_log" 2>&1 &
  tools_pid=$!
  # From here a test whose binary is missing fails instead of skipping.
  export KVFLEET_E2E_REQUIRED=1
fi

tier guidellm scripts/guidellm-env.sh
tier kernels kvfleet kernels build
tier ruff ruff check kvfleet tests e2e bench
tier mypy mypy
tier import-linter lint-imports

pytest_tier() {
  local name=$1
  shift
  tier "$name" pytest --junitxml="$reports/$name.xml" "$@"
}

wait_for_tools() {
  [ -n "$tools_pid" ] || return 0
  local waited=$SECONDS rc=0
  wait "$tools_pid" || rc=$?
  tools_pid=""
  cat "$tools_log"
  echo "== e2e tools: built or found in $(cat "$reports/tools.seconds" 2>/dev/null || echo '?') s in the background; the suite waited $((SECONDS - waited)) s for them"
  printf '%s\t%s\t%s\n' "tools (waited)" "$((SECONDS - waited))" "$rc" >> "$tiers"
  [ "$rc" = 0 ] || { echo "== e2e tools failed (exit $rc)"; failed=1; }
}

if [ $# -gt 0 ]; then
  wait_for_tools
  pytest_tier pytest "$@"
else
  pytest_tier unit tests/unit -m "not tools"
  pytest_tier integration tests/integration -m "not tools"
  wait_for_tools
  pytest_tier tools tests -m tools
  pytest_tier e2e e2e
fi

printf '%s\t%s\t%s\n' "whole suite" "$((SECONDS - suite_started))" "$failed" >> "$tiers"
.venv/bin/python scripts/suite_report.py "$tiers" "$reports"/*.xml || true
exit "$failed"
