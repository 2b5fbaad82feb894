"""The Helm chart on the real apiserver: every rendered object accepted (server-side dry run)
in a namespace that enforces Pod Security "restricted", with no PodSecurity warning; then
install of the previous chart version, upgrade to this one and to a changed value (the
webhook's serving certificate kept) and uninstall (CRDs kept, as Helm does), with every
component scaled to zero so no second operator runs beside the tests'."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from e2e.test_operator_e2e import ROOT, Kubectl, crds  # noqa: F401 (crds is a fixture)
from kvfleet.devcluster.kube import KubeClient

pytestmark = pytest.mark.e2e

CHART = str(ROOT / "helm" / "kvfleet")
# The last commit of the previous chart version (0.1.0: one operator, no NetworkPolicies).
PREVIOUS_CHART_COMMIT = "a7a9fe1"
PREVIOUS_CHART_VERSION = "0.1.0"
SCALED_TO_ZERO = ["--set", "operator.replicas=0", "--set", "webhook.replicas=0",
                  "--set", "router.replicas=0",
                  # Nothing answers while scaled to zero: never refuse other tests' objects.
                  "--set", "webhook.failurePolicy=Ignore"]


def _restricted(kube: KubeClient, namespace: str) -> None:
    kube.merge_patch("Namespace", namespace, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/warn": "restricted"}}})


def test_rendered_chart_is_accepted_and_restricted(
    kube: KubeClient, kubectl: Kubectl, helm: Kubectl, crds: None, namespace: str,  # noqa: F811
) -> None:
    _restricted(kube, namespace)
    rendered = helm("template", "kv", CHART, "-n", namespace).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    # Cluster-scoped objects would clash with other releases' names in a shared cluster:
    # their names carry the release name.
    for d in docs:
        if d["kind"].startswith("Cluster") or d["kind"] == "ValidatingWebhookConfiguration":
            assert d["metadata"]["name"].startswith("kv-"), d["metadata"]["name"]
    out = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=rendered)
    assert "would violate PodSecurity" not in out.stderr, out.stderr
    assert "deployment.apps/kvfleet-operator created (server dry run)" in out.stdout


def _previous_chart(tmp_path: Path) -> str:
    """The chart as released before this version, from the repository's history."""
    archive = subprocess.run(["git", "archive", PREVIOUS_CHART_COMMIT, "helm/kvfleet"],
                             cwd=ROOT, capture_output=True, timeout=60, check=False)
    if archive.returncode != 0:
        pytest.skip(f"no git history to take chart {PREVIOUS_CHART_VERSION} from: "
                    f"{archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True,
                   timeout=60)
    chart = tmp_path / "helm" / "kvfleet"
    assert yaml.safe_load((chart / "Chart.yaml").read_text())["version"] == \
        PREVIOUS_CHART_VERSION
    return str(chart)


def test_install_upgrade_uninstall(
    kube: KubeClient, helm: Kubectl, crds: None, namespace: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Installed as the previous chart version, upgraded to this one, then to a changed
    value, then uninstalled."""
    _restricted(kube, namespace)
    release = f"kv{namespace[-6:]}"
    helm("install", release, _previous_chart(tmp_path), "-n", namespace, *SCALED_TO_ZERO)
    try:
        first = kube.get("Secret", "kvfleet-webhook-tls", namespace)["data"]["tls.crt"]
        helm("upgrade", release, CHART, "-n", namespace, *SCALED_TO_ZERO)
        assert kube.get_or_none("NetworkPolicy", "kvfleet-operator", namespace) is not None
        assert kube.get_or_none("Role", f"{release}-operator-leader", namespace) is not None
        helm("upgrade", release, CHART, "-n", namespace, *SCALED_TO_ZERO,
             "--set", "operator.driftIntervalSeconds=60")
        operator = kube.get("Deployment", "kvfleet-operator", namespace)
        assert "--drift-interval=60" in \
            operator["spec"]["template"]["spec"]["containers"][0]["args"]
        # The serving certificate is kept across upgrades (the chart looks it up).
        assert kube.get("Secret", "kvfleet-webhook-tls", namespace)["data"]["tls.crt"] == first
    finally:
        helm("uninstall", release, "-n", namespace)
    assert kube.get_or_none("Deployment", "kvfleet-operator", namespace) is None
    assert kube.get_or_none("CustomResourceDefinition", "rollouts.kvfleet.io") is not None
