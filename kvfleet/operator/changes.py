"""Which watch events of a ServingPool call for a reconcile: the ones that change what a
reconcile reads of it.

The pools' events reach the operator through a kopf event handler, not kopf's create/update/
resume handlers. Those persist their bookkeeping on the object: kopf PATCHed each pool it
handled (a `last-handled-configuration` annotation, a copy of the spec), one write more per
pool on the apiserver a creation burst saturates, plus the event that write sends back to
every pool watcher. A reconcile reads the pool's spec, labels, annotations and deletion; it
never reads its own status. So an event calls for a reconcile when one of those changed
since the last event of the same object, which is what kopf's update handler decided from the
annotation. What was seen is kept in memory, per uid: after a restart, the first listing
reconciles every pool, as kopf's resume did.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def fingerprint(body: Mapping[str, Any]) -> str:
    """A digest of what a reconcile reads of the pool: its spec (its generation moves with
    it), labels, annotations and deletion."""
    meta = body.get("metadata") or {}
    read = {
        "generation": meta.get("generation"),
        "spec": body.get("spec"),
        "labels": meta.get("labels"),
        "annotations": meta.get("annotations"),
        "deleting": meta.get("deletionTimestamp"),
    }
    return hashlib.blake2b(json.dumps(read, sort_keys=True).encode(), digest_size=16).hexdigest()


class Changes:
    """uid -> the fingerprint of the last event seen of that object."""

    def __init__(self) -> None:
        self._seen: dict[str, str] = {}

    def calls_for_reconcile(self, event_type: str | None, body: Mapping[str, Any]) -> bool:
        """Whether this event (None: the first listing; ADDED, MODIFIED, DELETED) changed
        what a reconcile reads. A deleted object is forgotten: its children go with it (their
        owner references), nothing is left to reconcile."""
        uid = str((body.get("metadata") or {}).get("uid") or "")
        if event_type == "DELETED":
            self._seen.pop(uid, None)
            return False
        found = fingerprint(body)
        if self._seen.get(uid) == found:
            return False
        self._seen[uid] = found
        return True

    def __len__(self) -> int:
        return len(self._seen)
