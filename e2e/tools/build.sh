#!/usr/bin/env bash
# Build the pinned control-plane binaries (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, kwok, helm, prometheus) into the cache, or confirm they are cached.
# Cold: tens of minutes on 2 cores; warm: about a second. See e2e/README.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
[ -x "$py" ] || py=python3
exec "$py" -m kvfleet.devcluster.toolchain "$@"
