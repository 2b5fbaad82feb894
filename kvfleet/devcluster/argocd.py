"""Argo CD's own code judging kvfleet objects: the pinned `argocd` binary (e2e/tools/argocd)
evaluates the chart's health checks and Rollout actions exactly as an Argo CD installation
would (gopher-lua with the base, table and os libraries only).

    settings = ArgoCDSettings.from_chart(argocd_binary, helm_binary, workdir)
    settings.health(rollout)            # Health(status="Progressing", message="step 1/3 ...")
    settings.actions(rollout)           # {"abort": False, "pause": False, "resume": True, ...}
    settings.run_action(rollout, "promote")   # the request the action writes

The argocd-cm file these read is the one the chart renders (`argocd.cmPatch=true`), so what is
tested is what a platform team patches into its Argo CD. `ArgoCD` runs the real thing (the
application controller and repo server of the same binary, with Redis) against the dev cluster
for the GitOps tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvfleet.api.rollout import REQUEST_ANNOTATION
from kvfleet.devcluster.cluster import free_port
from kvfleet.devcluster.probes import tcp_connects
from kvfleet.devcluster.processes import ManagedProcess

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvfleet"
# Argo CD's layout: <group>/<Kind>/health.lua, health_test.yaml, testdata/, actions/.
CUSTOMIZATIONS = CHART / "argocd" / "kvfleet.io"
CM_TEMPLATE = "templates/argocd-cm.yaml"


class ArgoCDError(RuntimeError):
    """The argocd binary failed or printed something this module does not understand."""


@dataclass(frozen=True)
class Health:
    status: str  # Healthy, Progressing, Degraded, Suspended, Missing, Unknown
    message: str


def render_cm_patch(helm: Path, out: Path) -> Path:
    """The chart's argocd-cm patch, rendered by the pinned helm into `out`."""
    home = out.parent / ".helm"
    env = {"HELM_CACHE_HOME": str(home / "c"), "HELM_CONFIG_HOME": str(home / "g"),
           "HELM_DATA_HOME": str(home / "d"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [str(helm), "template", "kvfleet", str(CHART), "--set", "argocd.cmPatch=true",
         "--show-only", CM_TEMPLATE],
        env=env, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise ArgoCDError(f"helm could not render {CM_TEMPLATE}: {done.stderr.strip()}")
    out.write_text(done.stdout)
    return out


class ArgoCDSettings:
    """`argocd admin settings resource-overrides ...` against one argocd-cm file."""

    def __init__(self, argocd: Path, cm_path: Path) -> None:
        self.argocd = argocd
        self.cm_path = cm_path

    @classmethod
    def from_chart(cls, argocd: Path, helm: Path, workdir: Path) -> ArgoCDSettings:
        return cls(argocd, render_cm_patch(helm, workdir / "argocd-cm.yaml"))

    def _run(self, verb: str, obj: dict[str, Any], *extra: str) -> str:
        with tempfile.TemporaryDirectory(prefix="kvfleet-argocd-") as tmp:
            path = Path(tmp) / "object.yaml"
            path.write_text(yaml.safe_dump(obj))
            done = subprocess.run(
                [str(self.argocd), "admin", "settings", "resource-overrides", verb, str(path),
                 *extra, "--argocd-cm-path", str(self.cm_path)],
                capture_output=True, text=True, timeout=60, check=False,
                # TMPDIR too: run-action diffs through argocd-diff* folders it leaves behind.
                env={"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp})
        if done.returncode != 0:
            raise ArgoCDError(f"argocd {verb} of {_name(obj)} failed (exit {done.returncode}): "
                              f"{(done.stderr or done.stdout).strip()[-2000:]}")
        return done.stdout

    def health(self, obj: dict[str, Any]) -> Health:
        out = self._run("health", obj)
        if not out.startswith("STATUS: "):
            raise ArgoCDError(f"argocd has no health check for {_name(obj)}: {out.strip()}")
        status_line, _, rest = out.partition("\n")
        message = rest.removeprefix("MESSAGE: ").rstrip("\n")
        return Health(status_line.removeprefix("STATUS: ").strip(), message)

    def actions(self, obj: dict[str, Any]) -> dict[str, bool]:
        """Each action the discovery script offers and whether it is disabled."""
        lines = self._run("list-actions", obj).splitlines()
        if not lines or lines[0].split() != ["NAME", "DISABLED"]:
            raise ArgoCDError(f"argocd lists no actions for {_name(obj)}: {lines[:3]}")
        return {name: disabled == "true" for name, disabled in (ln.split() for ln in lines[1:])}

    def run_action(self, obj: dict[str, Any], action: str) -> dict[str, Any]:
        """The rollout request the action writes into the annotation. argocd prints a diff of
        the object's YAML; the added lines (`> ...`, long values wrapped) are YAML again."""
        out = self._run("run-action", obj, action)
        added = [line[2:] for line in out.splitlines() if line.startswith("> ")]
        try:
            fragment = yaml.safe_load(textwrap.dedent("\n".join(added)))
        except yaml.YAMLError as exc:
            raise ArgoCDError(f"action {action} on {_name(obj)}: unreadable diff: {out}") from exc
        value = _find(fragment, REQUEST_ANNOTATION)
        if not isinstance(value, str):
            raise ArgoCDError(f"action {action} on {_name(obj)} wrote no {REQUEST_ANNOTATION}: "
                              f"{out.strip()[-2000:]}")
        request = json.loads(value)
        if not isinstance(request, dict):
            raise ArgoCDError(f"action {action} wrote {value!r}, not a JSON object")
        return request


def _find(tree: Any, key: str) -> Any:
    """The value under `key` anywhere in a YAML tree, or None."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            if (found := _find(value, key)) is not None:
                return found
    return None


def _name(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')} {meta.get('namespace', '')}/{meta.get('name')}"


# -- a running Argo CD ----------------------------------------------------------------------

NAMESPACE = "argocd"
IN_CLUSTER = "https://kubernetes.default.svc"


@dataclass(frozen=True)
class AppState:
    """An Application's status as Argo CD reports it."""

    sync: str  # Synced, OutOfSync, Unknown
    health: str
    health_message: str
    revision: str
    resources: list[dict[str, Any]]
    conditions: list[dict[str, Any]]
    history: list[str]  # the revision of each sync, oldest first

    @classmethod
    def of(cls, app: dict[str, Any]) -> AppState:
        status = app.get("status") or {}
        sync = status.get("sync") or {}
        health = status.get("health") or {}
        return cls(sync=sync.get("status", "Unknown"), health=health.get("status", "Unknown"),
                   health_message=health.get("message", ""), revision=sync.get("revision", ""),
                   resources=status.get("resources") or [],
                   conditions=status.get("conditions") or [],
                   history=[h["revision"] for h in status.get("history") or []])

    def out_of_sync(self) -> list[str]:
        """The resources Argo CD finds different from Git, as Kind/name."""
        return [f"{r.get('kind')}/{r.get('name')}" for r in self.resources
                if r.get("status") == "OutOfSync"]

    def resource_health(self, kind: str) -> dict[str, Any]:
        found = next((r for r in self.resources if r.get("kind") == kind), {})
        return found.get("health") or {}


class ArgoCD:
    """Argo CD's application controller and repo server (the pinned binary) plus Redis, run on
    this machine against a cluster through its admin kubeconfig; the cluster is Argo CD's
    in-cluster destination. No API server or UI: Applications are objects in the `argocd`
    namespace, and their status is what the tests read.

    `start()` installs Argo CD's CRDs, the argocd-cm with the chart's health checks and
    actions, the secret the controller reads and the default AppProject (which argocd-server
    would otherwise create)."""

    def __init__(self, argocd: Path, crds: Path, cm_patch: Path, kubectl: Path, kubeconfig: Path,
                 workdir: Path, *, resync_seconds: int = 5) -> None:
        self.argocd, self.crds, self.cm_patch = argocd, crds, cm_patch
        self.kubectl, self.kubeconfig, self.workdir = kubectl, kubeconfig, workdir
        self.resync_seconds = resync_seconds
        self.processes: list[ManagedProcess] = []

    def kubectl_run(self, *args: str, stdin: str | None = None) -> str:
        # HOME: kubectl keeps its discovery cache under $HOME/.kube; keep it in the workdir.
        done = subprocess.run([str(self.kubectl), *args], input=stdin, capture_output=True,
                              text=True, timeout=120, check=False,
                              env={"KUBECONFIG": str(self.kubeconfig), "PATH": "/usr/bin:/bin",
                                   "HOME": str(self.workdir)})
        if done.returncode != 0:
            raise ArgoCDError(f"kubectl {' '.join(args[:3])} failed: {done.stderr.strip()}")
        return done.stdout

    def _install(self) -> None:
        self.kubectl_run("apply", "--server-side", "-f", str(self.crds))
        deadline = time.monotonic() + 60
        while True:  # `kubectl wait` fails outright while a new CRD has no conditions yet
            try:
                self.kubectl_run("wait", "--for=condition=Established", "--timeout=10s",
                                 "crd/applications.argoproj.io", "crd/appprojects.argoproj.io")
                break
            except ArgoCDError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        cm = yaml.safe_load(self.cm_patch.read_text())
        # Compare and refresh every few seconds (Argo CD's default is three minutes).
        cm["data"]["timeout.reconciliation"] = f"{self.resync_seconds}s"
        objects: list[dict[str, Any]] = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            cm,
            {"apiVersion": "v1", "kind": "Secret",
             "metadata": {"name": "argocd-secret", "namespace": NAMESPACE,
                          "labels": {"app.kubernetes.io/part-of": "argocd"}},
             "stringData": {"server.secretkey": os.urandom(16).hex()}},
            {"apiVersion": "argoproj.io/v1alpha1", "kind": "AppProject",
             "metadata": {"name": "default", "namespace": NAMESPACE},
             "spec": {"sourceRepos": ["*"],
                      "destinations": [{"server": "*", "namespace": "*"}],
                      "clusterResourceWhitelist": [{"group": "*", "kind": "*"}]}},
        ]
        self.kubectl_run("apply", "-f", "-",
                         stdin="\n---\n".join(yaml.safe_dump(o) for o in objects))

    def start(self, timeout: float = 120) -> None:
        self._install()
        redis_port, repo_port = free_port(), free_port()
        logs = self.workdir / "logs"
        redis = self._spawn("redis", [shutil.which("redis-server") or "redis-server",
                                      "--port", str(redis_port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no"], logs)
        redis.wait_ready(lambda: tcp_connects("127.0.0.1", redis_port), timeout)
        common = ["--redis", f"127.0.0.1:{redis_port}", "--logformat", "text"]
        repo = self._spawn("argocd-repo-server", [
            str(self.argocd), "--address", "127.0.0.1", "--port", str(repo_port),
            "--metrics-address", "127.0.0.1", "--metrics-port", str(free_port()),
            "--disable-tls", *common], logs)
        repo.wait_ready(lambda: tcp_connects("127.0.0.1", repo_port), timeout)
        metrics_port = free_port()
        controller = self._spawn("argocd-application-controller", [
            str(self.argocd), "--kubeconfig", str(self.kubeconfig), "--namespace", NAMESPACE,
            "--repo-server", f"127.0.0.1:{repo_port}", "--repo-server-plaintext",
            "--metrics-port", str(metrics_port), "--status-processors", "2",
            "--operation-processors", "2", "--app-resync", str(self.resync_seconds),
            "--self-heal-timeout-seconds", "2",
            # Each resource's health in the Application's status (Argo CD 3 keeps it only in
            # its Redis-backed resource tree by default), where the tests read it.
            "--persist-resource-health", *common], logs)
        # Its metrics server starts once its caches are set up.
        controller.wait_ready(lambda: tcp_connects("127.0.0.1", metrics_port), timeout)

    def _spawn(self, name: str, argv: list[str], logs: Path) -> ManagedProcess:
        home = self.workdir / "home"
        home.mkdir(parents=True, exist_ok=True)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
               "TMPDIR": str(home), "ARGOCD_BINARY_NAME": name,
               # The in-cluster destination is the cluster of $KUBECONFIG, not a pod's account.
               "ARGOCD_FAKE_IN_CLUSTER": "true", "KUBECONFIG": str(self.kubeconfig),
               "ARGOCD_GPG_ENABLED": "false"}
        proc = ManagedProcess(name, argv, logs / f"{name}.log", env=env)
        self.processes.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail(2500)}" for p in self.processes)

    def create_application(self, name: str, repo_url: str, path: str, namespace: str) -> None:
        """An Application syncing `path` of the Git repository into `namespace`, automatically
        (prune, self-heal), as a GitOps team would set it up."""
        app = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Application",
               "metadata": {"name": name, "namespace": NAMESPACE},
               "spec": {"project": "default",
                        "source": {"repoURL": repo_url, "path": path, "targetRevision": "HEAD"},
                        "destination": {"server": IN_CLUSTER, "namespace": namespace},
                        "syncPolicy": {"automated": {"prune": True, "selfHeal": True}}}}
        self.kubectl_run("apply", "-f", "-", stdin=yaml.safe_dump(app))

    def application(self, name: str) -> AppState:
        return AppState.of(json.loads(self.kubectl_run(
            "get", "applications.argoproj.io", name, "-n", NAMESPACE, "-o", "json")))

    def refresh(self, name: str) -> None:
        """Ask for a compare now (what the UI's Refresh button does), not at the next resync."""
        self.kubectl_run("annotate", "applications.argoproj.io", name, "-n", NAMESPACE,
                         "argocd.argoproj.io/refresh=normal", "--overwrite")
