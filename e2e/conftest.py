"""Session fixtures for the end-to-end tier (see e2e/README.md for the contract).

    cluster      the running cluster: a DevCluster the harness started, or, with KUBECONFIG set,
                 an ExistingCluster (nothing is built or started then)
    kube         a KubeClient (admin) for that cluster
    kubectl      run kubectl against it: kubectl("get", "nodes", "-o", "json") -> CompletedProcess
    helm         run helm against it, with its own cache/config dirs: helm("install", ...)
    prometheus   a PrometheusClient: the harness's, or $KVFLEET_PROMETHEUS_URL's (else skips)
    local_node   name of a local GPU node whose pods really run (else skips)
    fake_nodes   names of the KWOK GPU nodes (else skips)
    namespace    a fresh namespace per test, deleted afterwards
    argo_health  Argo CD's health checks for live objects (e2e/argocd_health.py)

The binaries come from e2e/tools/build.sh. Without them the e2e tests skip with the build
command as the reason, unless KVFLEET_E2E_REQUIRED=1 (set by scripts/test.sh after it built
them), in which case a missing binary is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from e2e.argocd_health import ArgoHealth
from kvfleet.devcluster import toolchain
from kvfleet.devcluster.argocd import ArgoCDSettings
from kvfleet.devcluster.cluster import DevCluster, ExistingCluster
from kvfleet.devcluster.errors import ToolsMissingError
from kvfleet.devcluster.kube import KubeClient
from kvfleet.devcluster.prometheus import PrometheusClient

Kubectl = Callable[..., "subprocess.CompletedProcess[str]"]


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("KVFLEET_E2E_REQUIRED") == "1":
        pytest.fail(f"e2e prerequisites missing although KVFLEET_E2E_REQUIRED=1: {reason}")
    pytest.skip(reason)


def require_redis_server() -> None:
    """Argo CD's cache and the router's shared ledger run the machine's redis-server."""
    if shutil.which("redis-server") is None:
        _unavailable("redis-server is not installed (Debian: apt-get install redis-server)")


@pytest.fixture(scope="session")
def cluster() -> Iterator[DevCluster | ExistingCluster]:
    existing = os.environ.get("KUBECONFIG")
    if existing:
        ext = ExistingCluster(Path(existing))
        yield ext
        ext.stop()
        return
    try:
        toolchain.locate()
    except ToolsMissingError as exc:
        _unavailable(str(exc))
    dev = DevCluster()
    try:
        dev.start()
        yield dev
    finally:
        dev.stop()


@pytest.fixture(scope="session")
def kube(cluster: DevCluster | ExistingCluster) -> KubeClient:
    return cluster.api


@pytest.fixture(scope="session")
def kubectl_path(cluster: DevCluster | ExistingCluster) -> str:
    try:
        return str(toolchain.locate()["kubectl"])
    except ToolsMissingError:
        found = shutil.which("kubectl")
        if found is None:
            _unavailable("kubectl is neither built (e2e/tools/build.sh) nor on PATH")
        return found


@pytest.fixture(scope="session")
def kubectl(cluster: DevCluster | ExistingCluster, kubectl_path: str) -> Kubectl:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}

    def run(*args: str, check: bool = True, input: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:  # fmt: skip
        return subprocess.run(
            [kubectl_path, *args], env=env, capture_output=True, text=True, check=check,
            input=input, timeout=timeout,
        )  # fmt: skip

    return run


@pytest.fixture(scope="session")
def helm(
    cluster: DevCluster | ExistingCluster, tmp_path_factory: pytest.TempPathFactory
) -> Kubectl:
    """Run the pinned helm (or helm from PATH on an existing cluster) against the cluster."""
    try:
        path = str(toolchain.locate()["helm"])
    except ToolsMissingError:
        found = shutil.which("helm")
        if found is None:
            _unavailable("helm is neither built (e2e/tools/build.sh) nor on PATH")
        path = found
    home = tmp_path_factory.mktemp("helm-home")  # keep helm's cache/config out of $HOME
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }

    def run(
        *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [path, *args], env=env, capture_output=True, text=True, check=check, timeout=timeout
        )

    return run


@pytest.fixture(scope="session")
def prometheus(cluster: DevCluster | ExistingCluster) -> PrometheusClient:
    if cluster.prometheus is None:
        pytest.skip("no Prometheus: on an existing cluster set KVFLEET_PROMETHEUS_URL")
    return cluster.prometheus


@pytest.fixture(scope="session")
def local_node(cluster: DevCluster | ExistingCluster) -> str:
    if not cluster.local_node_names:
        pytest.skip("no local GPU node (label kvfleet.io/local-node=true) whose pods really run")
    return cluster.local_node_names[0]


@pytest.fixture(scope="session")
def fake_nodes(cluster: DevCluster | ExistingCluster) -> list[str]:
    if not cluster.has_fake_nodes:
        pytest.skip("no KWOK fake GPU nodes (label type=kwok) in this cluster")
    return list(cluster.fake_node_names)


@pytest.fixture
def namespace(kube: KubeClient) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    kube.wait_for(
        f"service account default in {name}",
        lambda: kube.get_or_none("ServiceAccount", "default", name),
        30,
    )
    yield name
    kube.delete("Namespace", name)


@pytest.fixture(scope="session")
def argo_health(tmp_path_factory: pytest.TempPathFactory) -> ArgoHealth:
    """Argo CD's health checks (the pinned argocd binary, the chart's argocd-cm patch)."""
    try:
        tools = toolchain.locate()
    except ToolsMissingError as exc:
        _unavailable(str(exc))
    workdir = tmp_path_factory.mktemp("argocd")
    return ArgoHealth(ArgoCDSettings.from_chart(tools["argocd"], tools["helm"], workdir))
