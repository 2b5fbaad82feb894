"""Admission rules across objects (the webhook lists what they need): a tenant belongs to one
namespace, and a pool's slos keep judging the Rollouts that take their thresholds from them."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

from kvfleet.api.documents import load_yaml_documents
from kvfleet.compat import default_matrix
from kvfleet.webhooks.admission import Decision, admit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str, namespace: str, kind: str | None = None) -> dict[str, Any]:
    doc = next(d for d in load_yaml_documents((EXAMPLES / name).read_text(), name)
               if kind in (None, d["kind"]))
    doc["metadata"]["namespace"] = namespace
    return doc


def _decide(doc: dict[str, Any], old: dict[str, Any] | None,
            stored: list[dict[str, Any]] | None) -> Decision:
    artifact = _example("01-modelartifact-qwen3-8b.yaml", "a")

    async def fetch(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return artifact if kind == "ModelArtifact" else None

    async def list_objects(kind: str, namespace: str | None) -> list[dict[str, Any]]:
        return [o for o in stored or [] if o["kind"] == kind and
                namespace in (None, o["metadata"]["namespace"])]

    return asyncio.run(admit(doc["kind"], doc, old, fetch=fetch, matrix=default_matrix(),
                             list_objects=None if stored is None else list_objects))


def test_a_tenant_claimed_in_a_second_namespace_is_refused() -> None:
    """A key minted in namespace b for a tenant of namespace a would spend a's budget."""
    owner = _example("02-tenantquota.yaml", "a")
    claim = _example("02-tenantquota.yaml", "b")
    refused = _decide(claim, None, [owner])
    assert not refused.allowed
    (error,) = refused.errors
    assert error.field == "spec.tenant" and error.rule == "ownership"
    assert "belongs to namespace 'a' (TenantQuota a/" in error.message
    assert _decide(claim, None, [claim]).allowed  # its own, in its own namespace
    going = copy.deepcopy(owner)
    going["metadata"]["deletionTimestamp"] = "2026-12-05T00:00:00Z"
    assert _decide(claim, None, [going]).allowed  # a namespace being deleted owns nothing
    assert _decide(claim, None, None).allowed  # offline (kvfleet check): not checked


def test_removing_the_slos_a_rollout_judges_by_is_refused_naming_the_rollout() -> None:
    pool = _example("02-servingpool-l4.yaml", "a")
    rollout = _example("03-rollout.yaml", "a", "Rollout")
    bare = copy.deepcopy(pool)
    del bare["spec"]["slos"]
    refused = _decide(bare, pool, [rollout])
    assert not refused.allowed, refused
    assert any(e.field == "spec.slos" and f"Rollout {rollout['metadata']['name']}" in e.message
               and "spec.analysis.metrics first" in e.message for e in refused.errors), refused
    # A Rollout with every threshold its own, or of another pool, does not hold the pool.
    own = copy.deepcopy(rollout)
    own["spec"]["analysis"]["metrics"] = [{"name": "ttft", "slo": "TTFTP95", "threshold": 2.0}]
    assert _decide(bare, pool, [own]).allowed
    other = copy.deepcopy(rollout)
    other["spec"]["poolRef"]["name"] = "another-pool"
    assert _decide(bare, pool, [other]).allowed


def test_a_second_rollout_for_a_pool_is_refused_naming_the_first() -> None:
    """The operator follows one Rollout per pool; a renamed copy would start a fresh history."""
    rollout = _example("03-rollout.yaml", "a", "Rollout")
    second = copy.deepcopy(rollout)
    second["metadata"]["name"] = "renamed"

    def uniqueness(doc: dict[str, Any], old: dict[str, Any] | None,
                   stored: list[dict[str, Any]]) -> list[str]:
        # (The pool itself is not stored here: its own reference error is beside the point.)
        return [f"{e.field}: {e.message}" for e in _decide(doc, old, stored).errors
                if e.rule == "uniqueness"]

    [error] = uniqueness(second, None, [rollout])
    assert error.startswith("spec.poolRef.name: ")
    assert f"already has Rollout {rollout['metadata']['name']!r}" in error
    assert not uniqueness(rollout, None, [rollout])  # itself (a re-apply)
    assert not uniqueness(rollout, rollout, [rollout, second])  # an edit is never refused
    other = copy.deepcopy(second)
    other["spec"]["poolRef"]["name"] = "another-pool"
    assert not uniqueness(other, None, [rollout])
