"""GitOps with a real Argo CD: the platform team's fleet lives in Git and Argo CD syncs it.

Argo CD's application controller and repo server (the pinned argo-cd build, with Redis) run
against the dev cluster with the chart's health checks in argocd-cm; an Application syncs a
folder of a local bare Git repository holding three SmolLM2 revisions, the pool, its Rollout
policy and the tenant's quota (the tenant's key Secret stays out of Git). The operator, the
router pod and Prometheus are the rollout tests' own.

Each change is one commit to the pool's artifactRef: a good revision shows the Application
Progressing while the rollout runs and Healthy at promotion; a slow one shows it Degraded with
the rollout's reason while stable serves on. Nothing kvfleet writes (status, its own
annotations, defaults the apiserver fills) may make Argo CD find a difference from Git: the
Application stays Synced between commits and its sync history holds exactly one sync per
commit, none from self-heal.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.conftest import _unavailable, require_redis_server
from e2e.test_operator_e2e import (  # noqa: F401 (crds and operator are fixtures)
    Kubectl,
    OperatorProcess,
    _get,
    _only_the_local_l4_node,
    crds,
    operator,
)
from e2e.test_rollout_e2e import _pods, faults, shared_cores  # noqa: F401 (fixtures)
from kvfleet.devcluster import toolchain
from kvfleet.devcluster.argocd import AppState, ArgoCD, render_cm_patch
from kvfleet.devcluster.cluster import DevCluster, ExistingCluster
from kvfleet.devcluster.demo import (
    POOL,
    Traffic,
    local_pool,
    rollout_policy,
    router_on_node,
    slow_fault,
    smollm2_revision,
    tenant_key,
    tenant_quota,
)
from kvfleet.devcluster.errors import ToolsMissingError
from kvfleet.devcluster.kube import KubeClient
from kvfleet.engine.faults import FAULTS_ENV
from kvfleet.operator.revisions import revision_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

APP = "fleet"


@pytest.fixture(scope="module")
def argocd(cluster: DevCluster | ExistingCluster, kubectl_path: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ArgoCD]:
    try:
        tools = toolchain.locate()
    except ToolsMissingError as exc:
        _unavailable(str(exc))
    require_redis_server()
    workdir = tmp_path_factory.mktemp("argocd")
    cm_patch = render_cm_patch(tools["helm"], workdir / "argocd-cm.yaml")
    argo = ArgoCD(tools["argocd"], tools.argocd_crds, cm_patch, Path(kubectl_path),
                  Path(cluster.kubeconfig), workdir)
    try:
        argo.start()
        yield argo
    finally:
        argo.stop()


class GitRepo:
    """A bare repository (what Argo CD clones, by file:// URL) and a work tree to commit in."""

    def __init__(self, root: Path) -> None:
        self.bare, self.work = root / "fleet.git", root / "work"
        self._git(root, "init", "--bare", "--initial-branch=main", str(self.bare))
        self._git(root, "clone", str(self.bare), str(self.work))

    @property
    def url(self) -> str:
        return f"file://{self.bare}"

    def _git(self, cwd: Path, *args: str) -> str:
        env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "GIT_AUTHOR_NAME": "platform team",
               "GIT_AUTHOR_EMAIL": "platform@example.com", "GIT_COMMITTER_NAME": "platform team",
               "GIT_COMMITTER_EMAIL": "platform@example.com"}
        return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()

    def commit(self, files: dict[str, list[dict[str, Any]]], message: str) -> str:
        """Write each file (YAML documents, no namespace: Argo CD's destination gives it) and
        push one commit; its sha."""
        for name, docs in files.items():
            path = self.work / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        self._git(self.work, "add", "-A")
        self._git(self.work, "commit", "-q", "-m", message)
        self._git(self.work, "push", "-q", "origin", "HEAD:main")
        return self._git(self.work, "rev-parse", "HEAD")


def _without_namespace(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"].pop("namespace", None)
    return obj


class Watch:
    """Polls the Application every half second and keeps what Argo CD said (sync, health,
    the resources it found different from Git), so the test can say it never drifted."""

    def __init__(self, argocd: ArgoCD) -> None:
        self.argocd = argocd
        self.seen: list[tuple[float, AppState]] = []
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.wait(0.5):
            try:
                state = self.argocd.application(APP)
            except Exception:  # the Application not created yet, a slow apiserver: go on
                continue
            with self.lock:
                self.seen.append((time.monotonic(), state))

    def wait(self, check: Callable[[AppState], bool], what: str, timeout: float) -> AppState:
        deadline = time.monotonic() + timeout
        last: AppState | None = None
        while time.monotonic() < deadline:
            with self.lock:
                last = self.seen[-1][1] if self.seen else None
            if last is not None and check(last):
                return last
            time.sleep(0.5)
        pytest.fail(f"Application {APP}: timed out waiting for {what}; last state: {last}\n"
                    f"{self.argocd.log_tail()}")

    def since(self, started: float) -> list[AppState]:
        with self.lock:
            return [state for at, state in self.seen if at >= started]

    def close(self) -> None:
        self.stop_event.set()
        self.thread.join(5)


@pytest.mark.usefixtures("shared_cores")
def test_argo_cd_syncs_the_fleet_and_shows_each_rollout_healthy_or_degraded(
    kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess, namespace: str,  # noqa: F811
    local_node: str, fake_nodes: list[str], faults: dict[str, str],  # noqa: F811
    argocd: ArgoCD, tmp_path: Path,
) -> None:
    revisions = [smollm2_revision(f"smol-v{i}", 40 + i, namespace) for i in (1, 2, 3)]
    hashes = {a["metadata"]["name"]: revision_for(local_pool(POOL, "smol-v1", namespace), a)
              for a in revisions}
    tenant_key(kube, namespace)

    def fleet(artifact: str) -> dict[str, list[dict[str, Any]]]:
        return {
            "fleet/modelartifacts.yaml": [_without_namespace(dict(a, metadata=dict(
                a["metadata"]))) for a in revisions],
            "fleet/servingpool.yaml": [_without_namespace(local_pool(POOL, artifact, namespace))],
            "fleet/rollout.yaml": [_without_namespace(rollout_policy(POOL, namespace))],
            "fleet/tenantquota.yaml": [_without_namespace(tenant_quota(namespace))],
        }

    repo = GitRepo(tmp_path)
    with _only_the_local_l4_node(kube, kubectl):
        first = repo.commit(fleet("smol-v1"), "fleet: smol serves smol-v1")
        argocd.create_application(APP, repo.url, "fleet", namespace)
        watch = Watch(argocd)
        traffic: Traffic | None = None
        try:
            synced = watch.wait(lambda s: s.revision == first and s.sync == "Synced"
                                and s.health == "Healthy", "the first sync Healthy", 360)
            assert {r["kind"] for r in synced.resources} == {
                "ModelArtifact", "ServingPool", "Rollout", "TenantQuota"}
            traffic = Traffic(router_on_node(kube, namespace, local_node))

            # A good revision: one line in Git.
            good = repo.commit(fleet("smol-v2"), "fleet: roll smol to smol-v2")
            argocd.refresh(APP)
            started = time.monotonic()
            watch.wait(lambda s: s.revision == good and s.health == "Progressing",
                       "Progressing while the rollout runs", 120)
            promoted = watch.wait(lambda s: s.revision == good and s.health == "Healthy",
                                  "Healthy at promotion", 360)
            assert promoted.sync == "Synced"
            rollout = _get(kube, "Rollout", namespace, POOL)
            assert rollout["status"]["phase"] == "Promoted", rollout["status"]
            assert rollout["status"]["stableRevision"] == hashes["smol-v2"]
            _no_drift(watch.since(started), good)

            # A slow revision: rolled back; Degraded with the rollout's reason.
            os.environ[FAULTS_ENV] = slow_fault(hashes["smol-v3"])
            stable_pods = _pods(kube, namespace, hashes["smol-v2"])
            bad = repo.commit(fleet("smol-v3"), "fleet: roll smol to smol-v3")
            argocd.refresh(APP)
            started = time.monotonic()
            # Degraded from the moment traffic goes back to stable (RollingBack), and still
            # once the canary is gone (RolledBack), with the rollout's own words.
            watch.wait(lambda s: s.revision == bad and s.health == "Degraded",
                       "Degraded as the rollout fails", 360)
            rollout = kube.wait_for("the Rollout RolledBack", lambda: r if (r := _get(
                kube, "Rollout", namespace, POOL))["status"]["phase"] == "RolledBack" else None,
                120)
            assert "tpot canary/stable" in rollout["status"]["message"]
            degraded = watch.wait(
                lambda s: s.resource_health("Rollout").get("message")
                == rollout["status"]["message"], "the rollout's reason in Argo CD", 60)
            assert degraded.health == "Degraded"
            assert degraded.resource_health("Rollout")["status"] == "Degraded"
            pool = _get(kube, "ServingPool", namespace, POOL)
            assert pool["status"]["servingRevision"] == hashes["smol-v2"]  # stable serves on
            assert _pods(kube, namespace, hashes["smol-v2"]) == stable_pods
            time.sleep(10)  # two resyncs: still Synced, still Degraded
            _no_drift(watch.since(started), bad)
            final = argocd.application(APP)
            assert (final.sync, final.health) == ("Synced", "Degraded")
            history = argocd.application(APP).history
            assert history == [first, good, bad], (
                f"one sync per commit, none from self-heal: {history}")
        finally:
            watch.close()
            if traffic is not None:
                traffic.close()
            argocd.kubectl_run("delete", "applications.argoproj.io", APP, "-n", "argocd",
                               "--wait=false")
    assert traffic is not None and traffic.failures == [], traffic.failures[:5]


def _no_drift(states: list[AppState], revision: str) -> None:
    """Once Argo CD has synced `revision`, it never finds the cluster different from Git."""
    after = [s for s in states if s.revision == revision]
    first_synced = next((i for i, s in enumerate(after) if s.sync == "Synced"), None)
    assert first_synced is not None, f"never Synced at {revision[:8]}"
    drifted = [(s.sync, s.out_of_sync()) for s in after[first_synced:] if s.sync != "Synced"]
    assert not drifted, f"Argo CD found a difference from Git after the sync: {drifted[:3]}"

