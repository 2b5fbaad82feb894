"""The local pod runner: a kubelet for our own commands.

It owns one or more "local" GPU nodes (KWOK does not manage them). Every pod bound to them runs
for real: each container's command + args start as a local process (`kvfleet` and `python`
resolve to the project's virtualenv), the pod gets an IP from a loopback range that the process
binds to, and the runner reports phase, podIP, container states and the Ready condition from
the pod's own readiness probe. Containers restart per restartPolicy; deleting a pod sends
SIGTERM, waits the grace period, then removes the pod object.

A container that fails under `terminationMessagePolicy: FallbackToLogsOnError` gets the tail of
its output as `state.terminated.message` (and `lastState` once restarted), as a kubelet does.

A container's `resources.limits.cpu` pins its process to that many whole CPUs (those the
fewest running containers hold), where a kubelet would set a CFS quota: several engines on a
small host then each size their threads to their share instead of all of them to every core.

What a real kubelet does that this one does not: images, volumes other than emptyDir and
secret (see `podenv`: a mount is seen through rewritten paths; sizeLimit is not enforced),
memory limits and CPU quotas (see above for CPU limits), startup probes, `kubectl exec`,
termination-message files (`terminationMessagePath`: there is no per-container filesystem).
Container output goes to files under the pod's folder; `kubectl logs` reads them through
kvfleet.devcluster.kubeletlogs, and the cluster keeps them after teardown (DevCluster.stop).
Init containers run in order before the containers, as in Kubernetes.

The loop and process handling live here; the pure status (`podstate`), the process environment
(`podenv`) and probes (`probes`) are their own modules.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import ipaddress
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import IO

import httpx

from kvfleet.devcluster.errors import DevClusterError, KubeApiError
from kvfleet.devcluster.kube import JsonObj, KubeClient
from kvfleet.devcluster.kubeletlogs import KubeletLogServer
from kvfleet.devcluster.podenv import (
    SECRET_SYNC_SECONDS,
    container_env,
    cpu_limit,
    mounted,
    mounts,
    pick_cpus,
    resolve_program,
    sync_secret_volumes,
    volume_folder,
)
from kvfleet.devcluster.podstate import (
    TERMINATION_LOG_BYTES,
    Container,
    LocalPod,
    expand,
    falls_back_to_logs,
    node_status,
    now_iso,
    pod_status,
    terminated_state,
    termination_message,
)
from kvfleet.devcluster.probes import run_probe
from kvfleet.devcluster.processes import ManagedProcess

log = logging.getLogger(__name__)

POD_CIDR = "127.64.0.0/16"
HEARTBEAT_S = 10.0
LEASE_DURATION_S = 40
BACKOFF_MAX_S = 10.0  # a real kubelet caps at 5 min; tests want crashes retried quickly


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def container_exit_code(returncode: int | None) -> int | None:
    """Popen reports death by signal N as -N; container runtimes report 128 + N."""
    return 128 - returncode if returncode is not None and returncode < 0 else returncode


def read_output_tail(path: Path, start: int, num_bytes: int = TERMINATION_LOG_BYTES) -> bytes:
    """The last `num_bytes` a run wrote to its log, which begins at offset `start`.

    The log file is shared by a container's restarts (appended to), so a run's output is
    what lies past the size the file had when it started.
    """
    try:
        with path.open("rb") as log_file:
            size = log_file.seek(0, 2)
            log_file.seek(max(start, size - num_bytes))
            return log_file.read(num_bytes)
    except FileNotFoundError:
        return b""


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
        # (as a kubelet's, its HTTPS probes check no certificate)
        self._http = httpx.Client(timeout=1.0, verify=False)
        # `kubectl logs` reaches container output through this, as through a kubelet.
        self.logs = KubeletLogServer(workdir / ".kubelet", self.log_path, self._has_pod)

    # lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.logs.start()
        self.heartbeat()
        self._thread = threading.Thread(target=self._loop, name="local-pod-runner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and every pod process (SIGTERM, grace, SIGKILL); no API writes."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        processes = [
            c.process
            for pod in self.pods.values()
            for c in pod.init_containers + pod.containers
            if c.process is not None
        ]
        for proc in processes:  # all at once, so N pods take one grace period, not N
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in processes:
            proc.stop(grace=max(0.0, deadline - time.monotonic()))
        self.pods.clear()
        self.logs.stop()
        self._http.close()
        self.ips.close()
        self.api.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                self.sync_once()
            except Exception:  # one bad round must not kill the kubelet
                log.exception("local pod runner sync failed")

    def _has_pod(self, namespace: str, name: str) -> bool:
        return any(p.namespace == namespace and p.name == name for p in list(self.pods.values()))

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
                "Node", node, {"status": node_status(node, now, self._since, self.logs.port)},
                subresource="status"
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
        if pod.secrets_synced and time.monotonic() - pod.secrets_synced >= SECRET_SYNC_SECONDS:
            pod.secrets_synced = time.monotonic()
            try:
                sync_secret_volumes(self.api, pod, obj)
            except DevClusterError as exc:  # a kubelet keeps the files it has, and says why
                log.warning("local pod %s/%s: secret volume not refreshed: %s", pod.namespace,
                            pod.name, exc)
        policy = spec.get("restartPolicy", "Always")
        pending_init = [c for c in pod.init_containers if not (c.done and c.exit_code == 0)]
        active = pending_init[:1] if pending_init else pod.containers
        for c in active:
            self._drive(pod, obj, c, "OnFailure" if c.init and policy == "Always" else policy)
        self._report(pod, obj)

    def _drive(self, pod: LocalPod, obj: JsonObj, c: Container, policy: str) -> None:
        now = time.monotonic()
        if c.process is not None and c.kill_at is not None and now >= c.kill_at:
            c.process.signal(signal.SIGKILL)
        if c.process is not None and not c.process.running():
            c.exit_code = container_exit_code(c.process.stop())
            c.finished_at, c.process, c.ready = now_iso(), None, False
            if falls_back_to_logs(c.spec, c.exit_code):
                log_path = self.log_path(pod.namespace, pod.name, c.name)
                c.termination_message = termination_message(
                    read_output_tail(log_path, c.log_offset)
                )
            c.last_terminated = terminated_state(c)
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
        sync_secret_volumes(self.api, pod, obj)  # (a missing Secret: the start fails)
        pod.secrets_synced = time.monotonic()
        env = container_env(self.api, pod, obj, c.spec, self.project_root, self.extra_env)
        where = mounts(pod, obj, c.spec)
        argv = [mounted(expand(a, env), where)
                for a in [*c.spec.get("command", []), *c.spec.get("args", [])]]
        if not argv:
            raise DevClusterError(
                f"pod {pod.namespace}/{pod.name} container {c.name}: no command; the local "
                "runner has no images, so set `command`"
            )
        argv[0] = resolve_program(argv[0], self.project_root)
        workdir = Path(c.spec.get("workingDir") or pod.folder)
        log_path = self.log_path(pod.namespace, pod.name, c.name)
        c.log_offset = log_path.stat().st_size if log_path.exists() else 0
        wanted = cpu_limit(c.spec)
        c.cpus = None if wanted is None else pick_cpus(
            wanted, sorted(os.sched_getaffinity(0)), self._pinned())
        c.process = ManagedProcess(f"{pod.name}/{c.name}", argv, log_path, env=env, cwd=workdir,
                                   cpus=c.cpus)
        c.started_at, c.exit_code, c.finished_at, c.ready = now_iso(), None, None, False
        c.termination_message = None
        c.probe_failures = c.live_failures = 0
        c.kill_at = None
        delay = float(c.spec.get("readinessProbe", {}).get("initialDelaySeconds", 0))
        c.probe_due = time.monotonic() + delay
        live_delay = float(c.spec.get("livenessProbe", {}).get("initialDelaySeconds", 0))
        c.live_due = time.monotonic() + live_delay

    def _pinned(self) -> Counter[int]:
        """How many running containers are pinned to each CPU."""
        return Counter(cpu for pod in list(self.pods.values())
                       for c in [*pod.init_containers, *pod.containers]
                       if c.process is not None and c.process.running() for cpu in c.cpus or ())

    def _probe(self, pod: LocalPod, obj: JsonObj, c: Container, now: float) -> None:
        readiness, liveness = c.spec.get("readinessProbe"), c.spec.get("livenessProbe")
        if readiness is None:
            c.ready = True
        elif now >= c.probe_due:
            c.probe_due = now + float(readiness.get("periodSeconds", 10))
            if run_probe(self._http, pod, c.spec, readiness):
                c.probe_failures, c.ready = 0, True
            else:
                c.probe_failures += 1
                if c.probe_failures >= int(readiness.get("failureThreshold", 3)) or not c.ready:
                    c.ready = False
        if liveness is not None and now >= c.live_due and c.process is not None:
            c.live_due = now + float(liveness.get("periodSeconds", 10))
            c.live_failures = (
                0 if run_probe(self._http, pod, c.spec, liveness) else c.live_failures + 1
            )
            if c.live_failures >= int(liveness.get("failureThreshold", 3)) and c.kill_at is None:
                # SIGTERM now, SIGKILL after the grace period; the loop never blocks on a pod.
                grace = float(obj["spec"].get("terminationGracePeriodSeconds", 30))
                c.process.signal(signal.SIGTERM)
                c.kill_at = now + grace

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
                c.exit_code = container_exit_code(c.process.stop(grace=grace))
                c.process = None
        self.ips.give_back(pod.ip)
        shutil.rmtree(volume_folder(pod, ""), ignore_errors=True)  # emptyDirs go with the pod

    # status ----------------------------------------------------------------------------------
    def _report(self, pod: LocalPod, obj: JsonObj) -> None:
        status = pod_status(pod, obj.get("status", {}))
        if status == pod.last_status:
            return
        self.api.merge_patch(
            "Pod", pod.name, {"status": status}, pod.namespace, subresource="status"
        )
        pod.last_status = status
