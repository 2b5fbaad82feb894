"""What each answer counts as (kvfleet.router.outcome), row by row, and that the analysis'
queries and the engine's refusal codes agree with it."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest

from kvfleet.api.analysis import BUILTINS, Window, render
from kvfleet.api.rollout import SLOMetric
from kvfleet.engine.server import STATUS_BY_CODE
from kvfleet.router.outcome import (
    CLIENT_CODES,
    JUDGED,
    REVISION_CODES,
    Outcome,
    classify,
    read_answer,
    read_frames,
    stream_outcome,
)


@pytest.mark.parametrize(("status", "code", "finish_reasons", "expected"), [
    (200, None, ["stop"], Outcome.COMPLETED),
    (200, None, ["length"], Outcome.COMPLETED),
    (200, None, [], Outcome.COMPLETED),
    (200, None, ["error"], Outcome.STREAM_ERROR),  # the engine's step failed under a 200
    (200, "internal_error", ["stop"], Outcome.STREAM_ERROR),  # an error frame
    (200, "error", [], Outcome.STREAM_ERROR),  # an error frame naming no code
    (400, "context_length_exceeded", [], Outcome.REVISION_REFUSED),
    (400, "kv_capacity_exceeded", [], Outcome.REVISION_REFUSED),
    (429, "queue_full", [], Outcome.REVISION_REFUSED),
    (429, "tenant_concurrency_exceeded", [], Outcome.REVISION_REFUSED),
    (429, None, [], Outcome.REVISION_REFUSED),  # any engine 429: the router enforced the quota
    (401, "router_proof_required", [], Outcome.REVISION_REFUSED),
    (403, None, [], Outcome.REVISION_REFUSED),
    (404, "not_found", [], Outcome.REVISION_REFUSED),
    (405, "method_not_allowed", [], Outcome.REVISION_REFUSED),
    (503, "not_ready", [], Outcome.REVISION_REFUSED),
    (400, "invalid_request_error", [], Outcome.CLIENT_ERROR),
    (400, "unsupported_parameter", [], Outcome.CLIENT_ERROR),
    (400, "invalid_tenant", [], Outcome.CLIENT_ERROR),
    (400, None, [], Outcome.CLIENT_ERROR),
    (409, "idempotency_key_reused", [], Outcome.CLIENT_ERROR),
    (413, "request_too_large", [], Outcome.CLIENT_ERROR),
    (500, "internal_error", [], Outcome.UPSTREAM_ERROR),
    (502, "upstream_failed", [], Outcome.UPSTREAM_ERROR),  # the router's: replica gone mid-answer
    (503, "no_ready_replica", [], Outcome.UPSTREAM_ERROR),  # the router's: no replica answered
    (302, None, [], Outcome.UPSTREAM_ERROR),
    (499, None, [], Outcome.CLIENT_GONE),
])
def test_each_answer_has_one_outcome(status: int, code: str | None,
                                     finish_reasons: list[str], expected: Outcome) -> None:
    assert classify(status, code, finish_reasons) is expected


def test_every_refusal_code_the_engine_has_is_decided() -> None:
    """A new engine code must be placed on one side: the revision's fault or the client's."""
    for code, status in STATUS_BY_CODE.items():
        decided = code in REVISION_CODES or code in CLIENT_CODES or status >= 500
        assert decided, f"{code} ({status}): add it to REVISION_CODES or CLIENT_CODES"
    assert not REVISION_CODES & CLIENT_CODES


@pytest.mark.parametrize(("first_byte", "ended", "lost", "code", "reasons", "expected"), [
    (True, True, False, None, ["stop"], Outcome.COMPLETED),
    (True, True, False, None, ["error"], Outcome.STREAM_ERROR),
    (True, True, False, "internal_error", [], Outcome.STREAM_ERROR),
    (True, False, True, None, [], Outcome.STREAM_ERROR),  # the router lost the replica
    (False, False, False, None, [], Outcome.CLIENT_GONE),  # gone before the first byte
    (True, False, False, None, [], Outcome.CLIENT_GONE),  # gone mid-answer
    (True, False, False, None, ["stop"], Outcome.COMPLETED),  # gone after the last frame
    (True, False, False, "internal_error", [], Outcome.STREAM_ERROR),  # gone after an error
])
def test_a_streams_outcome(first_byte: bool, ended: bool, lost: bool, code: str | None,
                           reasons: list[str], expected: Outcome) -> None:
    assert stream_outcome(200, first_byte=first_byte, ended=ended, lost=lost, error_code=code,
                          finish_reasons=reasons) is expected


def _frame(obj: object) -> bytes:
    return b"id: 1\ndata: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def test_frames_are_read_for_text_finish_error_and_usage() -> None:
    role = _frame({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    text = _frame({"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]})
    done = _frame({"choices": [{"text": "!", "finish_reason": "error"}],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    error = _frame({"error": {"message": "boom", "code": "upstream_failed"}})
    assert read_frames(role).texts == []  # a role-only delta is no token
    reading = read_frames(role + text + done + error + b"data: [DONE]\n\n")
    assert reading.texts == ["Hi", "!"]
    assert reading.finish_reasons == ["error"]
    assert reading.error_code == "upstream_failed"
    assert reading.usage == (5, 2)
    assert read_frames(_frame({"error": "a bare string"})).error_code == "error"
    # Once the first text was timed, frames that carry no finish, error or usage are skipped
    # unparsed (the engine leaves a null finish_reason out).
    bare = _frame({"choices": [{"delta": {"content": "Hi"}}]})
    assert read_frames(bare + done, want_text=False).texts == ["!"]


def test_whole_answers_are_read_by_status_and_body() -> None:
    ok = json.dumps({"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode()
    answer = read_answer(200, ok)
    assert (answer.outcome, answer.text, answer.usage) == (Outcome.COMPLETED, "ok", (3, 1))
    failed = ok.replace(b'"stop"', b'"error"')
    assert read_answer(200, failed).outcome is Outcome.STREAM_ERROR
    assert read_answer(200, failed).text is None  # not compared with a shadow answer
    refusal = json.dumps({"error": {"code": "kv_capacity_exceeded"}}).encode()
    assert read_answer(400, refusal).outcome is Outcome.REVISION_REFUSED
    assert read_answer(200, b"<html>").outcome is Outcome.STREAM_ERROR  # no answer a client can use
    assert read_answer(429, b"busy").outcome is Outcome.REVISION_REFUSED


def _outcomes_in(query: str, operator: str) -> set[str]:
    (names,) = re.findall(r'outcome' + operator + r'"([^"]*)"', query)
    return set(names.split("|"))


def test_the_error_rate_counts_the_revisions_failures_over_the_requests_that_judge_it() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    window = Window(0, 1, t0, t0 + timedelta(seconds=60))
    builtin = BUILTINS[SLOMetric.ERROR_RATE]
    query = render(builtin.query, pool="smol", namespace="llm", revision="a" * 64,
                   traffic="live", window=window)
    assert _outcomes_in(query, "=~") == {o.value for o in JUDGED - {Outcome.COMPLETED}}
    assert _outcomes_in(query, "!~") == {o.value for o in set(Outcome) - JUDGED}
    assert '{namespace="llm",pool="smol",' in query


def test_the_running_usage_of_every_chunk_is_read_without_parsing_it() -> None:
    """What bills a stream its client cut short: the last running count relayed (the router
    asks the engine for one on every chunk)."""
    def chunk(n: int, finish: str | None = None) -> bytes:
        return _frame({"choices": [{"delta": {"content": f"t{n}"}, "finish_reason": finish}],
                       "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                 "total_tokens": 7 + n}})
    reading = read_frames(b"".join(chunk(n) for n in range(1, 101)), want_text=False)
    assert reading.usage == (7, 100) and reading.texts == []  # none of them parsed
    assert read_frames(chunk(3) + chunk(4, "stop"), want_text=False).finish_reasons == ["stop"]
    spaced = b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 9}}\n\n'
    assert read_frames(spaced, want_text=False).usage == (2, 9)
