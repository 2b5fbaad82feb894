"""With KUBECONFIG set, the suite runs against that cluster and builds or starts nothing: the
workflow of `kvfleet dev-cluster up` in one shell and repeated test runs in another."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.devcluster.cluster import DevCluster, ExistingCluster

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def test_suite_uses_an_existing_cluster_from_kubeconfig(
    cluster: DevCluster | ExistingCluster, kubectl_path: str, tmp_path: Path
) -> None:
    if isinstance(cluster, ExistingCluster):
        pytest.skip("already running against an existing cluster")
    env = {k: v for k, v in os.environ.items() if k != "KVFLEET_E2E_REQUIRED"}
    env.update(
        # The session cluster stands in for kind/k3d. An empty tools cache shows that nothing
        # is built or located: kubectl comes from PATH, as on a developer's machine.
        KUBECONFIG=str(cluster.kubeconfig),
        KVFLEET_TOOLS_CACHE=str(tmp_path / "empty-cache"),
        KVFLEET_PROMETHEUS_URL=cluster.prometheus.url if cluster.prometheus else "",
        PATH=f"{Path(kubectl_path).parent}:{env.get('PATH', '')}",
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "e2e/test_smoke.py", "-q", "-rs", "-p", "no:cacheprovider",
         "-k", "kubectl_and_server or local_pod_really_runs or lands_on_an_l4 or warm_start"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    # Fake and local nodes are found by label, Prometheus through its URL; the pod runner is
    # the outer session's. Only the start/stop measurement is the harness's own.
    assert "3 passed, 1 skipped" in run.stdout
    assert "start/stop is measured on the harness cluster only" in run.stdout
    assert not (tmp_path / "empty-cache").exists()
