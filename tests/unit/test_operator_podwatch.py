"""Pod events → pool reconciles: which events matter, and which pool a pod belongs to."""

from __future__ import annotations

import copy
from typing import Any

from kvfleet.operator import handlers, naming, podwatch
from kvfleet.operator.podwatch import PodProblems, pool_label, pools_of


class PodBuilder:
    """An engine pod of pool `pool` as the watch delivers it, moved through states."""

    def __init__(self, pool: str = "chat", uid: str = "uid-1") -> None:
        self._pod: dict[str, Any] = {
            "metadata": {
                "name": f"{pool}-abc-1",
                "uid": uid,
                "labels": naming.pool_labels(pool),
            },
            "status": {"phase": "Pending", "conditions": []},
        }

    def unschedulable(self, message: str = "0/3 nodes are available") -> PodBuilder:
        self._pod["status"]["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": message}
        ]  # fmt: skip
        return self

    def scheduled(self) -> PodBuilder:
        self._pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "True"}]
        return self

    def container(self, state: dict[str, Any], last: dict[str, Any] | None = None) -> PodBuilder:
        self._pod["status"]["containerStatuses"] = [
            {"name": "engine", "state": state, "lastState": last or {}}
        ]
        return self

    def obj(self) -> dict[str, Any]:
        return copy.deepcopy(self._pod)


CRASH = {"waiting": {"reason": "CrashLoopBackOff"}}
LAST_EXIT = {"terminated": {"exitCode": 1, "message": "sha256 differs\n"}}


def test_normal_start_up_triggers_nothing() -> None:
    problems, pod = PodProblems(), PodBuilder()
    assert not problems.changed(pod.obj(), "ADDED")
    assert not problems.changed(pod.scheduled().obj(), "MODIFIED")
    assert not problems.changed(pod.container({"waiting": {"reason": "ContainerCreating"}}).obj(),
                                "MODIFIED")  # fmt: skip
    assert not problems.changed(pod.container({"running": {}}).obj(), "MODIFIED")
    assert not problems.changed(pod.obj(), "DELETED")
    assert len(problems) == 0


def test_a_problem_triggers_when_it_appears_changes_and_clears() -> None:
    problems, pod = PodProblems(), PodBuilder()
    assert not problems.changed(pod.obj(), "ADDED")
    assert problems.changed(pod.unschedulable().obj(), "MODIFIED")
    assert not problems.changed(pod.obj(), "MODIFIED")  # same problem, e.g. a label edit
    assert problems.changed(pod.unschedulable("0/4 nodes are available").obj(), "MODIFIED")
    assert problems.changed(pod.scheduled().obj(), "MODIFIED")  # cleared: Degraded may go
    assert problems.changed(pod.container(CRASH, LAST_EXIT).obj(), "MODIFIED")
    assert problems.changed(pod.obj(), "DELETED")  # its problem leaves with it
    assert len(problems) == 0


def test_a_crash_loop_is_one_problem_through_its_restarts_until_ready() -> None:
    problems, pod = PodProblems(), PodBuilder().scheduled()
    assert problems.changed(pod.container(CRASH, LAST_EXIT).obj(), "MODIFIED")
    for _ in range(3):  # run again (not ready), fail, back off: nothing new for the pool
        restarted = pod.container({"running": {}}, LAST_EXIT).obj()
        restarted["status"]["containerStatuses"][0].update(restartCount=1, ready=False)
        assert not problems.changed(restarted, "MODIFIED")
        assert not problems.changed(pod.container(CRASH, LAST_EXIT).obj(), "MODIFIED")
    recovered = pod.container({"running": {}}, LAST_EXIT).obj()
    recovered["status"]["containerStatuses"][0].update(restartCount=4, ready=True)
    assert problems.changed(recovered, "MODIFIED")
    assert len(problems) == 0


def test_initial_listing_triggers_only_for_pods_with_a_problem() -> None:
    problems = PodProblems()
    assert not problems.changed(PodBuilder(uid="ok").scheduled().obj(), None)
    pod = PodBuilder(uid="stuck").unschedulable()
    assert problems.changed(pod.obj(), None)
    assert not problems.changed(pod.obj(), "MODIFIED")
    assert problems.changed(pod.scheduled().obj(), "MODIFIED")


def test_pods_are_told_apart_by_uid() -> None:
    problems = PodProblems()
    a, b = PodBuilder(uid="a").unschedulable(), PodBuilder(uid="b").unschedulable()
    assert problems.changed(a.obj(), "MODIFIED")
    assert problems.changed(b.obj(), "MODIFIED")
    assert len(problems) == 2


def test_a_pod_being_deleted_has_no_problem_of_its_own() -> None:
    problems, pod = PodProblems(), PodBuilder().container(CRASH, LAST_EXIT)
    assert problems.changed(pod.obj(), "MODIFIED")
    terminating = pod.obj()
    terminating["metadata"]["deletionTimestamp"] = "2026-11-29T09:00:00Z"
    assert problems.changed(terminating, "MODIFIED")
    assert len(problems) == 0


class PoolNames:
    """The namespace's pool names as the cache has them; counts the look-ups."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.lookups = 0

    def __call__(self) -> list[str]:
        self.lookups += 1
        return self.names


def test_a_short_pool_name_is_its_label_without_a_look_up() -> None:
    names = PoolNames(["chat"])
    label = pool_label(PodBuilder("chat").obj())
    assert label == "chat"
    assert pools_of(label, names) == ["chat"]
    assert names.lookups == 0


def test_a_long_pool_name_is_found_from_its_cut_label() -> None:
    long_name = "team-a.summariser." + "x" * 80
    other = "team-a.summariser." + "y" * 80
    short_lookalike = "chat-0123abcd"  # the same shape as a cut label, and a real name
    names = PoolNames([long_name, other, short_lookalike, "chat"])
    label = pool_label(PodBuilder(long_name).obj())
    assert label is not None and label != long_name and len(label) <= 63
    assert pools_of(label, names) == [long_name]
    assert names.lookups == 1
    assert pools_of(short_lookalike, names) == [short_lookalike]


def test_pods_without_the_pool_label_belong_to_no_pool() -> None:
    assert pool_label({"metadata": {"labels": {"app": "x"}}}) is None
    assert pool_label({"metadata": {}}) is None


def test_the_watch_selects_only_the_operators_engine_pods() -> None:
    terms = podwatch.POD_SELECTOR.split(",")
    assert naming.POOL_LABEL in terms  # the label exists
    labels = naming.pool_labels("chat")
    for term in terms:
        key, _, value = term.partition("=")
        assert key in labels and (not value or labels[key] == value)


def test_the_operator_watches_pods_and_children_through_label_selectors() -> None:
    """Server-side filters: the cluster's other pods, Services, ... never reach the operator
    (the informers send these selectors with every list and watch: test_operator_informer)."""
    assert handlers.INFORMED["Pod"] == podwatch.POD_SELECTOR
    managed = f"app.kubernetes.io/managed-by={naming.MANAGED_BY}"
    children = ("Deployment", "Service", "PodDisruptionBudget", "Secret",
                "NetworkPolicy")
    for kind in children:
        assert handlers.INFORMED[kind] == managed
    assert set(handlers.INFORMED) == {"Pod", *children}
