"""Start and stop a whole dev cluster: etcd → kube-apiserver → controller-manager, scheduler,
KWOK → fake GPU fleet → local GPU nodes + pod runner → Prometheus.

`DevCluster.start()` either returns a ready cluster or raises StartupError after stopping
whatever it had started; `stop()` is idempotent, also runs at interpreter exit, and removes the
temp dir. `ExistingCluster` wraps a `KUBECONFIG` cluster (kind, k3d, a real one): nothing is
built or started, and the harness-only parts (fake nodes, local runner, Prometheus) are absent.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import shutil
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from kvfleet.devcluster import fleet, toolchain
from kvfleet.devcluster.errors import StartupError
from kvfleet.devcluster.kube import KubeClient, condition_true, connect
from kvfleet.devcluster.pki import ClusterPki, create_pki, kubeconfig_yaml
from kvfleet.devcluster.podrunner import LocalPodRunner
from kvfleet.devcluster.processes import ManagedProcess
from kvfleet.devcluster.prometheus import PROMETHEUS_URL_ENV, Prometheus, PrometheusClient

SERVICE_CIDR = "10.0.0.0/24"  # allocation range only: no traffic is ever sent there
SERVICE_IP = "10.0.0.1"
# KWOK's fake pods get loopback IPs too, so nothing ever points outside this machine.
KWOK_POD_CIDR = "127.128.0.0/16"
ADMISSION_PLUGINS = (
    "NamespaceLifecycle,LimitRanger,ServiceAccount,DefaultTolerationSeconds,"
    "DefaultStorageClass,StorageObjectInUseProtection,PersistentVolumeClaimResize,"
    "RuntimeClass,Priority,TaintNodesByCondition,PodSecurity,ResourceQuota,"
    "MutatingAdmissionWebhook,ValidatingAdmissionPolicy,"
    "ValidatingAdmissionWebhook"
)
# Kubernetes' defaults: a kubelet's lease lasts 40 s and is renewed every quarter of that
# (KWOK does the same: renewInterval = duration / 4), and the controller-manager's node
# lifecycle controller marks a node NotReady 50 s after its last renewal. Both scale together.
DEFAULT_NODE_LEASE_SECONDS = 40
NODE_GRACE_PER_LEASE = 50 / 40


log = logging.getLogger(__name__)

WORKDIR_PREFIX = "kvfleet-devcluster-"
# Whose requests the apiserver's audit log keeps: the service accounts kvfleet runs as.
AUDITED_GROUP = "system:serviceaccounts:kvfleet-system"
OWNER_FILE = "owner.pid"
# Local pods' logs outlive the cluster (the workdir goes at teardown): the last few runs'.
KEPT_LOGS = Path(os.environ.get("KVFLEET_DEV_LOGS", "~/.cache/kvfleet/dev-cluster-logs"))
KEPT_RUNS = 3


def keep_pod_logs(pods: Path, into: Path | None = None, runs: int = KEPT_RUNS) -> Path | None:
    """Copy the local pods' logs (`<namespace>_<pod>/<container>.log`) out of a workdir that
    is about to go, into a folder of their own; only the last `runs` such folders are kept."""
    logs = sorted(pods.glob("*/*.log"))
    if not logs:
        return None
    root = (into or KEPT_LOGS).expanduser()
    target = root / time.strftime("%Y%m%dT%H%M%S") / pods.parent.name
    for log_file in logs:
        (target / log_file.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(log_file, target / log_file.parent.name / log_file.name)
    for old in sorted(p for p in root.iterdir() if p.is_dir())[:-runs]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def remove_orphaned_workdirs() -> None:
    """Delete work dirs whose harness died without cleaning up (SIGKILL, power loss); their
    processes are already gone (PR_SET_PDEATHSIG), only files remain."""
    for folder in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"):
        try:
            owner = int((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours, or still being created
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class ClusterOptions:
    node_groups: Sequence[fleet.NodeGroup] = fleet.DEFAULT_FLEET
    local_nodes: int = 1
    local_product: fleet.GpuProduct = fleet.L4
    # Four: two revisions of a two-replica pool side by side (the router e2e), each pod a real
    # engine process; a process runs only for a pod placed there.
    local_gpus_per_node: int = 4
    prometheus: bool = True
    startup_timeout: float = 90.0
    # How long a fake node's lease lasts; KWOK renews it every quarter of this, and the node
    # lifecycle controller waits 1.25x this for a renewal (`node_monitor_grace_seconds`).
    # Kubernetes' 40 s means 2,000 fake nodes renew 200 leases a second, which a busy 2-core
    # machine cannot serve: renewals fall behind, nodes go NotReady and their pods not Ready
    # (and KWOK's stock stages never make an existing pod Ready again). A fleet of thousands
    # on a small machine needs longer leases; see `node_lease_seconds_for`.
    node_lease_seconds: int = DEFAULT_NODE_LEASE_SECONDS
    project_root: Path = field(default_factory=lambda: Path(__file__).resolve().parents[2])

    def __post_init__(self) -> None:
        if self.node_lease_seconds < 4:  # KWOK renews every quarter: at least once a second
            raise ValueError(
                f"ClusterOptions.node_lease_seconds must be >= 4, got {self.node_lease_seconds}"
            )


def node_lease_seconds_for(num_nodes: int, renewals_per_second: float = 20.0) -> int:
    """A lease long enough that `num_nodes` fake nodes renew about `renewals_per_second`
    leases a second (never shorter than Kubernetes' 40 s). 20/s is what 200 nodes renew with
    the default lease, which the shared 2-core machine serves next to a burst of pods; 2,000
    nodes at the default (200/s) fell behind there."""
    if num_nodes < 0 or renewals_per_second <= 0:
        raise ValueError(
            f"num_nodes must be >= 0 and renewals_per_second > 0, got {num_nodes}, "
            f"{renewals_per_second}"
        )
    renew_interval = num_nodes / renewals_per_second  # KWOK renews every lease / 4
    return max(DEFAULT_NODE_LEASE_SECONDS, round(4 * renew_interval))


class DevCluster:
    """A control plane of real binaries on loopback; see the module docstring."""

    def __init__(self, options: ClusterOptions | None = None) -> None:
        self.options = options or ClusterOptions()
        remove_orphaned_workdirs()
        self.workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
        (self.workdir / OWNER_FILE).write_text(str(os.getpid()))
        self.processes: list[ManagedProcess] = []
        self.runner: LocalPodRunner | None = None
        self.prometheus: Prometheus | None = None
        self.local_node_names: list[str] = []
        self.fake_node_names: list[str] = []
        self.startup_seconds: float | None = None
        self._api: KubeClient | None = None
        self._pki: ClusterPki | None = None
        self._stop_lock = threading.Lock()
        self._stopped = False
        self.server = ""
        atexit.register(self.stop)

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def audit_log(self) -> Path:
        """The apiserver's audit log (JSON lines) of every request made by a service account
        of the `kvfleet-system` namespace: what kvfleet's components really ask for."""
        return self.workdir / "audit.log"

    @property
    def api(self) -> KubeClient:
        if self._api is None:
            raise StartupError("the dev cluster is not started")
        return self._api

    @property
    def has_fake_nodes(self) -> bool:
        return bool(self.fake_node_names)

    @property
    def pki(self) -> ClusterPki:
        if self._pki is None:
            raise StartupError("the dev cluster is not started")
        return self._pki

    # start -----------------------------------------------------------------------------------
    def start(self) -> DevCluster:
        started = time.monotonic()
        try:
            tools = toolchain.locate()
            self._start_control_plane(tools)
            self._start_nodes(tools)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    @property
    def node_monitor_grace_seconds(self) -> int:
        """The controller-manager's `--node-monitor-grace-period` for these leases (50 s for
        the default 40 s lease, as in Kubernetes)."""
        return round(self.options.node_lease_seconds * NODE_GRACE_PER_LEASE)

    def _audit_policy(self) -> Path:
        path = self.workdir / "audit-policy.yaml"
        path.write_text(yaml.safe_dump({
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
            "omitStages": ["RequestReceived"],
            "rules": [{"level": "Metadata", "userGroups": [AUDITED_GROUP]},
                      {"level": "None"}]}))
        return path

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, self.workdir / "logs" / f"{name}.log")
        self.processes.append(proc)
        return proc

    def _start_control_plane(self, tools: toolchain.ToolPaths) -> None:
        timeout = self.options.startup_timeout
        pki = self._pki = create_pki(self.workdir / "pki", SERVICE_IP)
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        etcd = self._spawn(
            "etcd",
            [
                str(tools["etcd"]),
                "--name=dev",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=dev=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self.server = f"https://127.0.0.1:{api_port}"
        self.kubeconfig.write_text(
            kubeconfig_yaml(self.server, pki.ca.cert, pki.admin, "kubernetes-admin")
        )
        etcd.wait_ready(
            lambda: httpx.get(f"{etcd_url}/health", timeout=1).json()["health"] == "true", timeout
        )
        apiserver = self._spawn(
            "kube-apiserver",
            [
                str(tools["kube-apiserver"]),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--cert-dir={self.workdir / 'apiserver'}",
                f"--tls-cert-file={pki.apiserver.cert}",
                f"--tls-private-key-file={pki.apiserver.key}",
                f"--client-ca-file={pki.ca.cert}",
                f"--service-account-key-file={pki.service_account_key}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                f"--enable-admission-plugins={ADMISSION_PLUGINS}",
                "--allow-privileged=true",
                # The `kubernetes` Service endpoint would be 127.0.0.1, which Endpoints reject.
                "--endpoint-reconciler-type=none",
                # Local nodes' "kubelet" (kubectl logs) is on 127.0.0.1; the node name does not
                # resolve.
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                f"--audit-policy-file={self._audit_policy()}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
            ],
        )
        self._api = connect(self.kubeconfig)
        apiserver.wait_ready(lambda: self.api.get_raw("/readyz").status_code == 200, timeout)

        component_kubeconfigs = {
            "kube-controller-manager": (pki.controller_manager, "system:kube-controller-manager"),
            "kube-scheduler": (pki.scheduler, "system:kube-scheduler"),
        }
        secure_ports: dict[str, int] = {}
        for name, (pair, user) in component_kubeconfigs.items():
            path = self.workdir / f"{name}.kubeconfig"
            path.write_text(kubeconfig_yaml(self.server, pki.ca.cert, pair, user))
            secure_ports[name] = free_port()
            common = [
                f"--kubeconfig={path}",
                f"--authentication-kubeconfig={path}",
                f"--authorization-kubeconfig={path}",
                "--bind-address=127.0.0.1",
                f"--secure-port={secure_ports[name]}",
                "--leader-elect=false",
                f"--cert-dir={self.workdir / name}",
            ]
            extra = (
                []
                if name == "kube-scheduler"
                else [
                    f"--service-account-private-key-file={pki.service_account_key}",
                    f"--root-ca-file={pki.ca.cert}",
                    "--use-service-account-credentials=true",
                    f"--cluster-signing-cert-file={pki.ca.cert}",
                    f"--cluster-signing-key-file={pki.ca.cert.with_suffix('.key')}",
                    "--controllers=*,-nodeipam",
                    f"--node-monitor-grace-period={self.node_monitor_grace_seconds}s",
                ]
            )
            self._spawn(name, [str(tools[name]), *common, *extra])
        kwok_port = free_port()
        self._spawn(
            "kwok",
            [
                str(tools["kwok"]),
                f"--kubeconfig={self.kubeconfig}",
                f"--config={tools.kwok_stages}",
                f"--manage-nodes-with-annotation-selector={fleet.KWOK_ANNOTATION}="
                f"{fleet.KWOK_ANNOTATION_VALUE}",
                f"--node-lease-duration-seconds={self.options.node_lease_seconds}",
                f"--cidr={KWOK_POD_CIDR}",
                "--node-ip=127.0.0.1",
                f"--server-address=127.0.0.1:{kwok_port}",
            ],
        )
        if self.options.prometheus:
            self.prometheus = Prometheus(
                tools["prometheus"],
                self.workdir / "prometheus",
                free_port(),
                self.server,
                pki.ca.cert,
                pki.admin,
            )
            self.processes.append(self.prometheus.process)
        insecure = ssl.create_default_context()
        insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
        health = {
            f"{name}": f"https://127.0.0.1:{port}/healthz" for name, port in secure_ports.items()
        }
        health["kwok"] = f"http://127.0.0.1:{kwok_port}/healthz"

        def answers(url: str) -> bool:
            return httpx.get(url, verify=insecure, timeout=1).status_code == 200

        for proc in self.processes[2:]:
            if proc.name in health:
                proc.wait_ready(functools.partial(answers, health[proc.name]), timeout)
            elif self.prometheus is not None and proc is self.prometheus.process:
                self.prometheus.wait_ready(timeout)
        # The namespace controller and the service-account controller must have run before a
        # pod can be created in `default`.
        self.api.wait_for(
            "the default service account",
            lambda: self.api.get_or_none("ServiceAccount", "default", "default"),
            timeout,
        )

    def _start_nodes(self, tools: toolchain.ToolPaths) -> None:
        opts = self.options
        self.fake_node_names = fleet.create_nodes(self.api, fleet.build_fleet(opts.node_groups))
        local = [
            fleet.build_node(
                f"local-{opts.local_product.short}-{i}",
                opts.local_product,
                opts.local_gpus_per_node,
                "zone-local",
                fake=False,
            )
            for i in range(opts.local_nodes)
        ]
        self.local_node_names = fleet.create_nodes(self.api, local)
        if local:
            self.runner = LocalPodRunner(
                KubeClient(self.api.credentials),  # its own connection pool for its own thread
                self.local_node_names,
                self.workdir / "pods",
                project_root=opts.project_root,
            )
            self.runner.start()
        self.wait_nodes_ready(self.fake_node_names + self.local_node_names, opts.startup_timeout)

    def wait_nodes_ready(self, names: Sequence[str], timeout: float) -> None:
        """One list per poll, so a fleet of thousands is waited on as cheaply as one node."""
        wanted = set(names)

        def all_ready() -> bool | None:
            ready = {
                n["metadata"]["name"] for n in self.api.list("Node") if condition_true(n, "Ready")
            }
            return True if wanted <= ready else None

        self.api.wait_for(f"{len(wanted)} nodes Ready", all_ready, timeout)

    # stop ------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop everything in reverse start order and delete the temp dir; safe to repeat."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        if self.runner is not None:
            self.runner.stop()
        for proc in reversed(self.processes):
            proc.stop(grace=10)
        if self._api is not None:
            self._api.close()
        kept = keep_pod_logs(self.workdir / "pods")
        if kept is not None:
            log.info("local pods' logs kept in %s", kept)
        shutil.rmtree(self.workdir, ignore_errors=True)
        atexit.unregister(self.stop)

    def restart_prometheus(self, timeout: float = 60) -> None:
        """Prometheus started again after a test stopped it (an outage), same data."""
        if self.prometheus is None:
            raise StartupError("this dev cluster runs no Prometheus")
        old = self.prometheus.process
        new = self.prometheus.restart(timeout)
        self.processes = [new if p is old else p for p in self.processes]

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def __enter__(self) -> DevCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ExistingCluster:
    """A cluster someone else runs, reached through a kubeconfig; nothing to start or stop.

    Harness-style parts are found rather than made: KWOK nodes by their `type=kwok` label,
    local nodes (whose pods some runner really runs, e.g. `kvfleet dev-cluster up` in another
    shell) by `kvfleet.io/local-node=true`, and Prometheus through $KVFLEET_PROMETHEUS_URL.
    """

    runner: LocalPodRunner | None = None  # the runner, if any, lives in another process

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.api = connect(kubeconfig)
        self.server = self.api.credentials.server
        self.fake_node_names = self._nodes(f"{fleet.FAKE_NODE_LABEL}=kwok")
        self.local_node_names = self._nodes(f"{fleet.LOCAL_NODE_LABEL}=true")
        url = os.environ.get(PROMETHEUS_URL_ENV)
        self.prometheus: PrometheusClient | None = PrometheusClient(url) if url else None

    def _nodes(self, selector: str) -> list[str]:
        return sorted(n["metadata"]["name"] for n in self.api.list("Node", label_selector=selector))

    @property
    def has_fake_nodes(self) -> bool:
        return bool(self.fake_node_names)

    def stop(self) -> None:
        self.api.close()


@contextlib.contextmanager
def dev_cluster(options: ClusterOptions | None = None) -> Iterator[DevCluster]:
    cluster = DevCluster(options).start()
    try:
        yield cluster
    finally:
        cluster.stop()
