"""The local pod runner: a kubelet for our own commands.

It owns one or more "local" GPU nodes (KWOK does not manage them). Every pod bound to them runs
for real: each container's command + args start as a local process (`kvfleet` and `python`
resolve to the project's virtualenv), the pod gets an IP from a loopback range that the process
binds to, and the runner reports phase, podIP, container states and the Ready condition from
the pod's own readiness probe. Containers restart per restartPolicy; deleting a pod sends
SIGTERM, waits the grace period, then removes the pod object.

What a real kubelet does that this one does not: images, volumes, resource isolation,
startup probes, `kubectl logs/exec` (container output goes to files under the pod's folder).
Init containers run in order before the containers, as in Kubernetes.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import ipaddress
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from kvfleet.devcluster.errors import DevClusterError, KubeApiError
from kvfleet.devcluster.kube import JsonObj, KubeClient
from kvfleet.devcluster.processes import ManagedProcess

log = logging.getLogger(__name__)

POD_CIDR = "127.64.0.0/16"
HEARTBEAT_S = 10.0
LEASE_DURATION_S = 40
TOKEN_SECONDS = 24 * 3600  # outlives any test session or dev-cluster day
BACKOFF_MAX_S = 10.0  # a real kubelet caps at 5 min; tests want crashes retried quickly


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class IpPool:
    """Hands out loopback addresses from one /24 of `cidr`; returned addresses are reused.

    Several harnesses may run on one machine at once (two test sessions, a dev cluster), and a
    pod spec fixes its port, so each pool claims its own /24 with an exclusive lock file that it
    holds for its lifetime: two pools never hand out the same address.
    """

    def __init__(self, cidr: str = POD_CIDR) -> None:
        network = ipaddress.ip_network(cidr)
        lock_dir = Path(tempfile.gettempdir()) / "kvfleet-pod-ip-blocks"
        lock_dir.mkdir(exist_ok=True)
        self._lock_file: IO[bytes] | None = None
        for block in network.subnets(new_prefix=24):
            handle = (lock_dir / f"{block.network_address}.lock").open("ab")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            self._lock_file, self.block = handle, block
            break
        else:
            raise DevClusterError(f"every /24 of {cidr} is claimed by another harness")
        self._hosts = self.block.hosts()
        self._free: list[str] = []
        self._lock = threading.Lock()

    def take(self) -> str:
        with self._lock:
            if self._free:
                return self._free.pop()
            try:
                return str(next(self._hosts))
            except StopIteration:
                raise DevClusterError(f"local pod IP block {self.block} exhausted") from None

    def give_back(self, ip: str) -> None:
        with self._lock:
            self._free.append(ip)

    def close(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None


_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command/args/env: unknown references stay as written."""
    return _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)


@dataclass
class Container:
    """One container of a pod and the process that currently plays it."""

    spec: JsonObj
    init: bool = False
    process: ManagedProcess | None = None
    restart_count: int = 0
    started_at: str | None = None
    exit_code: int | None = None
    finished_at: str | None = None
    last_terminated: JsonObj | None = None
    next_start: float = 0.0
    ready: bool = False
    done: bool = False  # exited and will not be restarted
    start_error: str | None = None
    probe_due: float = 0.0
    probe_failures: int = 0
    live_due: float = 0.0
    live_failures: int = 0

    @property
    def name(self) -> str:
        return str(self.spec["name"])


@dataclass
class LocalPod:
    uid: str
    namespace: str
    name: str
    node: str
    ip: str
    folder: Path
    containers: list[Container]
    init_containers: list[Container]
    start_time: str = field(default_factory=now_iso)
    terminating_since: float | None = None
    last_status: JsonObj | None = None


class LocalPodRunner:
    """Runs the pods bound to `node_names` until stop(); one background thread. The runner
    owns `api` and closes it on stop()."""

    def __init__(
        self,
        api: KubeClient,
        node_names: list[str],
        workdir: Path,
        *,
        project_root: Path,
        env: dict[str, str] | None = None,
        poll_interval: float = 0.3,
    ) -> None:
        self.api = api
        self.node_names = list(node_names)
        self.workdir = workdir
        self.project_root = project_root
        self.extra_env = dict(env or {})
        self.poll_interval = poll_interval
        self.ips = IpPool()
        self.pods: dict[str, LocalPod] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_heartbeat = 0.0
        self._since = now_iso()  # the nodes' conditions have held since the runner started
        self._http = httpx.Client(timeout=1.0)

    # lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.heartbeat()
        self._thread = threading.Thread(target=self._loop, name="local-pod-runner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and every pod process (SIGTERM, grace, SIGKILL); no API writes."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for pod in list(self.pods.values()):
            for c in pod.init_containers + pod.containers:
                if c.process is not None:
                    c.process.stop(grace=5)
        self.pods.clear()
        self._http.close()
        self.ips.close()
        self.api.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                self.sync_once()
            except Exception:  # one bad round must not kill the kubelet
                log.exception("local pod runner sync failed")

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        return self.workdir / f"{namespace}_{pod}" / f"{container}.log"

    # node ------------------------------------------------------------------------------------
    def heartbeat(self) -> None:
        now = now_iso()
        for node in self.node_names:
            lease = {
                "holderIdentity": node,
                "leaseDurationSeconds": LEASE_DURATION_S,
                "renewTime": _micro_now(),
            }
            try:
                self.api.merge_patch("Lease", node, {"spec": lease}, "kube-node-lease")
            except KubeApiError as exc:
                if exc.status != 404:
                    raise
                self.api.create(
                    {
                        "apiVersion": "coordination.k8s.io/v1",
                        "kind": "Lease",
                        "metadata": {"name": node, "namespace": "kube-node-lease"},
                        "spec": lease,
                    }
                )
            self.api.merge_patch(
                "Node", node, {"status": _node_status(node, now, self._since)}, subresource="status"
            )
        self._next_heartbeat = time.monotonic() + HEARTBEAT_S

    # pods ------------------------------------------------------------------------------------
    def sync_once(self) -> None:
        if time.monotonic() >= self._next_heartbeat:
            self.heartbeat()
        seen: set[str] = set()
        for node in self.node_names:
            for obj in self.api.list("Pod", field_selector=f"spec.nodeName={node}"):
                uid = obj["metadata"]["uid"]
                seen.add(uid)
                pod = self.pods.get(uid)
                if pod is None:
                    if obj.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                        continue
                    pod = self._admit(obj, node)
                try:
                    self._sync_pod(pod, obj)
                except Exception:  # one broken pod must not stall the others
                    log.exception("local pod %s/%s: sync failed", pod.namespace, pod.name)
        for uid in set(self.pods) - seen:  # removed behind our back (force delete)
            self._kill(self.pods.pop(uid), grace=0)

    def _admit(self, obj: JsonObj, node: str) -> LocalPod:
        meta, spec = obj["metadata"], obj["spec"]
        pod = LocalPod(
            uid=meta["uid"],
            namespace=meta["namespace"],
            name=meta["name"],
            node=node,
            ip=self.ips.take(),
            folder=self.workdir / f"{meta['namespace']}_{meta['name']}",
            containers=[Container(c) for c in spec.get("containers", [])],
            init_containers=[Container(c, init=True) for c in spec.get("initContainers", [])],
        )
        pod.folder.mkdir(parents=True, exist_ok=True)
        self.pods[pod.uid] = pod
        return pod

    def _sync_pod(self, pod: LocalPod, obj: JsonObj) -> None:
        meta, spec = obj["metadata"], obj["spec"]
        if meta.get("deletionTimestamp"):
            self._terminate(pod, int(meta.get("deletionGracePeriodSeconds") or 0))
            return
        policy = spec.get("restartPolicy", "Always")
        pending_init = [c for c in pod.init_containers if not (c.done and c.exit_code == 0)]
        active = pending_init[:1] if pending_init else pod.containers
        for c in active:
            self._drive(pod, obj, c, "OnFailure" if c.init and policy == "Always" else policy)
        self._report(pod, obj)

    def _drive(self, pod: LocalPod, obj: JsonObj, c: Container, policy: str) -> None:
        now = time.monotonic()
        if c.process is not None and not c.process.running():
            c.exit_code = c.process.stop()
            c.finished_at, c.process, c.ready = now_iso(), None, False
            c.last_terminated = _terminated(c)
            if policy == "Always" or (policy == "OnFailure" and c.exit_code != 0):
                backoff = min(BACKOFF_MAX_S, 2.0 ** min(c.restart_count, 4))
                c.next_start, c.restart_count = now + backoff, c.restart_count + 1
            else:
                c.done = True
        if c.process is None and not c.done and now >= c.next_start:
            try:
                self._start(pod, obj, c)
                c.start_error = None
            except (DevClusterError, KubeApiError) as exc:
                # As a kubelet does with an unstartable container: report it, retry with backoff.
                c.start_error = str(exc)
                c.next_start = now + min(BACKOFF_MAX_S, 2.0 ** min(c.restart_count, 4))
                c.restart_count += 1
        if c.process is not None and not c.init:
            self._probe(pod, obj, c, now)

    def _start(self, pod: LocalPod, obj: JsonObj, c: Container) -> None:
        env = self._env(pod, obj, c.spec)
        argv = [expand(a, env) for a in [*c.spec.get("command", []), *c.spec.get("args", [])]]
        if not argv:
            raise DevClusterError(
                f"pod {pod.namespace}/{pod.name} container {c.name}: no command; the local "
                "runner has no images, so set `command`"
            )
        argv[0] = self._resolve(argv[0])
        workdir = Path(c.spec.get("workingDir") or pod.folder)
        c.process = ManagedProcess(
            f"{pod.name}/{c.name}",
            argv,
            self.log_path(pod.namespace, pod.name, c.name),
            env=env,
            cwd=workdir,
        )
        c.started_at, c.exit_code, c.finished_at, c.ready = now_iso(), None, None, False
        c.probe_failures = c.live_failures = 0
        delay = float(c.spec.get("readinessProbe", {}).get("initialDelaySeconds", 0))
        c.probe_due = time.monotonic() + delay
        live_delay = float(c.spec.get("livenessProbe", {}).get("initialDelaySeconds", 0))
        c.live_due = time.monotonic() + live_delay

    def _resolve(self, program: str) -> str:
        venv_bin = self.project_root / ".venv" / "bin"
        if program in ("python", "python3") or program == "kvfleet":
            candidate = venv_bin / program
            if candidate.exists():
                return str(candidate)
            return sys.executable if program != "kvfleet" else str(venv_bin / "kvfleet")
        return shutil.which(program) or program

    def _env(self, pod: LocalPod, obj: JsonObj, spec: JsonObj) -> dict[str, str]:
        # The harness's own environment plus the pod's: the processes are ours, on this machine.
        env = {**os.environ, **self.extra_env, "HOSTNAME": pod.name}
        venv_bin = str(self.project_root / ".venv" / "bin")
        env["PATH"] = f"{venv_bin}:{env.get('PATH', '/usr/bin:/bin')}"
        env["PYTHONPATH"] = str(self.project_root)
        env.pop("KUBECONFIG", None)
        if obj["spec"].get("automountServiceAccountToken", True):
            env.update(self._service_account_env(pod, obj))
        fields = {
            "status.podIP": pod.ip,
            "status.hostIP": "127.0.0.1",
            "metadata.name": pod.name,
            "metadata.namespace": pod.namespace,
            "metadata.uid": pod.uid,
            "spec.nodeName": pod.node,
            "spec.serviceAccountName": obj["spec"].get("serviceAccountName", "default"),
        }
        for item in spec.get("env", []):
            name = item["name"]
            if "value" in item:
                env[name] = expand(str(item["value"]), env)
            elif "fieldRef" in item.get("valueFrom", {}):
                env[name] = fields.get(item["valueFrom"]["fieldRef"]["fieldPath"], "")
            elif ref := item.get("valueFrom", {}).get("configMapKeyRef"):
                cm = self.api.get("ConfigMap", ref["name"], pod.namespace)
                env[name] = cm.get("data", {}).get(ref["key"], "")
            elif ref := item.get("valueFrom", {}).get("secretKeyRef"):
                import base64

                secret = self.api.get("Secret", ref["name"], pod.namespace)
                env[name] = base64.b64decode(secret.get("data", {}).get(ref["key"], "")).decode()
        return env

    def _service_account_env(self, pod: LocalPod, obj: JsonObj) -> dict[str, str]:
        """In-cluster credentials: a token of the pod's service account, bound to the pod.

        There is no /var/run/secrets mount, so the token reaches the process as a kubeconfig
        ($KUBECONFIG, which kopf and the kubernetes client read) plus the usual
        KUBERNETES_SERVICE_HOST/PORT; the process then has exactly its RBAC permissions.
        """
        account = obj["spec"].get("serviceAccountName") or "default"
        review = self.api.request(
            "POST",
            f"/api/v1/namespaces/{pod.namespace}/serviceaccounts/{account}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "expirationSeconds": TOKEN_SECONDS,
                    "boundObjectRef": {
                        "kind": "Pod",
                        "apiVersion": "v1",
                        "name": pod.name,
                        "uid": pod.uid,
                    },
                },
            },
        )
        server = self.api.config.server
        ca = self.api.config.ca_file
        kubeconfig = pod.folder / "serviceaccount.kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: in-cluster\n"
            f"clusters:\n- name: in-cluster\n  cluster:\n    server: {server}\n"
            + (f"    certificate-authority: {ca}\n" if ca else "")
            + f"users:\n- name: {account}\n  user:\n    token: {review['status']['token']}\n"
            "contexts:\n- name: in-cluster\n  context:\n    cluster: in-cluster\n"
            f"    user: {account}\n    namespace: {pod.namespace}\n"
        )
        kubeconfig.chmod(0o600)
        host, _, port = server.removeprefix("https://").rpartition(":")
        return {
            "KUBECONFIG": str(kubeconfig),
            "KUBERNETES_SERVICE_HOST": host,
            "KUBERNETES_SERVICE_PORT": port,
        }

    def _probe(self, pod: LocalPod, obj: JsonObj, c: Container, now: float) -> None:
        readiness, liveness = c.spec.get("readinessProbe"), c.spec.get("livenessProbe")
        if readiness is None:
            c.ready = True
        elif now >= c.probe_due:
            c.probe_due = now + float(readiness.get("periodSeconds", 10))
            if self._check(pod, c, readiness):
                c.probe_failures, c.ready = 0, True
            else:
                c.probe_failures += 1
                if c.probe_failures >= int(readiness.get("failureThreshold", 3)) or not c.ready:
                    c.ready = False
        if liveness is not None and now >= c.live_due and c.process is not None:
            c.live_due = now + float(liveness.get("periodSeconds", 10))
            c.live_failures = 0 if self._check(pod, c, liveness) else c.live_failures + 1
            if c.live_failures >= int(liveness.get("failureThreshold", 3)):
                grace = int(obj["spec"].get("terminationGracePeriodSeconds", 30))
                c.process.stop(grace=grace)  # the next round sees the exit and restarts

    def _check(self, pod: LocalPod, c: Container, probe: JsonObj) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        if http := probe.get("httpGet"):
            host = http.get("host") or pod.ip
            port = _port(c.spec, http["port"])
            scheme = str(http.get("scheme", "HTTP")).lower()
            try:
                resp = self._http.get(
                    f"{scheme}://{host}:{port}{http.get('path', '/')}", timeout=timeout
                )
            except httpx.HTTPError:
                return False
            return 200 <= resp.status_code < 400
        if tcp := probe.get("tcpSocket"):
            try:
                with socket.create_connection(
                    (tcp.get("host") or pod.ip, _port(c.spec, tcp["port"])), timeout
                ):
                    return True
            except OSError:
                return False
        if exec_ := probe.get("exec"):
            try:
                done = subprocess.run(
                    exec_["command"],
                    timeout=timeout,
                    capture_output=True,
                    check=False,
                    cwd=pod.folder,
                )
            except (OSError, subprocess.TimeoutExpired):
                return False
            return done.returncode == 0
        return True

    def _terminate(self, pod: LocalPod, grace: int) -> None:
        if pod.terminating_since is None:
            pod.terminating_since = time.monotonic()
            for c in pod.init_containers + pod.containers:
                if c.process is not None:
                    c.process.signal(signal.SIGTERM)
        running = [
            c
            for c in pod.init_containers + pod.containers
            if c.process is not None and c.process.running()
        ]
        if running and time.monotonic() - pod.terminating_since < grace:
            return
        self._kill(pod, grace=0)
        self.pods.pop(pod.uid, None)
        try:
            self.api.request(
                "DELETE",
                f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}",
                {
                    "kind": "DeleteOptions",
                    "apiVersion": "v1",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": pod.uid},
                },
            )
        except KubeApiError as exc:
            if exc.status not in (404, 409):
                raise

    def _kill(self, pod: LocalPod, grace: float) -> None:
        for c in pod.init_containers + pod.containers:
            if c.process is not None:
                c.exit_code = c.process.stop(grace=grace)
                c.process = None
        self.ips.give_back(pod.ip)

    # status ----------------------------------------------------------------------------------
    def _report(self, pod: LocalPod, obj: JsonObj) -> None:
        status = pod_status(pod, obj.get("status", {}))
        if status == pod.last_status:
            return
        self.api.merge_patch(
            "Pod", pod.name, {"status": status}, pod.namespace, subresource="status"
        )
        pod.last_status = status


def _port(container: JsonObj, port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise DevClusterError(f"container {container['name']}: probe names unknown port {port!r}")


def _terminated(c: Container) -> JsonObj:
    reason = "Completed" if c.exit_code == 0 else "Error"
    return {
        "terminated": {
            "exitCode": c.exit_code,
            "reason": reason,
            "startedAt": c.started_at,
            "finishedAt": c.finished_at,
        }
    }


def _container_status(c: Container) -> JsonObj:
    state: JsonObj
    if c.process is not None:
        state = {"running": {"startedAt": c.started_at}}
    elif c.done:
        state = _terminated(c)
    elif c.start_error:
        state = {"waiting": {"reason": "RunContainerError", "message": c.start_error}}
    elif c.restart_count:
        state = {"waiting": {"reason": "CrashLoopBackOff"}}
    else:
        state = {"waiting": {"reason": "ContainerCreating"}}
    status: JsonObj = {
        "name": c.name,
        "image": c.spec.get("image", ""),
        "imageID": "",
        "containerID": f"local://{c.process.pid}" if c.process else "",
        "ready": c.ready and c.process is not None,
        "started": c.process is not None,
        "restartCount": c.restart_count,
        "state": state,
        "lastState": c.last_terminated or {},
    }
    return status


def pod_status(pod: LocalPod, current: JsonObj) -> JsonObj:
    """The pod's status as a kubelet would write it; a pure function of the runner's state."""
    mains, inits = pod.containers, pod.init_containers
    init_ok = all(c.done and c.exit_code == 0 for c in inits)
    if any(c.done and c.exit_code != 0 for c in inits) or (
        mains and all(c.done for c in mains) and any(c.exit_code != 0 for c in mains)
    ):
        phase = "Failed"
    elif mains and all(c.done for c in mains):
        phase = "Succeeded"
    elif init_ok and any(c.process is not None or c.done or c.started_at for c in mains):
        phase = "Running"
    else:
        phase = "Pending"
    ready = init_ok and all(c.ready and c.process is not None for c in mains)
    old = {c.get("type"): c for c in current.get("conditions") or []}

    def cond(kind: str, ok: bool) -> JsonObj:
        value = "True" if ok else "False"
        prior = old.get(kind)
        since = prior["lastTransitionTime"] if prior and prior.get("status") == value else None
        return {"type": kind, "status": value, "lastTransitionTime": since or now_iso()}

    conditions = [
        cond("PodReadyToStartContainers", True),
        cond("Initialized", init_ok),
        cond("ContainersReady", ready),
        cond("Ready", ready),
    ]
    if "PodScheduled" in old:
        conditions.insert(0, old["PodScheduled"])
    status: JsonObj = {
        "phase": phase,
        "hostIP": "127.0.0.1",
        "hostIPs": [{"ip": "127.0.0.1"}],
        "podIP": pod.ip,
        "podIPs": [{"ip": pod.ip}],
        "startTime": pod.start_time,
        "conditions": conditions,
        "containerStatuses": [_container_status(c) for c in mains],
    }
    if inits:
        status["initContainerStatuses"] = [_container_status(c) for c in inits]
    return status


def _node_status(node: str, now: str, since: str) -> dict[str, Any]:
    def cond(kind: str, value: str, reason: str) -> JsonObj:
        return {
            "type": kind,
            "status": value,
            "reason": reason,
            "message": reason,
            "lastHeartbeatTime": now,
            "lastTransitionTime": since,
        }

    return {
        "conditions": [
            cond("Ready", "True", "KubeletReady"),
            cond("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            cond("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            cond("PIDPressure", "False", "KubeletHasSufficientPID"),
        ],
        "addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": node},
        ],
        "nodeInfo": {
            "kubeletVersion": "v1.34.4-kvfleet-local",
            "operatingSystem": "linux",
            "architecture": "amd64",
            "containerRuntimeVersion": "local://process",
            "kernelVersion": "",
            "osImage": "",
            "kubeProxyVersion": "",
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
        },
    }
