"""Where a pool's pods may run, and why they are not running there.

Nodes are matched by the labels NVIDIA GPU feature discovery sets: `nvidia.com/gpu.product`
exactly, and `nvidia.com/gpu.memory` (MiB, an integer label) as a lower bound when the pool
states a GPU memory. `diagnose` turns pod conditions and container states into one reason a
user can act on, naming the GPU product instead of repeating the scheduler's node counts only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kvfleet.api import ServingPoolSpec
from kvfleet.api.podsettings import MEMORY_LABEL, PRODUCT_LABEL, REGION_LABEL
from kvfleet.api.quantity import parse_bytes

GPU_RESOURCE = "nvidia.com/gpu"
MIB = 1024 * 1024

# Container waiting reasons that will not resolve by waiting.
STUCK_WAITING = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)


def node_selector(spec: ServingPoolSpec) -> dict[str, str]:
    """The pool's own node labels (spec.pod.nodeSelector) and the GPU product and region."""
    selector = {**spec.pod.node_selector, PRODUCT_LABEL: spec.gpu.product}
    if spec.region is not None:
        selector[REGION_LABEL] = spec.region
    return selector


def min_memory_mib(spec: ServingPoolSpec) -> int | None:
    return None if spec.gpu.memory is None else parse_bytes(spec.gpu.memory) // MIB


def node_affinity(spec: ServingPoolSpec) -> dict[str, Any] | None:
    """spec.pod.affinity with the GPU memory bound (`Gt` is strict, hence the - 1) added to
    every required term: terms are alternatives, so each must carry it."""
    user = spec.pod.affinity.node_affinity if spec.pod.affinity is not None else None
    mib = min_memory_mib(spec)
    bound = ([{"key": MEMORY_LABEL, "operator": "Gt", "values": [str(mib - 1)]}]
             if mib is not None else [])
    affinity: dict[str, Any] = {}
    required = user.required_during_scheduling_ignored_during_execution if user else None
    if required is not None:
        terms = [{"matchExpressions": [e.to_wire() for e in t.match_expressions] + bound}
                 for t in required.node_selector_terms]
    else:
        terms = [{"matchExpressions": bound}] if bound else []
    if terms:
        affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": terms}
    if user is not None and user.preferred_during_scheduling_ignored_during_execution:
        affinity["preferredDuringSchedulingIgnoredDuringExecution"] = [
            t.to_wire() for t in user.preferred_during_scheduling_ignored_during_execution]
    return {"nodeAffinity": affinity} if affinity else None


GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def tolerations(spec: ServingPoolSpec | None = None) -> list[dict[str, Any]]:
    """GPU nodes are commonly tainted so that only GPU workloads land there; the pool adds
    its own (spec.pod.tolerations), e.g. a team's dedicated nodes."""
    found = [dict(GPU_TOLERATION)]
    for toleration in spec.pod.tolerations if spec is not None else []:
        wire = toleration.to_wire()
        if wire not in found:
            found.append(wire)
    return found


def placement_text(spec: ServingPoolSpec) -> str:
    text = f"{spec.gpu.count} free {GPU_RESOURCE} of product {spec.gpu.product}"
    mib = min_memory_mib(spec)
    if mib is not None:
        text += f" with at least {mib} MiB each"
    if spec.region is not None:
        text += f" in region {spec.region}"
    return text


@dataclass(frozen=True)
class Diagnosis:
    """Why some pods of a pool are not serving: a condition reason and a message."""

    reason: str
    message: str


def _condition(pod: dict[str, Any], cond_type: str) -> dict[str, Any] | None:
    conditions = pod.get("status", {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == cond_type), None)


def reason_line(message: str) -> str:
    """The line of a termination message that says why a container stopped.

    With `FallbackToLogsOnError` the message is the tail of the container's log, and a program
    that gives up says why last (`kvfleet serve` logs its start failure as its final line, a
    Python traceback ends with the exception). A structured log line (JSON with a string
    `msg`) is reduced to that text. Keeping one line also keeps the pool's condition and its
    event (cut at 1 KiB) from losing the reason behind earlier log lines.
    """
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return ""
    last = lines[-1]
    try:
        record = json.loads(last)
    except ValueError:
        return last
    text = record.get("msg") if isinstance(record, dict) else None
    return text if isinstance(text, str) and text else last


def _restarted_after_failure(state: dict[str, Any]) -> bool:
    """Running again after a failed exit and not ready yet: a crash loop between back-offs.

    The failure that caused the restart is still why the replica does not serve; without this
    the pool would flip between that reason and none at every restart.
    """
    last = (state.get("lastState") or {}).get("terminated") or {}
    return (
        "running" in (state.get("state") or {})
        and not state.get("ready")
        and int(state.get("restartCount") or 0) > 0
        and last.get("exitCode") not in (None, 0)
    )


def _exited_failing(state: dict[str, Any]) -> bool:
    """Terminated non-zero just now: an init container between its failure and the retry
    (the pod never gets to its containers)."""
    now = (state.get("state") or {}).get("terminated") or {}
    return now.get("exitCode") not in (None, 0)


def restarts(pods: Iterable[dict[str, Any]]) -> tuple[int, str]:
    """Container restarts over `pods` not being deleted (a crash, an OOM kill, a failed
    liveness probe), and the latest one in words: which pod and container, why, with its
    exit code."""
    total, latest, latest_at = 0, "", ""
    for pod in pods:
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue  # (going: a retry's new pods start from 0)
        for state in (pod.get("status") or {}).get("containerStatuses") or []:
            count = int(state.get("restartCount") or 0)
            if count == 0:
                continue
            total += count
            last = (state.get("lastState") or {}).get("terminated") or {}
            finished = str(last.get("finishedAt") or "")
            if finished >= latest_at:
                latest_at = finished
                latest = (f"pod {pod.get('metadata', {}).get('name')} container "
                          f"{state.get('name')} {last.get('reason') or 'restarted'}"
                          f" (exit code {last.get('exitCode', '?')})")
                detail = reason_line(last.get("message") or "")
                latest += f": {detail}" if detail else ""
    return total, latest


def _container_problem(pod: dict[str, Any]) -> tuple[str, str] | None:
    status = pod.get("status", {})
    for kind, states in (("init container", status.get("initContainerStatuses") or []),
                         ("container", status.get("containerStatuses") or [])):
        for state in states:
            waiting = (state.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in STUCK_WAITING:
                reason = str(waiting["reason"])
            elif _restarted_after_failure(state) or (kind == "init container"
                                                     and _exited_failing(state)):
                reason = "CrashLoopBackOff"
            else:
                continue
            last = ((state.get("state") or {}).get("terminated")
                    or (state.get("lastState") or {}).get("terminated") or {})
            detail = reason_line(last.get("message") or waiting.get("message") or "")
            exit_code = last.get("exitCode")
            text = f"{kind} {state.get('name')} {reason}"
            if exit_code is not None:
                text += f" (last exit code {exit_code})"
            return reason, f"{text}: {detail}" if detail else text
    return None


def pod_problem(pod: dict[str, Any]) -> tuple[str, str] | None:
    """What keeps one pod from serving that waiting will not fix: (reason, detail), or None.

    A pod being deleted has no problem of its own: its replacement is what matters.
    """
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return None
    scheduled = _condition(pod, "PodScheduled")
    if (
        scheduled is not None
        and scheduled.get("status") == "False"
        and scheduled.get("reason") == "Unschedulable"
    ):
        return "Unschedulable", str(scheduled.get("message", "")).strip()
    return _container_problem(pod)


def unschedulable_since(pods: list[dict[str, Any]]) -> tuple[int, float | None]:
    """How many live pods the scheduler could not place, and since when (unix time) the
    oldest of them has been so: replicas that wait for a GPU, not for their engine."""
    since = []
    for pod in pods:
        problem = pod_problem(pod)
        if problem is not None and problem[0] == "Unschedulable":
            stamp = str((_condition(pod, "PodScheduled") or {}).get("lastTransitionTime", ""))
            try:
                since.append(datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(
                    tzinfo=UTC).timestamp())
            except ValueError:
                since.append(float("inf"))  # (no time: counted, never past a grace)
    return len(since), min(since, default=None)


def diagnose(spec: ServingPoolSpec, pods: list[dict[str, Any]]) -> Diagnosis | None:
    """The most important problem among the pods (unschedulable first), or None."""
    live = [p for p in pods if not p.get("metadata", {}).get("deletionTimestamp")]
    problems = [(p, problem) for p in live if (problem := pod_problem(p)) is not None]
    unschedulable = [detail for _, (reason, detail) in problems if reason == "Unschedulable"]
    if unschedulable:
        return Diagnosis(
            "Unschedulable",
            f"no node with {placement_text(spec)}: {len(unschedulable)} of {len(live)} pod(s) "
            f"pending (scheduler: {unschedulable[0]})",
        )
    if not problems:
        return None
    pod, (reason, message) = problems[0]
    return Diagnosis(reason, f"pod {pod['metadata']['name']}: {message}")
