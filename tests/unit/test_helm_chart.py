"""The Helm chart (helm/kvfleet) stays what the code generates and renders restricted pods.

Generated parts are compared with their source: the CRDs with crds/, the operator's and the
router's RBAC rules with the code that prints them. With the pinned helm built (the e2e tools;
CI builds them first) the chart is also linted and rendered here."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

import kvfleet
from kvfleet.operator.rbac import cluster_role_rules, lease_role_rules, permissions
from kvfleet.router.manifests import build_manifests
from kvfleet.webhooks.config import build_validating_webhook_configuration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvfleet"


def test_the_charts_crds_are_the_generated_ones() -> None:
    generated = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    assert sorted(p.name for p in (CHART / "crds").glob("*.yaml")) == generated
    for name in generated:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), (
            f"copy crds/{name} to helm/kvfleet/crds/ (kvfleet crds generate writes crds/)")


def test_the_charts_rbac_is_what_the_components_use() -> None:
    operator = yaml.safe_load((CHART / "files" / "operator-rules.yaml").read_text())
    assert operator == cluster_role_rules(), "regenerate helm/kvfleet/files/operator-rules.yaml"
    lease = yaml.safe_load((CHART / "files" / "operator-lease-rules.yaml").read_text())
    assert lease == lease_role_rules(), "regenerate helm/kvfleet/files/operator-lease-rules.yaml"
    router = yaml.safe_load((CHART / "files" / "router-rules.yaml").read_text())
    role = next(m for m in build_manifests("x") if m["kind"] == "Role")
    assert router == role["rules"], "regenerate helm/kvfleet/files/router-rules.yaml"


def test_chart_version_and_image_follow_the_package() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == kvfleet.__version__
    from kvfleet.operator.builders import EngineOptions

    # The engine pods the operator makes run the chart's image by default too.
    assert EngineOptions().image.rsplit(":", 1)[0] == values["image"]["repository"]


def _helm() -> str:
    from kvfleet.devcluster import toolchain
    from kvfleet.devcluster.errors import ToolsMissingError

    try:
        return str(toolchain.locate()["helm"])
    except ToolsMissingError as exc:
        pytest.skip(f"helm not built: {exc}")


def _run(tmp_path: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {"HELM_CACHE_HOME": str(tmp_path / "c"), "HELM_CONFIG_HOME": str(tmp_path / "g"),
           "HELM_DATA_HOME": str(tmp_path / "d"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([_helm(), *args], env=env, capture_output=True, text=True,
                          check=check, timeout=120)


def _render(tmp_path: Path, *sets: str) -> list[dict[str, Any]]:
    flags = [f for s in sets for f in ("--set", s)]
    out = _run(tmp_path, "template", "kv", str(CHART), "-n", "kvfleet-system", *flags).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.mark.tools
def test_chart_lints_and_refuses_a_bad_value_by_name(tmp_path: Path) -> None:
    lint = _run(tmp_path, "lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in lint.stdout
    bad = _run(tmp_path, "template", "kv", str(CHART), "--set", "webhook.failurePolicy=Maybe",
               check=False)
    assert bad.returncode != 0 and "/webhook/failurePolicy" in bad.stderr
    typo = _run(tmp_path, "template", "kv", str(CHART), "--set", "operator.replica=2",
                check=False)
    assert typo.returncode != 0 and "replica" in typo.stderr


@pytest.mark.tools
def test_every_pod_runs_restricted_and_rbac_renders_as_generated(tmp_path: Path) -> None:
    docs = _render(tmp_path, "operator.prometheusUrl=http://prometheus:9090")
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert sorted(d["metadata"]["name"] for d in deployments) == [
        "kvfleet-operator", "kvfleet-router", "kvfleet-webhook"]
    for d in deployments:
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert c["image"] == f"ghcr.io/kvfleet/kvfleet:{kvfleet.__version__}"
    operator = next(d for d in deployments if d["metadata"]["name"] == "kvfleet-operator")
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--prometheus-url=http://prometheus:9090" in args
    # Two replicas, one leading through the Lease its Role allows; nothing binds 0.0.0.0.
    assert operator["spec"]["replicas"] == 2 and "--leader-elect" in args
    assert not [a for a in args if "0.0.0.0" in a], args
    leader_role = next(d for d in docs if d["kind"] == "Role"
                       and d["metadata"]["name"] == "kv-operator-leader")
    assert leader_role["rules"] == lease_role_rules()
    role = next(d for d in docs if d["kind"] == "ClusterRole"
                and d["metadata"]["name"] == "kv-operator")
    assert role["rules"] == cluster_role_rules()
    [webhook] = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    expected = build_validating_webhook_configuration(
        ca_bundle_pem=b"x", service=("kvfleet-system", "kvfleet-webhook", 443))["webhooks"][0]
    got = webhook["webhooks"][0]
    for key in ("name", "rules", "failurePolicy", "matchPolicy", "sideEffects",
                "admissionReviewVersions", "timeoutSeconds"):
        assert got[key] == expected[key], key
    assert got["clientConfig"]["service"] == expected["clientConfig"]["service"]


@pytest.mark.tools
def test_optional_parts_render_only_when_asked(tmp_path: Path) -> None:
    """The argocd-cm patch (Argo CD owns argocd-cm: rendered for `kubectl patch`, never
    installed by default) and the Grafana dashboard's ConfigMap for the sidecar."""
    kinds = {(d["kind"], d["metadata"]["name"]) for d in _render(tmp_path)}
    assert ("ConfigMap", "argocd-cm") not in kinds
    assert ("ConfigMap", "kv-grafana-dashboard") not in kinds
    docs = _render(tmp_path, "argocd.cmPatch=true", "grafana.dashboard.enabled=true")
    [cm] = [d for d in docs if d["metadata"]["name"] == "argocd-cm"]
    assert cm["metadata"]["namespace"] == "argocd"
    assert sorted(cm["data"]) == sorted(
        [f"resource.customizations.health.kvfleet.io_{kind}"
         for kind in ("ModelArtifact", "Rollout", "ServingPool", "TenantQuota")]
        + ["resource.customizations.actions.kvfleet.io_Rollout"])
    actions = yaml.safe_load(cm["data"]["resource.customizations.actions.kvfleet.io_Rollout"])
    assert sorted(a["name"] for a in actions["definitions"]) == [
        "abort", "pause", "promote", "promote-full", "resume", "retry", "undo"]
    [board] = [d for d in docs if d["metadata"]["name"] == "kv-grafana-dashboard"]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(board["data"]["kvfleet.json"]) == json.loads(
        (CHART / "dashboards" / "kvfleet.json").read_text())


@pytest.mark.tools
def test_each_network_policy_admits_only_its_pods_named_ports(tmp_path: Path) -> None:
    docs = _render(tmp_path)
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    assert sorted(policies) == ["kvfleet-operator", "kvfleet-router", "kvfleet-webhook"]
    for d in (d for d in docs if d["kind"] == "Deployment"):
        policy = policies[d["metadata"]["name"]]
        pod = d["spec"]["template"]
        selector = policy["spec"]["podSelector"]["matchLabels"]
        assert selector.items() <= pod["metadata"]["labels"].items()
        named = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        for rule in policy["spec"]["ingress"]:
            assert {p["port"] for p in rule["ports"]} <= named
    # Only Prometheus, in its named namespace, may scrape the operator and the routers'
    # metrics port; the router's clients' port and the webhook take any client.
    prometheus = {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    assert policies["kvfleet-operator"]["spec"]["ingress"][0]["from"] == [prometheus]
    clients, scrapes = policies["kvfleet-router"]["spec"]["ingress"]
    assert "from" not in clients and clients["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert scrapes == {"from": [prometheus], "ports": [{"port": "metrics", "protocol": "TCP"}]}
    # The engines' policy (the operator's) names the same namespace, and engines serve TLS.
    [operator] = [d for d in docs if d["kind"] == "Deployment"
                  and d["metadata"]["name"] == "kvfleet-operator"]
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--prometheus-namespace=monitoring" in args and "--engine-tls" in args
    assert not any(d["kind"] == "NetworkPolicy"
                   for d in _render(tmp_path, "networkPolicies.enabled=false"))


@pytest.mark.tools
def test_cert_manager_issues_the_webhook_certificate_when_asked(tmp_path: Path) -> None:
    missing = _run(tmp_path, "template", "kv", str(CHART), "--set",
                   "webhook.certManager.enabled=true", check=False)
    assert missing.returncode != 0 and "/webhook/certManager/issuerRef" in missing.stderr
    docs = _render(tmp_path, "webhook.certManager.enabled=true",
                   "webhook.certManager.issuerRef.name=ca",
                   "webhook.certManager.issuerRef.kind=ClusterIssuer")
    [certificate] = [d for d in docs if d["kind"] == "Certificate"]
    assert certificate["spec"]["issuerRef"] == {"name": "ca", "kind": "ClusterIssuer"}
    assert certificate["spec"]["dnsNames"] == ["kvfleet-webhook.kvfleet-system.svc"]
    assert not [d for d in docs if d["kind"] == "Secret"]  # cert-manager writes it
    [webhook] = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    assert webhook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        "kvfleet-system/kvfleet-webhook"


@pytest.mark.tools
def test_pod_monitors_scrape_each_component_on_its_named_port(tmp_path: Path) -> None:
    from kvfleet.operator.builders import ENGINE_PORT_NAME
    from kvfleet.operator.naming import ENGINE_COMPONENT

    assert not [d for d in _render(tmp_path) if d["kind"] == "PodMonitor"]
    docs = _render(tmp_path, "prometheus.podMonitors.enabled=true",
                   "prometheus.podMonitors.labels.release=prom")
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
    assert sorted(monitors) == ["kvfleet-engines", "kvfleet-operator", "kvfleet-router"]
    assert all(m["metadata"]["labels"]["release"] == "prom" for m in monitors.values())
    for d in (d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] in
              monitors):
        monitor = monitors[d["metadata"]["name"]]["spec"]
        pod = d["spec"]["template"]
        assert monitor["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
        assert monitor["podMetricsEndpoints"][0]["port"] in ports
    # The router's `namespace` label is the pool's, kept over the router pod's namespace.
    assert monitors["kvfleet-router"]["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True
    engines = monitors["kvfleet-engines"]["spec"]
    assert engines["selector"]["matchLabels"] == {"app.kubernetes.io/component": ENGINE_COMPONENT}
    assert engines["podMetricsEndpoints"][0]["port"] == ENGINE_PORT_NAME


@pytest.mark.tools
def test_the_charts_pods_run_the_image_as_the_dockerfile_builds_it(tmp_path: Path) -> None:
    """One image for every component: the chart runs its entrypoint as the user it drops to
    (a different uid could not read the prebuilt kernels)."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    [user] = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    [entry] = [yaml.safe_load(line.split(None, 1)[1]) for line in dockerfile.splitlines()
               if line.startswith("ENTRYPOINT ")]
    for d in (d for d in _render(tmp_path) if d["kind"] == "Deployment"):
        pod = d["spec"]["template"]["spec"]
        assert str(pod["securityContext"]["runAsUser"]) == user, d["metadata"]["name"]
        assert str(pod["securityContext"]["runAsGroup"]) == user, d["metadata"]["name"]
        for c in pod["containers"]:
            assert c["command"] == entry, (d["metadata"]["name"], c["command"])


@pytest.mark.tools
def test_the_webhooks_role_grants_what_its_reviews_read(tmp_path: Path) -> None:
    """Each kind reviewed with a recording fetch and list: the kinds it reads by reference (a
    pool's artifact, a rollout's pool) and lists (every TenantQuota, a pool's Rollouts) are
    exactly what the chart's webhook ClusterRole lets it get and list, and nothing else."""
    import asyncio

    from kvfleet.api.builders import make_artifact as artifact
    from kvfleet.api.builders import make_pool as pool
    from kvfleet.api.builders import make_quota, make_rollout
    from kvfleet.compat import default_matrix
    from kvfleet.webhooks.admission import KINDS, admit

    stored = {"ModelArtifact": artifact().obj().to_wire(), "ServingPool": pool().obj().to_wire()}
    read: set[tuple[str, str]] = set()

    async def fetch(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        read.add((kind, "get"))
        return stored.get(kind)

    async def list_objects(kind: str, namespace: str | None) -> list[dict[str, Any]]:
        read.add((kind, "list"))
        return []

    old_pool = pool().data()
    old_pool["spec"]["slos"] = {"ttftP95Seconds": 9.0}  # an slos edit re-checks the Rollouts
    for kind, obj, old in [("ModelArtifact", artifact().data(), None),
                           ("ServingPool", pool().data(), None),
                           ("ServingPool", pool().data(), old_pool),
                           ("TenantQuota", make_quota().data(), None),
                           ("Rollout", make_rollout().data(), None)]:
        asyncio.run(admit(kind, obj, old, fetch=fetch, matrix=default_matrix(),
                          list_objects=list_objects))
    [role] = [d for d in _render(tmp_path) if d["kind"] == "ClusterRole"
              and d["metadata"]["name"] == "kv-webhook"]
    assert permissions(role["rules"]) == {
        ("kvfleet.io", KINDS[kind].crd.plural, verb) for kind, verb in read}
