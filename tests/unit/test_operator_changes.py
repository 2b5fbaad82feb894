"""Which pool events call for a reconcile (the pools reach the operator as kopf events, so
kopf never writes its bookkeeping onto them)."""

from __future__ import annotations

import copy
from typing import Any

from kvfleet.compat import default_matrix
from kvfleet.operator.changes import Changes
from kvfleet.operator.handlers import OperatorConfig, build_registry


def _pool(uid: str = "u1") -> dict[str, Any]:
    return {"metadata": {"name": "chat", "namespace": "llm", "uid": uid, "generation": 1,
                         "resourceVersion": "10", "labels": {"team": "a"}},
            "spec": {"replicas": 1}, "status": {"conditions": []}}


def test_a_reconcile_follows_what_it_reads_not_its_own_status_writes() -> None:
    changes, pool = Changes(), _pool()
    assert changes.calls_for_reconcile(None, pool)  # the first listing: every pool
    written = copy.deepcopy(pool)
    written["metadata"]["resourceVersion"] = "11"
    written["status"] = {"conditions": [{"type": "Available", "status": "True"}]}
    assert not changes.calls_for_reconcile("MODIFIED", written)  # its own status write
    edits: list[tuple[list[str], Any]] = [
        (["spec", "replicas"], 3),
        (["metadata", "labels"], {"team": "b"}),
        (["metadata", "annotations"], {"kvfleet.io/note": "x"}),
        (["metadata", "deletionTimestamp"], "2026-12-06T05:00:00Z"),
    ]
    for path, value in edits:
        changed = copy.deepcopy(written)
        changed["metadata"]["resourceVersion"] = "12"
        target = changed
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value
        assert changes.calls_for_reconcile("MODIFIED", changed), path
        assert not changes.calls_for_reconcile("MODIFIED", changed), path  # once
        written = changed


def test_a_deleted_pool_is_forgotten_and_one_recreated_under_its_name_is_new() -> None:
    changes = Changes()
    assert changes.calls_for_reconcile("ADDED", _pool("u1"))
    assert not changes.calls_for_reconcile("DELETED", _pool("u1"))
    assert len(changes) == 0
    assert changes.calls_for_reconcile("ADDED", _pool("u2"))


def test_kopf_has_no_handler_that_writes_onto_a_pool() -> None:
    """kopf's create/update/resume handlers persist their progress and last-handled spec on
    the object; the pools only have an event handler."""
    registry = build_registry(OperatorConfig(matrix=default_matrix()))
    changing = {h.id for h in registry._changing.get_all_handlers()}
    watching = {h.id for h in registry._watching.get_all_handlers()}
    assert not any(h.startswith("servingpool") for h in changing), changing
    assert {"modelartifact-create", "rollout-update"} <= changing  # (few: kopf handles them)
    assert "servingpool-event" in watching
