"""The pool's memory of revisions it must not serve again: `remember(...) -> Memory`, pure.

A Rollout's status remembers only its latest target, and a Rollout can be deleted, renamed or
doubled, while the pool outlives them all. So the pool's own status keeps the revisions a
Rollout rolled back or aborted on request, and the one whose Rollout was deleted before it
finished (`status.refusedRevisions`, the latest MAX_REFUSED). The reconcile gives a refused
revision no Deployment and no traffic, governed or not — a `git revert` to it, a new Rollout, a
deleted Rollout, a restore of the pool's spec — and says so in the `RevisionRefused` condition,
until a person retries it:

- `kvfleet rollout retry POOL`: a retry request on the Rollout. The Rollout sees the refused
  revision while the request is pending (`refused_for_rollout`), starts it again, and once
  its status shows the request handled with that revision running, the pool forgets it;
- with no Rollout: the `kvfleet.io/retry-revision` annotation on the pool naming the revision
  (`REVISION[@ID]`, a prefix of 12 or more hex digits), acted on once per value
  (`status.handledRetry`); the pool then rolls over to it as an ungoverned pool does.

Aborts that judge nothing are not remembered: a rollout aborted because the artifactRef went
back to the serving revision, or to an artifact that cannot be deployed, refuses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvfleet.api.labels import short_revision
from kvfleet.api.rollout import Phase, RequestAction, RolloutRequest, RolloutStatus
from kvfleet.api.servingpool import (
    MAX_REFUSED,
    RETRY_ANNOTATION,
    RefusalReason,
    RefusedRevision,
    ServingPool,
    TrafficRole,
)
from kvfleet.operator.conditions import Cond
from kvfleet.operator.events import Event
from kvfleet.operator.rollout import Decision

MIN_PREFIX = 12  # hex digits of a revision an annotation must give (short_revision's length)
RUNNING = (Phase.SHADOW, Phase.PROGRESSING, Phase.PAUSED, Phase.PROMOTED)


@dataclass(frozen=True)
class Memory:
    refused: tuple[RefusedRevision, ...]
    handled_retry: str | None
    events: tuple[Event, ...]

    def of(self, revision: str | None) -> RefusedRevision | None:
        return refusal(self.refused, revision)

    def to_wire(self) -> dict[str, Any]:
        status: dict[str, Any] = {}
        if self.refused:
            status["refusedRevisions"] = [r.to_wire() for r in self.refused]
        if self.handled_retry is not None:
            status["handledRetry"] = self.handled_retry
        return status


def refusal(refused: tuple[RefusedRevision, ...] | list[RefusedRevision],
            revision: str | None) -> RefusedRevision | None:
    return next((r for r in refused if revision is not None and r.revision == revision), None)


def describe(entry: RefusedRevision) -> str:
    """Why a revision gets no traffic, and what a person does about it."""
    by = f" by Rollout {entry.rollout}" if entry.rollout else ""
    what = {RefusalReason.ROLLED_BACK: f"rolled back{by}",
            RefusalReason.ABORTED: f"aborted{by}",
            RefusalReason.ROLLOUT_DELETED: "left mid-rollout when its Rollout was deleted"
            }[entry.reason]
    because = f" ({entry.message})" if entry.message else ""
    return (f"revision {short_revision(entry.revision)} ({entry.artifact or 'artifact unknown'})"
            f" was {what} at {entry.at.isoformat()}{because}; it gets no traffic until "
            f"`kvfleet rollout retry` (or the {RETRY_ANNOTATION} annotation naming it)")


def refused_for_rollout(pool: ServingPool, revision: str | None, status: RolloutStatus,
                        request: RolloutRequest | None) -> RefusedRevision | None:
    """The refusal a Rollout must treat as its target being blocked, or None.

    None while the Rollout itself holds that revision finished or draining (its own
    RolledBack/Aborted already keeps it out, and must be left to finish its drain), and while
    a retry request on it is pending (so that it can start the revision again; `remember`
    forgets the refusal once the retry took effect)."""
    entry = refusal(pool.status.refused_revisions if pool.status else [], revision)
    if entry is None or (status.canary_revision == entry.revision and status.phase in (
            Phase.ROLLING_BACK, Phase.ROLLED_BACK, Phase.ABORTED)):
        return None
    pending = (request is not None and request.action == RequestAction.RETRY
               and status.last_request_id != request.id)
    return None if pending else entry


def remember(pool: ServingPool, *, revision: str | None, serving: str | None,
             rollout: Decision | None, rollout_name: str, now: datetime) -> Memory:
    """The pool's refused revisions after this reconcile. `revision`: the revision the
    pool's spec asks for; `serving`: the revision that serves (before this reconcile); `rollout`:
    this reconcile's decision of the Rollout (`rollout_name`) governing the pool, if any."""
    previous = pool.status
    refused = list(previous.refused_revisions) if previous is not None else []
    handled = previous.handled_retry if previous is not None else None
    events: list[Event] = []

    def forget(prefix: str, why: str) -> None:
        for entry in [r for r in refused if r.revision.startswith(prefix)]:
            refused.remove(entry)
            events.append(Event("Normal", "RevisionRetried",
                                f"revision {short_revision(entry.revision)} "
                                f"({entry.artifact}) may be served again: {why}"))

    def add(entry: RefusedRevision) -> None:
        if refusal(refused, entry.revision) is not None:
            return
        refused.append(entry)
        del refused[:-MAX_REFUSED]
        events.append(Event("Warning", "RevisionRefused", describe(entry)))

    annotation = (pool.metadata.annotations or {}).get(RETRY_ANNOTATION)
    if annotation and annotation != handled:
        handled = annotation
        prefix = annotation.split("@", 1)[0].strip().lower()
        if len(prefix) >= MIN_PREFIX:
            forget(prefix, f"{RETRY_ANNOTATION} {annotation}")
    if rollout is not None:
        status = rollout.status
        canary = status.canary_revision
        if canary is not None and rollout.retried and status.phase in RUNNING:
            forget(canary, f"retried on request through Rollout {rollout_name}")
        judged = status.phase in (Phase.ROLLING_BACK, Phase.ROLLED_BACK) or (
            status.phase == Phase.ABORTED and canary == revision)
        if canary is not None and judged:
            reason = RefusalReason.ABORTED if status.phase == Phase.ABORTED \
                else RefusalReason.ROLLED_BACK
            add(RefusedRevision(revision=canary, artifact=status.canary_artifact or "",
                                reason=reason, rollout=rollout_name,
                                message=status.message[:512], at=status.finished_at or now))
    elif previous is not None and revision is not None and revision != serving:
        # No Rollout, and the last status shows one trying this revision: it was deleted
        # mid-rollout. The revision was never judged, so it is held back, not shipped.
        trying = [t for t in previous.traffic
                  if t.revision == revision and t.role != TrafficRole.STABLE]
        if trying and serving is not None:
            add(RefusedRevision(
                revision=revision, artifact=pool.spec.artifact_ref.name,
                reason=RefusalReason.ROLLOUT_DELETED,
                message=f"deleted at {trying[0].role} weight {trying[0].weight}%", at=now))
    return Memory(tuple(refused), handled, tuple(events))


def condition(memory: Memory, revision: str | None) -> Cond | None:
    """RevisionRefused: True while the artifactRef names a refused revision; shown once the
    pool has refused anything."""
    entry = memory.of(revision)
    if entry is not None:
        return Cond("RevisionRefused", True, entry.reason.value, describe(entry))
    if memory.refused:
        return Cond("RevisionRefused", False, "NotRefused",
                    f"{len(memory.refused)} revision(s) refused; the artifactRef's is not one")
    return None
