"""Bodies in flight before admission, bounded per tenant and for the router
(kvfleet.router.intake): ten 4 MiB bodies from one key took the router past 1 GB."""

from __future__ import annotations

import contextlib

import pytest

from kvfleet.router.errors import IntakeFull
from kvfleet.router.intake import MIB, Intake


def test_a_tenants_bodies_in_flight_are_bounded_and_given_back() -> None:
    intake = Intake(per_tenant=16 * MIB, total=24 * MIB)
    with contextlib.ExitStack() as held:
        for _ in range(4):
            held.enter_context(intake.hold("a", 4 * MIB))
        with pytest.raises(IntakeFull, match=r"tenant .a. has 16384 KiB .* \(at most 16 MiB") \
                as refused:
            held.enter_context(intake.hold("a", 4 * MIB))
        assert refused.value.status == 429 and refused.value.headers() == {"retry-after": "1"}
        held.enter_context(intake.hold("b", 4 * MIB))  # another tenant: its own budget
        with pytest.raises(IntakeFull, match="the router is reading 20 MiB"):
            held.enter_context(intake.hold("c", 8 * MIB))
        assert intake.held == {"a": 16 * MIB, "b": 4 * MIB}
    assert intake.held == {} and intake.held_total == 0  # given back however each ended
    # A body larger than a budget alone is read (it is under the 4 MiB body limit anyway).
    with Intake(per_tenant=1 * MIB).hold("a", 4 * MIB):
        pass
    with pytest.raises(ValueError), Intake().hold("a", MIB):
        raise ValueError("a refusal while reading")
