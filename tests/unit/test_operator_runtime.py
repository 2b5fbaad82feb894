"""Operator plumbing that needs no cluster: reconcile coalescing, RBAC file, command line."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

from kvfleet.cli import build_parser
from kvfleet.operator import metrics
from kvfleet.operator.coalesce import Coalescer
from kvfleet.operator.handlers import CHILD_KINDS, PODS
from kvfleet.operator.rbac import build_rbac, install_rbac, permissions

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.asyncio
async def test_triggers_during_a_run_coalesce_into_one_follow_up() -> None:
    runs: list[str] = []
    gate = asyncio.Event()

    async def reconcile(key: str) -> None:
        runs.append(key)
        if len(runs) == 1:
            await gate.wait()

    coalescer: Coalescer[str] = Coalescer(reconcile)
    first = asyncio.create_task(coalescer.trigger("a"))
    await asyncio.sleep(0)
    followers = [asyncio.create_task(coalescer.trigger("a")) for _ in range(10)]
    other = asyncio.create_task(coalescer.trigger("b"))  # other keys are not held up
    await asyncio.wait_for(other, 1)
    gate.set()
    await asyncio.wait_for(asyncio.gather(first, *followers), 1)
    assert runs == ["a", "b", "a"]
    assert coalescer.num_keys == 0  # nothing kept per key once its triggers are served


@pytest.mark.asyncio
async def test_pending_is_a_run_triggered_and_not_started() -> None:
    gate = asyncio.Event()

    async def reconcile(key: str) -> None:
        await gate.wait()

    coalescer: Coalescer[str] = Coalescer(reconcile)
    first = asyncio.create_task(coalescer.trigger("a"))
    await asyncio.sleep(0)
    assert not coalescer.pending("a")  # running: a trigger now needs a run of its own
    follow_up = asyncio.create_task(coalescer.trigger("a"))
    await asyncio.sleep(0)
    assert coalescer.pending("a") and not coalescer.pending("b")
    gate.set()
    await asyncio.gather(first, follow_up)
    assert not coalescer.pending("a")


@pytest.mark.asyncio
async def test_no_bookkeeping_outlives_a_keys_triggers() -> None:
    """Deleted pools and artifacts must not leak an entry each (one per key ever seen)."""
    async def reconcile(key: str) -> None:
        if key.endswith("!"):
            raise RuntimeError("failed")

    coalescer: Coalescer[str] = Coalescer(reconcile)
    for i in range(100):
        await coalescer.trigger(f"pool-{i}")
        with pytest.raises(RuntimeError):
            await coalescer.trigger(f"pool-{i}!")
    assert coalescer.num_keys == 0


@pytest.mark.asyncio
async def test_a_trigger_cancelled_while_queued_does_not_strand_the_next_one() -> None:
    gate = asyncio.Event()
    runs: list[str] = []

    async def reconcile(key: str) -> None:
        runs.append(key)
        if len(runs) == 1:
            await gate.wait()

    coalescer: Coalescer[str] = Coalescer(reconcile)
    first = asyncio.create_task(coalescer.trigger("a"))
    await asyncio.sleep(0)
    queued = asyncio.create_task(coalescer.trigger("a"))
    await asyncio.sleep(0)
    queued.cancel()  # e.g. the operator shutting a handler down
    gate.set()
    await asyncio.wait_for(first, 1)
    await asyncio.wait_for(coalescer.trigger("a"), 1)  # runs, rather than waiting for ever
    assert runs == ["a", "a"] and coalescer.num_keys == 0


@pytest.mark.asyncio
async def test_a_failed_run_fails_its_callers_and_the_next_trigger_runs_again() -> None:
    calls = 0

    async def reconcile(key: str) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("apiserver said no")

    coalescer: Coalescer[str] = Coalescer(reconcile)
    with pytest.raises(RuntimeError, match="apiserver said no"):
        await coalescer.trigger("a")
    await coalescer.trigger("a")
    assert calls == 2


def test_rbac_file_is_generated() -> None:
    on_disk = list(yaml.safe_load_all((ROOT / "deploy/operator/rbac.yaml").read_text()))
    assert on_disk == install_rbac(), (
        "regenerate: kvfleet operator --print-rbac > deploy/operator/rbac.yaml"
    )


def test_rbac_allows_what_the_operator_writes() -> None:
    granted = permissions(build_rbac()[1]["rules"])

    def allowed(group: str, resource: str, verb: str) -> bool:
        return (group, resource, verb) in granted

    for group, resource in [
        ("apps", "deployments"),
        ("", "services"),
        ("policy", "poddisruptionbudgets"),
    ]:
        assert allowed(group, resource, "patch") and allowed(group, resource, "create")
    # Only a retired revision's Deployment is deleted; its other children go with their owner.
    assert allowed("apps", "deployments", "delete")
    assert not any(allowed(g, r, "delete") for g, r in [("", "services"), ("", "configmaps")])
    assert allowed("kvfleet.io", "servingpools/status", "patch")
    assert not allowed("kvfleet.io", "servingpools", "update")  # never writes spec
    for group, _, plural in [*CHILD_KINDS, PODS]:  # informers list, then watch
        assert allowed(group, plural, "list") and allowed(group, plural, "watch"), plural


def test_operator_flags() -> None:
    args = build_parser().parse_args(
        ["operator", "-n", "team-a", "-n", "team-b", "--standalone", "--metrics-port", "0"]
    )
    assert args.namespace == ["team-a", "team-b"] and args.standalone and args.metrics_port == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["operator", "-n", "x", "--all-namespaces"])


def test_print_rbac_runs_from_the_command_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvfleet", "operator", "--print-rbac", "--rbac-namespace", "ops"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    docs = list(yaml.safe_load_all(out))
    # The namespace first: `kubectl apply -f` of the output works on a bare cluster.
    assert [d["kind"] for d in docs] == ["Namespace", "ServiceAccount", "ClusterRole",
                                         "ClusterRoleBinding", "Role", "RoleBinding"]
    assert docs[0]["metadata"]["name"] == "ops"
    # The leader Lease is granted in the operator's namespace only.
    assert {d["metadata"]["namespace"] for d in docs if d["kind"].startswith("Role")} == {"ops"}




def test_the_operator_times_its_gc_pauses_and_its_event_loops_lag() -> None:
    """On a saturated host these tell the operator's own stalls from the apiserver's latency."""
    def count(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    metrics.time_gc_pauses()
    try:
        metrics.time_gc_pauses()  # (once per process, however often it is called)
        assert gc.callbacks.count(metrics._time_gc) == 1
        before = count("kvfleet_operator_gc_pause_seconds_count", generation="2")
        gc.collect()
        assert count("kvfleet_operator_gc_pause_seconds_count", generation="2") >= before + 1
    finally:
        gc.callbacks.remove(metrics._time_gc)

    async def stall() -> None:
        task = asyncio.create_task(metrics.measure_loop_lag())
        await asyncio.sleep(0.3)
        time.sleep(0.6)  # the loop held: the next tick comes ~0.4 s late
        await asyncio.sleep(0.3)
        task.cancel()

    lagged = count("kvfleet_operator_event_loop_lag_seconds_bucket", le="0.1")
    total = count("kvfleet_operator_event_loop_lag_seconds_count")
    asyncio.run(stall())
    assert count("kvfleet_operator_event_loop_lag_seconds_count") - total >= 2
    late = (count("kvfleet_operator_event_loop_lag_seconds_count") - total) - (
        count("kvfleet_operator_event_loop_lag_seconds_bucket", le="0.1") - lagged)
    assert late >= 1  # (a busy host may delay another tick too)


def test_the_operators_gc_lets_short_lived_objects_die_young_and_freezes_its_imports() -> None:
    from kvfleet.operator import gcsettings

    saved = gc.get_threshold()
    try:
        gcsettings.tune()
        assert gc.get_threshold()[0] == gcsettings.YOUNG_THRESHOLD and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)
