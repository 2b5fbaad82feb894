"""Which pool a pod event concerns, and whether it changes what the pool would report.

A pool's status explains pods that do not serve (unschedulable, crash-looping) from the pods
themselves, which no Deployment event announces promptly. The operator therefore watches its
own engine pods — only those, through a server-side label selector, so a cluster's other pods
never reach it — and reconciles a pod's pool when the pod's problem (as `placement` words it)
appears, changes or clears. Pods going through normal start-up (scheduled, running, ready)
change nothing here: the Deployment's status events already cover them.

Pods carry their pool's name as a label value, which is cut to 63 characters with a digest
suffix for long names (`naming.label_value`); only such a label needs a look-up of the pools in
the namespace (in the operator's cache) to find the name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from kvfleet.operator import naming
from kvfleet.operator.placement import pod_problem

# Server-side filter of the pod watch: the operator's engine pods, nothing else.
POD_SELECTOR = (
    f"{naming.POOL_LABEL},app.kubernetes.io/component={naming.ENGINE_COMPONENT},"
    f"app.kubernetes.io/managed-by={naming.MANAGED_BY}"
)
# The shape `naming.bounded_name` gives a long name: cut, then `-` and 8 hex digits.
_MAYBE_CUT = re.compile(r".+-[0-9a-f]{8}")


def pool_label(pod: dict[str, Any]) -> str | None:
    labels = pod.get("metadata", {}).get("labels") or {}
    value = labels.get(naming.POOL_LABEL)
    return value if isinstance(value, str) and value else None


class PodProblems:
    """The problem each engine pod last showed; says which pod events a pool must hear about.

    Only pods with a problem are remembered, so the memory is bounded by the unhealthy pods.
    """

    def __init__(self) -> None:
        self._problems: dict[str, tuple[str, str]] = {}

    def changed(self, pod: dict[str, Any], event_type: str | None) -> bool:
        """Record the pod's state; True when its pool's diagnosis may differ because of it.

        `event_type` is the watch event's: None for kopf's initial listing, ADDED, MODIFIED
        or DELETED. A listed pod with a problem counts as news: its pool's resume may have
        read the pods before the problem showed (the watches start independently).
        """
        uid = str(pod.get("metadata", {}).get("uid", ""))
        before = self._problems.get(uid)
        if event_type == "DELETED":
            self._problems.pop(uid, None)
            return before is not None  # the pool may stop reporting it
        problem = pod_problem(pod)
        if problem is None:
            self._problems.pop(uid, None)
        else:
            self._problems[uid] = problem
        return problem != before

    def __len__(self) -> int:
        return len(self._problems)


def pools_of(label: str, pool_names: Callable[[], Iterable[str]]) -> list[str]:
    """The names of the pools whose pool label is `label`.

    A label that cannot be a cut name is the pool's name; only one that may be cut needs the
    namespace's pool names (`pool_names`, called only then) to find the pool it was cut from.
    """
    if not _MAYBE_CUT.fullmatch(label):
        return [label]
    return [name for name in pool_names() if naming.label_value(name) == label]
