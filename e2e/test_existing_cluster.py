"""With KUBECONFIG set, the suite runs against that cluster and builds or starts nothing: the
workflow of `kvfleet dev-cluster up` in one shell and repeated test runs in another."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.devcluster.cluster import DevCluster, ExistingCluster
from kvfleet.devcluster.kube import KubeClient

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def test_suite_uses_an_existing_cluster_from_kubeconfig(
    cluster: DevCluster | ExistingCluster, kube: KubeClient, kubectl_path: str, tmp_path: Path
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
    def namespaces_created() -> float:  # by anyone, as the session apiserver counts them
        return sum(
            sample.value
            for family in text_string_to_metric_families(kube.get_raw("/metrics").text)
            for sample in family.samples
            if sample.name == "apiserver_request_total"
            and sample.labels.get("resource") == "namespaces"
            and sample.labels.get("verb") == "POST")

    before = namespaces_created()
    report = tmp_path / "inner.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "e2e/test_smoke.py", "-q", "-rs", "-p", "no:cacheprovider",
         f"--junitxml={report}",
         "-k", "kubectl_and_server or local_pod_really_runs or lands_on_an_l4 or warm_start"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    # Fake and local nodes are found by label, Prometheus through its URL; the pod runner is
    # the outer session's. Only the start/stop measurement is the harness's own.
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        skipped = case.find("skipped")
        outcomes[case.get("name", "")] = ("skipped", skipped.get("message", "")) \
            if skipped is not None else ("failed", "") if case.find("failure") is not None \
            or case.find("error") is not None else ("passed", "")
    assert sorted(o for o, _ in outcomes.values()) == ["passed"] * 3 + ["skipped"], outcomes
    (reason,) = [why for o, why in outcomes.values() if o == "skipped"]
    assert "start/stop is measured on the harness cluster only" in reason
    # It ran on this cluster (this apiserver counted the namespaces its tests made),
    # and it built and located nothing.
    assert namespaces_created() > before
    assert not (tmp_path / "empty-cache").exists()
