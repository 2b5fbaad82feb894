"""`kvfleet rollout retry POOL` with no Rollout: the pool's retry annotation names the refused
revision its spec asks for (status.revision), and a pool that refuses nothing is told so."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from kvfleet.api.servingpool import RETRY_ANNOTATION
from kvfleet.commands.rollout import _act

REVISION = "5a00c624143f" + "0" * 52


class FakeApi:
    def __init__(self, refused: list[str]) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {
            ("ServingPool", "chat"): {"spec": {"artifactRef": {"name": "qwen3-8b"}}, "status": {
                "revision": REVISION, "refusedRevisions": [{"revision": r} for r in refused]}}}
        self.patches: list[tuple[str, str, dict[str, Any]]] = []

    async def list(self, kind: str, namespace: str) -> list[dict[str, Any]]:
        return []  # no Rollout

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, name))

    async def patch(self, kind: str, namespace: str, name: str, body: dict[str, Any]) -> None:
        self.patches.append((kind, name, body))


def _retry(api: FakeApi, pool: str = "chat") -> int:
    args = argparse.Namespace(action="retry", pool=pool, full=False, output="text")
    return asyncio.run(_act(api, args, "ns"))


def test_retry_without_a_rollout_annotates_the_pool(capsys: Any) -> None:
    api = FakeApi([REVISION])
    assert _retry(api) == 0
    [(kind, name, body)] = api.patches
    value = body["metadata"]["annotations"][RETRY_ANNOTATION]
    assert (kind, name) == ("ServingPool", "chat") and value.startswith(f"{REVISION}@")
    assert "rolls over ungoverned" in capsys.readouterr().out
    assert _retry(api) == 0 and len({p[2]["metadata"]["annotations"][RETRY_ANNOTATION]
                                     for p in api.patches}) == 2  # a fresh value each time


def test_retry_of_a_pool_that_refuses_nothing_says_so(capsys: Any) -> None:
    api = FakeApi([])
    assert _retry(api) == 1 and not api.patches
    assert f"does not refuse revision {REVISION[:12]}" in capsys.readouterr().err
    assert _retry(api, "missing") == 1
    assert "no ServingPool 'missing'" in capsys.readouterr().err


class RolloutApi(FakeApi):
    def __init__(self, status: dict[str, Any]) -> None:
        super().__init__([])
        self.rollout = {"metadata": {"name": "chat"}, "spec": {"poolRef": {"name": "chat"}},
                        "status": status}

    async def list(self, kind: str, namespace: str) -> list[dict[str, Any]]:
        return [self.rollout]


def test_undo_needs_a_kept_previous_revision(capsys: Any) -> None:
    args = argparse.Namespace(action="undo", pool="chat", full=False, output="text")
    idle = RolloutApi({"phase": "Promoted"})
    assert asyncio.run(_act(idle, args, "ns")) == 1 and not idle.patches
    assert "keeps no previous revision to undo to" in capsys.readouterr().err
    kept = RolloutApi({"phase": "Promoted", "previousRevision": REVISION})
    assert asyncio.run(_act(kept, args, "ns")) == 0
    [(kind, _, body)] = kept.patches
    assert kind == "Rollout" and '"action": "undo"' in body["metadata"]["annotations"][
        "kvfleet.io/rollout-request"]
