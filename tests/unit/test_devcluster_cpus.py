"""The local pod runner's stand-in for a CPU limit: a container with `limits.cpu` is pinned
to that many whole CPUs, the least-held first, and its process sees only those."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvfleet.devcluster.errors import DevClusterError, StartupError
from kvfleet.devcluster.podenv import cpu_limit, pick_cpus
from kvfleet.devcluster.processes import ManagedProcess


@pytest.mark.parametrize(("limits", "cpus"), [
    ({"cpu": "1"}, 1), ({"cpu": "2"}, 2), ({"cpu": "1500m"}, 1), ({"cpu": "250m"}, 1),
    ({"cpu": "2.5"}, 2), ({"cpu": "1k"}, 1000), ({"memory": "1Gi"}, None), (None, None),
])
def test_whole_cpus_of_a_limit(limits: dict[str, str] | None, cpus: int | None) -> None:
    spec = {"name": "engine", "resources": {"limits": limits} if limits is not None else {}}
    assert cpu_limit(spec) == cpus


def test_the_least_held_cpus_are_picked() -> None:
    host = [0, 1, 2, 3]
    assert pick_cpus(1, host, Counter()) == {0}
    assert pick_cpus(2, host, Counter({0: 1, 1: 1})) == {2, 3}
    assert pick_cpus(1, host, Counter({0: 2, 1: 1, 2: 1, 3: 1})) == {1}
    assert pick_cpus(8, host, Counter()) == set(host)  # never more than the host has


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs 2 CPUs to show")
def test_a_pinned_process_runs_on_its_cpus_only(tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    process = ManagedProcess(
        "pinned", [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        tmp_path / "out.log", cpus=frozenset({cpu}))
    try:
        assert process.popen.wait(timeout=30) == 0
        assert process.log_path.read_text().strip() == f"[{cpu}]"
    finally:
        process.stop()


def test_a_limit_that_is_not_a_cpu_quantity_is_the_containers_start_error() -> None:
    with pytest.raises(DevClusterError, match=r"container engine: resources.limits.cpu: "
                                              r"'two' is not a CPU quantity"):
        cpu_limit({"name": "engine", "resources": {"limits": {"cpu": "two"}}})


def test_a_cpu_the_process_may_not_use_is_a_startup_error(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="cannot start"):
        ManagedProcess("nowhere", [sys.executable, "-c", "pass"], tmp_path / "out.log",
                       cpus=frozenset({4096}))
