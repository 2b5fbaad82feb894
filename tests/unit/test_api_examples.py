"""examples/ are admitted as a set; each examples/invalid/ file is refused with its message.

Each invalid file states what it needs in header comments:
  # needs: FILE...     good objects that must exist first (paths relative to the file)
  # replaces: FILE     the file is an update of the object defined there
  # expect: REGEX      a line of the refusal must match (one or more)
The e2e test applies the same files to a real apiserver with the webhook installed.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvfleet.api import load_yaml_documents
from kvfleet.compat import default_matrix
from kvfleet.webhooks.admission import Decision, admit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
INVALID = sorted((EXAMPLES / "invalid").glob("*.yaml"))


@dataclass(frozen=True)
class InvalidExample:
    path: Path
    needs: tuple[Path, ...]
    replaces: Path | None
    expect: tuple[str, ...]


def parse_invalid(path: Path) -> InvalidExample:
    headers: dict[str, list[str]] = {"needs": [], "replaces": [], "expect": []}
    for line in path.read_text().splitlines():
        match = re.match(r"^# (needs|replaces|expect): (.*)$", line)
        if match:
            key, value = match.groups()
            headers[key] += value.split() if key != "expect" else [value]
    return InvalidExample(
        path,
        tuple((path.parent / p).resolve() for p in headers["needs"]),
        (path.parent / headers["replaces"][0]).resolve() if headers["replaces"] else None,
        tuple(headers["expect"]),
    )


def _docs(path: Path) -> list[dict[str, Any]]:
    return load_yaml_documents(path.read_text(), str(path))


def _key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def _decide(
    doc: dict[str, Any], old: dict[str, Any] | None, store: dict[tuple[str, str], dict[str, Any]]
) -> Decision:
    async def fetch(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return store.get((kind, name))

    return asyncio.run(admit(doc["kind"], doc, old, fetch=fetch, matrix=default_matrix()))


def test_every_good_example_is_admitted_in_the_order_kubectl_applies_them() -> None:
    """`kubectl apply -f examples/` sends the files in name order: each object is admitted
    with only what came before it (the numbered names put what is referenced first)."""
    docs = [d for p in sorted(EXAMPLES.glob("*.yaml")) for d in _docs(p)]
    assert {d["kind"] for d in docs} == {"ModelArtifact", "ServingPool", "TenantQuota", "Rollout"}
    store: dict[tuple[str, str], dict[str, Any]] = {}
    for doc in docs:
        decision = _decide(doc, None, store)
        assert decision.allowed and not decision.warnings, (_key(doc), decision)
        store[_key(doc)] = doc


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_example_is_refused_with_its_message(path: Path) -> None:
    example = parse_invalid(path)
    assert example.expect, f"{path.name} has no '# expect:' header"
    store = {_key(d): d for need in example.needs for d in _docs(need)}
    messages = []
    for doc in _docs(path):
        old = None
        if example.replaces is not None:
            old = next(d for d in _docs(example.replaces) if _key(d) == _key(doc))
        decision = _decide(doc, old, store)
        store[_key(doc)] = doc
        messages += [str(e) for e in decision.errors]
    assert messages, f"{path.name} was admitted"
    for pattern in example.expect:
        assert any(re.search(pattern, m) for m in messages), (pattern, messages)
