"""Fleet waves: an operator image change rolls pools a few at a time and stops at the first
rollback (kvfleet.operator.waves), and a held pool's Rollout starts nothing."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

from kvfleet.api.builders import make_rollout
from kvfleet.api.rollout import Phase, RolloutStatus
from kvfleet.operator import waves
from kvfleet.operator.rollout import View, decide

NEW = "ghcr.io/kvfleet/kvfleet:0.2.0"


def _member(name: str, phase: Phase, wave: str | None = NEW) -> tuple[waves.Key, RolloutStatus]:
    return ("ns", name), RolloutStatus(phase=phase, wave=wave)


def test_only_a_change_that_brings_the_operators_image_is_in_its_wave() -> None:
    old = "ghcr.io/kvfleet/kvfleet:0.1.0"
    assert waves.wave_of(None, old, NEW, NEW) == NEW
    assert waves.wave_of("mine:1", old, "mine:1", NEW) is None  # the pool's own image
    assert waves.wave_of(None, NEW, NEW, NEW) is None  # (a settings or artifact change)
    assert waves.wave_of(None, None, NEW, NEW) is None  # nothing serves yet
    # Served by an operator before revisions had parts: the upgrade itself is the wave.
    assert waves.wave_of(None, NEW, NEW, NEW, serving_has_parts=False) == NEW


def test_at_most_the_limit_roll_and_an_admitted_pool_goes_on() -> None:
    members = [_member("a", Phase.PROGRESSING), _member("b", Phase.SHADOW),
               _member("c", Phase.PROMOTED), _member("d", Phase.PROGRESSING, wave="other:1")]
    held = waves.hold(("ns", "e"), NEW, members, limit=2)
    assert held is not None and "2 pools rolling (ns/a, ns/b), at most 2" in held
    assert waves.hold(("ns", "a"), NEW, members, limit=2) is None
    assert waves.hold(("ns", "e"), NEW, members, limit=3) is None


def test_the_first_rollback_stops_the_wave() -> None:
    members = [_member("a", Phase.ROLLED_BACK), _member("c", Phase.PROMOTED)]
    held = waves.hold(("ns", "e"), NEW, members, limit=5)
    assert held is not None and "stopped: pool ns/a rolled back" in held
    assert waves.hold(("ns", "a"), NEW, members, limit=5) is None  # its own memory refuses it
    assert waves.hold(("ns", "e"), "ghcr.io/kvfleet/kvfleet:0.3.0", members, limit=5) is None
    going_back = waves.hold(("ns", "e"), NEW, [_member("a", Phase.ROLLING_BACK)], limit=5)
    assert going_back is not None and "stopped" in going_back


def test_a_held_pool_starts_nothing_and_says_why() -> None:
    spec = make_rollout().obj().spec
    view = View(spec=spec, status=RolloutStatus(phase=Phase.PROMOTED), generation=1,
                request=None, pool_replicas=2, slos=None, stable="a" * 64, target="b" * 64,
                target_artifact="m", wave=NEW, held="waiting for the fleet wave")
    decision = decide(view, None, None, datetime(2026, 12, 7, tzinfo=UTC))
    assert decision.status.phase == Phase.IDLE and decision.canary_replicas is None
    assert decision.traffic == [] and decision.status.message == "waiting for the fleet wave"
    assert [e.reason for e in decision.events] == ["WaitingForWave"]
    assert decision.requeue_seconds is not None
    admitted = decide(replace(view, held=None), None, None,
                      datetime(2026, 12, 7, tzinfo=UTC))
    assert admitted.status.wave == NEW and admitted.status.phase == Phase.PROGRESSING
    assert admitted.canary_replicas is not None
