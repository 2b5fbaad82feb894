"""Stop strings applied once, incrementally (kvfleet.engine.stop): what a stream may show."""

from __future__ import annotations

import random

import pytest

from kvfleet.engine.stop import StopStrings


def _stream(pieces: list[str], stop: tuple[str, ...]) -> tuple[str, StopStrings]:
    out = StopStrings(stop)
    shown = "".join(out.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces))
    return shown, out


def test_a_stop_string_split_over_pieces_is_never_shown() -> None:
    shown, out = _stream(["Hello wor", "ld. EN", "D here", " and more"], ("END",))
    assert shown == out.text == "Hello world. " and out.hit


def test_the_tail_that_may_start_a_stop_string_is_held_until_it_cannot() -> None:
    out = StopStrings(["STOP"])
    assert out.feed("abcST") == "abc"  # "ST" could begin "STOP"
    assert out.feed("x") == "STx"  # "STx" cannot: released
    assert out.feed("S") == ""
    assert out.feed("T", final=True) == "ST"  # the end releases everything
    assert not out.hit


def test_the_earliest_of_several_stops_wins_and_nothing_follows() -> None:
    shown, out = _stream(["one two", " three four"], ("four", "two"))
    assert shown == "one " and out.hit
    assert out.feed("more") == "" and out.text == "one "


def test_without_stops_everything_is_shown_at_once() -> None:
    out = StopStrings(["", ""])  # empty stops are no stops
    assert out.feed("abc") == "abc" and out.feed("d") == "d" and not out.hit


@pytest.mark.parametrize("seed", range(20))
def test_incremental_equals_a_search_of_the_whole_text(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice("ab c") for _ in range(200))
    stops = tuple({"".join(rng.choice("abc") for _ in range(rng.randint(1, 5))) for _ in range(3)})
    pieces, at = [], 0
    while at < len(text):
        step = rng.randint(0, 7)
        pieces.append(text[at:at + step])
        at += step
    shown, out = _stream([*pieces, ""], stops)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[:min(hits)] if hits else text
    assert shown == out.text == expected and out.hit == bool(hits)
