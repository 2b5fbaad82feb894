"""The Helm chart on the real apiserver: every rendered object accepted (server-side dry run)
in a namespace that enforces Pod Security "restricted", with no PodSecurity warning; then
install, upgrade (the webhook's serving certificate kept) and uninstall (CRDs kept, as Helm
does), with every component scaled to zero so no second operator runs beside the tests'."""

from __future__ import annotations

import pytest
import yaml

from e2e.test_operator_e2e import ROOT, Kubectl, crds  # noqa: F401 (crds is a fixture)
from kvfleet.devcluster.kube import KubeClient

pytestmark = pytest.mark.e2e

CHART = str(ROOT / "helm" / "kvfleet")
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


def test_install_upgrade_uninstall(
    kube: KubeClient, helm: Kubectl, crds: None, namespace: str,  # noqa: F811
) -> None:
    _restricted(kube, namespace)
    release = f"kv{namespace[-6:]}"
    helm("install", release, CHART, "-n", namespace, *SCALED_TO_ZERO)
    try:
        first = kube.get("Secret", "kvfleet-webhook-tls", namespace)["data"]["tls.crt"]
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
