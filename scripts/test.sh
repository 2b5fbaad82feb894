#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, static checks, then unit, integration and
# end-to-end tests (the e2e tier builds or reuses the cached Kubernetes binaries).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff"; ruff check kvfleet tests e2e bench
echo "== mypy"; mypy
echo "== import-linter"; lint-imports
echo "== redis-server (Argo CD's cache in the GitOps e2e test; the router's shared quota ledger), from Debian's packages"
if ! command -v redis-server >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y --no-install-recommends redis-server \
    || { $sudo apt-get update && $sudo apt-get install -y --no-install-recommends redis-server; }
fi
echo "== e2e tools (cached Kubernetes, etcd, KWOK, helm, Prometheus and Argo CD binaries)"
# With KUBECONFIG set the e2e tier runs on that cluster and nothing is built.
[ -n "${KUBECONFIG:-}" ] || { e2e/tools/build.sh; export KVFLEET_E2E_REQUIRED=1; }
echo "== guidellm (the neutral benchmark client; tests/integration/test_guidellm.py runs it)"
scripts/guidellm-env.sh
echo "== engine kernels (built once here, before any timed fixture waits on a first start)"
kvfleet kernels build
echo "== pytest"
set +e
pytest "$@"
rc=$?
set -e
# pytest exits 5 when it collected nothing: that is a failure of the suite, not a pass.
exit $rc
