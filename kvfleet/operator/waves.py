"""Fleet waves: an operator whose default engine image changed rolls the pools that run it
through their Rollouts a few at a time, and stops at the first rollback.

The engine image is part of every revision (kvfleet.operator.revisions), so a Helm upgrade of
the operator that brings another default image asks every governed pool that does not pin
`spec.pod.image` for a new revision. Started at once, one bad image would reach each of those
pools' canaries in the same minute, and a rollback in one would teach the others nothing. So
a change that brings the operator's image is admitted to a pool's Rollout only while fewer
than `--max-concurrent-rollouts` pools roll to that image, and none rolled back from it; the
others stay on stable, their Rollout says what they wait for. A wave is named by its image:
a stopped wave stays stopped until the operator runs another default image (or a pool pins an
image of its own, which is then its own change, not the wave's).

Pure: the runtime passes every Rollout's (key, status) it knows and the admissions it made
but whose status it has not read back yet.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvfleet.api.rollout import Phase, RolloutStatus
from kvfleet.operator.rollout import ACTIVE

Key = tuple[str, str]  # (namespace, pool)
DEFAULT_MAX_CONCURRENT = 2


def wave_of(pinned_image: str | None, serving_image: str | None, target_image: str,
            operator_image: str, serving_has_parts: bool = True) -> str | None:
    """The wave a change belongs to: the operator's image, when the pool takes the operator's
    (no image of its own) and the serving revision ran another, or was built by an operator
    that did not record its parts (the upgrade to revisions with parts changes every
    pool's revision); else None (a pool's own change, rolled as soon as it is asked for)."""
    if pinned_image is not None or serving_image is None or target_image != operator_image:
        return None
    return operator_image if serving_image != operator_image or not serving_has_parts \
        else None


def hold(key: Key, wave: str, members: Iterable[tuple[Key, RolloutStatus]],
         limit: int) -> str | None:
    """Why `key` may not start rolling to `wave` now (None: it may)."""
    rolling, failed = [], []
    for other, status in members:
        if status.wave != wave:
            continue
        if other == key and status.phase in ACTIVE:
            return None  # already admitted: it goes on (or back)
        # (ROLLING_BACK is also ACTIVE: a rollback stops the wave from its first moment)
        if status.phase in (Phase.ROLLED_BACK, Phase.ROLLING_BACK, Phase.ABORTED):
            if other != key:
                failed.append(other)
        elif status.phase in ACTIVE:
            rolling.append(other)
    if failed:
        ns, name = sorted(failed)[0]
        return (f"the fleet wave to engine image {wave} stopped: pool {ns}/{name} rolled back "
                "from it; this pool stays on its stable revision (pin spec.pod.image to roll "
                "it alone)")
    if len(rolling) >= limit:
        names = ", ".join(f"{ns}/{name}" for ns, name in sorted(rolling))
        return (f"waiting for the fleet wave to engine image {wave}: {len(rolling)} pools "
                f"rolling ({names}), at most {limit} at a time (--max-concurrent-rollouts)")
    return None
