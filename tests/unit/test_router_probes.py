"""Greedy probes: the scoring, the probe's body, reading its answer, its prompt id."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from kvfleet.router.probes import (
    PROBE_MAX_TOKENS,
    ProbeAnswer,
    agreement,
    compare_answers,
    probe_answer,
    probe_body,
    probe_id,
)


def test_agreement_counts_the_common_prefix_over_the_longer_answer() -> None:
    assert agreement([1, 2, 3], [1, 2, 3]) == (3, 3)
    assert agreement([1, 2, 3], [1, 9, 3]) == (1, 3)  # nothing after a difference counts
    assert agreement([1, 2], [1, 2, 3, 4]) == (2, 4)  # stopping early disagrees
    assert agreement([], []) == (0, 0)


@given(st.lists(st.integers(0, 5), max_size=12), st.lists(st.integers(0, 5), max_size=12))
def test_agreement_is_symmetric_bounded_and_total_only_for_equal_answers(
        a: list[int], b: list[int]) -> None:
    agreed, compared = agreement(a, b)
    assert (agreed, compared) == agreement(b, a)
    assert 0 <= agreed <= compared == max(len(a), len(b))
    assert (agreed == compared) == (a == b)


def test_a_probe_is_greedy_capped_unbilled_and_asks_for_token_ids() -> None:
    live = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.3, "top_p": 0.5,
            "seed": 7, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 500, "stop": ["\n\n"], "user": "conv-1", "priority": -2}
    probe = probe_body(live)
    assert probe == {"messages": live["messages"], "stop": ["\n\n"], "temperature": 0.0,
                     "max_tokens": PROBE_MAX_TOKENS, "stream": False,
                     "return_token_ids": True, "priority": 1000}
    assert probe_body({"prompt": "x", "max_completion_tokens": 4})["max_tokens"] == 4
    assert probe_body({"prompt": "x", "max_tokens": "lots"})["max_tokens"] == PROBE_MAX_TOKENS


def test_only_a_complete_answer_gives_token_ids_and_its_text() -> None:
    def body(**choice: object) -> bytes:
        return json.dumps({"choices": [{"finish_reason": "length", "text": "hi", **choice}]
                           }).encode()

    assert probe_answer(200, body(token_ids=[5, 6])) == ProbeAnswer([5, 6], "hi")
    chat = json.dumps({"choices": [{"message": {"content": "yo"}, "token_ids": [1]}]}).encode()
    assert probe_answer(200, chat) == ProbeAnswer([1], "yo")
    assert probe_answer(200, body(token_ids=[5], finish_reason="error")) is None
    assert probe_answer(400, body(token_ids=[5])) is None
    assert probe_answer(200, body()) is None
    assert probe_answer(200, b"not json") is None
    assert probe_answer(200, body(token_ids=["5"])) is None


def test_a_probe_agrees_in_full_only_on_the_same_ids_and_the_same_text() -> None:
    """Scored by ids alone, a tokenizer broken only in decoding (same ids, another text) agreed
    on every token."""
    same = compare_answers(ProbeAnswer([1, 2], "ab"), ProbeAnswer([1, 2], "ab"))
    assert same == (2, 2, True)
    assert compare_answers(ProbeAnswer([1, 2], "a\ufffd"), ProbeAnswer([1, 2], "ab")) == (
        0, 2, False)
    assert compare_answers(ProbeAnswer([1, 3], "ac"), ProbeAnswer([1, 2], "ab")) == (
        1, 2, False)


def test_the_prompt_id_is_salted_with_the_tenant_and_reveals_no_text() -> None:
    assert probe_id("team-a", "secret") == probe_id("team-a", "secret")
    assert probe_id("team-a", "secret") != probe_id("team-b", "secret")
    assert len(probe_id("team-a", "secret")) == 12 and "secret" not in probe_id("a", "secret")
