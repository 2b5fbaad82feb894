"""What the local pod runner knows about its pods, and the status it writes for them.

Pure: `pod_status` and `node_status` turn the runner's bookkeeping into the Pod and Node status
a kubelet would write, and `termination_message` decides a finished container's message;
nothing here starts processes, reads files or talks to the API server.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfleet.devcluster.kube import JsonObj
from kvfleet.devcluster.processes import ManagedProcess


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# A kubelet's cap on the log fallback of a termination message (kubecontainer's
# MaxContainerTerminationMessageLogLines / ...LogLength): the last 80 lines, at most 2 KiB.
TERMINATION_LOG_LINES = 80
TERMINATION_LOG_BYTES = 2048

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
    termination_message: str | None = None
    log_offset: int = 0  # where the current run's output starts in the container's log file
    last_terminated: JsonObj | None = None
    next_start: float = 0.0
    ready: bool = False
    done: bool = False  # exited and will not be restarted
    start_error: str | None = None
    kill_at: float | None = None  # monotonic deadline after a failed liveness probe
    probe_due: float = 0.0
    probe_failures: int = 0
    live_due: float = 0.0
    live_failures: int = 0
    cpus: frozenset[int] | None = None  # pinned to (from limits.cpu); None: all

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
    secrets_synced: float = 0.0  # monotonic time its secret volumes were last written


def falls_back_to_logs(spec: JsonObj, exit_code: int | None) -> bool:
    """Whether a kubelet would take this exit's termination message from the container's log.

    Only under `terminationMessagePolicy: FallbackToLogsOnError` and only for a failure; the
    local runner has no per-container filesystem, so there is no `/dev/termination-log` file
    that could take precedence.
    """
    failed = exit_code is not None and exit_code != 0
    return failed and spec.get("terminationMessagePolicy") == "FallbackToLogsOnError"


def termination_message(output_tail: bytes) -> str:
    """A kubelet's log fallback: the last 80 lines of the run's output, then its last 2 KiB.

    `output_tail` may be just the end of the output: any suffix of at least
    TERMINATION_LOG_BYTES gives the same message.
    """
    lines = output_tail.splitlines(keepends=True)[-TERMINATION_LOG_LINES:]
    return b"".join(lines)[-TERMINATION_LOG_BYTES:].decode(errors="replace")


def terminated_state(c: Container) -> JsonObj:
    reason = "Completed" if c.exit_code == 0 else "Error"
    terminated: JsonObj = {
        "exitCode": c.exit_code,
        "reason": reason,
        "startedAt": c.started_at,
        "finishedAt": c.finished_at,
    }
    if c.termination_message:
        terminated["message"] = c.termination_message
    return {"terminated": terminated}


def container_status(c: Container) -> JsonObj:
    state: JsonObj
    if c.process is not None:
        state = {"running": {"startedAt": c.started_at}}
    elif c.done:
        state = terminated_state(c)
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
        "containerStatuses": [container_status(c) for c in mains],
    }
    if inits:
        status["initContainerStatuses"] = [container_status(c) for c in inits]
    return status


def node_status(node: str, now: str, since: str, kubelet_port: int) -> dict[str, Any]:
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
        # Where the apiserver finds this node's kubelet (kvfleet.devcluster.kubeletlogs).
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
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
