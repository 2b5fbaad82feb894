"""Builders of what the apiserver would return for the operator's objects (unit tests only).

`as_observed` adds what the server adds (uid, generation, defaults, status), so drift tests see
objects that are supersets of what the operator sent, as on a real cluster.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

from kvfleet.api import ModelArtifact, ServingPool
from kvfleet.api.builders import make_artifact, make_pool

NOW = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)


def pool(name: str = "chat", **sets: Any) -> ServingPool:
    builder = make_pool(name).set("metadata.uid", f"uid-{name}").set("metadata.generation", 1)
    for path, value in sets.items():
        builder.set(path.replace("__", "."), value)
    return builder.obj()


def artifact(name: str = "qwen3-8b") -> ModelArtifact:
    return make_artifact(name).set("metadata.uid", f"uid-{name}").obj()


def as_observed(obj: dict[str, Any], *, ready: int | None = None) -> dict[str, Any]:
    """`obj` as read back: server metadata and defaults; Deployments with `ready` replicas."""
    out = copy.deepcopy(obj)
    meta = out["metadata"]
    meta.update(uid=f"uid-{meta['name']}", resourceVersion="7", generation=1)
    meta.setdefault("annotations", {})["deployment.kubernetes.io/revision"] = "1"
    if out["kind"] == "Deployment":
        out["spec"]["progressDeadlineSeconds"] = 600
        out["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["timeoutSeconds"] = 1
        want = out["spec"]["replicas"]
        have = want if ready is None else ready
        out["status"] = {
            "observedGeneration": 1,
            "replicas": want,
            "updatedReplicas": want,
            "readyReplicas": have,
            "availableReplicas": have,
        }
    if out["kind"] == "Service":
        out["spec"]["clusterIP"] = "10.0.0.12"
        out["spec"]["type"] = "ClusterIP"
    return out


def pod(
    labels: dict[str, str],
    name: str = "chat-abc-1",
    *,
    unschedulable: str | None = None,
    waiting: tuple[str, str] | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Pending", "conditions": []}
    if unschedulable is not None:
        status["conditions"].append(
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": unschedulable,
            }
        )
    if waiting is not None:
        status["containerStatuses"] = [
            {
                "name": "engine",
                "state": {"waiting": {"reason": waiting[0]}},
                "lastState": {"terminated": {"exitCode": 1, "message": waiting[1]}},
            }
        ]
    return {"metadata": {"name": name, "labels": labels}, "status": status}


def revision(a: ModelArtifact, p: ServingPool | None = None) -> str:
    """The revision `p` (default: `pool()`) serving `a` has under the default engine image."""
    from kvfleet.api import manifest_hash
    from kvfleet.operator.builders import EngineOptions
    from kvfleet.operator.revisions import parts_of

    return parts_of(p or pool(), manifest_hash(a.spec), EngineOptions().image).revision
