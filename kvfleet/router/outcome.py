"""What a request's client got, as one low-cardinality `outcome`, read from the engine's answer
(pure: the router's HTTP edge feeds it status lines, bodies and SSE frames).

The Rollout analysis judges a revision by these (kvfleet.api.analysis: `ErrorRate` counts
`stream_error`, `revision_refused` and `upstream_error`), so the line between the revision's
fault and the client's is drawn here, once:

    outcome            what the client got
    completed          the whole answer (2xx, no error inside)
    stream_error       a 200 that failed inside: an error frame, a choice with
                       finish_reason "error" (streamed or not), or the replica lost mid-stream
    revision_refused   the engine refused what the same prompt on another revision may serve:
                       context length, KV capacity, queue or tenant concurrency full (429),
                       the router's proof refused (403; a 401 is tried on another replica and
                       ends as upstream_error if none answers), not ready (503),
                       the route or model missing (404/405: the router strips `model` and
                       only forwards the two OpenAI routes every engine serves)
    client_error       the client's own request, which every revision refuses alike (invalid
                       JSON or fields, unsupported parameters, a reused idempotency key, a body
                       over the limit)
    upstream_error     no engine answered: 5xx, every replica failed, the replica went away
                       before its whole answer
    client_gone        the client left before the first byte of the answer, or mid-stream
                       before the answer ended with no error seen

A context or KV refusal is counted against the revision although the prompt is the client's:
a canary with a smaller context or cache refuses prompts stable serves, and that is exactly
what a rollout must catch. A prompt over *every* revision's context is refused by stable too,
so both sides of a canary-vs-stable comparison see it.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Outcome(StrEnum):
    COMPLETED = "completed"
    STREAM_ERROR = "stream_error"
    REVISION_REFUSED = "revision_refused"
    CLIENT_ERROR = "client_error"
    UPSTREAM_ERROR = "upstream_error"
    CLIENT_GONE = "client_gone"


# The engine's refusal codes (kvfleet.engine.server.STATUS_BY_CODE) that are the revision's
# fault; every other 4xx code is the client's. tests/unit/test_router_outcome.py fails when the
# engine grows a code this table does not decide.
REVISION_CODES = frozenset({
    "context_length_exceeded", "kv_capacity_exceeded", "queue_full",
    "tenant_concurrency_exceeded", "router_proof_required", "not_ready", "model_not_found",
    "not_found", "method_not_allowed", "chat_template_missing",
    # The model's template refusing a well-formed conversation: the revision's doing.
    "chat_template_rejected",
})
CLIENT_CODES = frozenset({
    "invalid_request_error", "unsupported_parameter", "idempotency_key_reused",
    "request_too_large",
    # The tenant header is the router's (from the tenant's key): a name the engine refuses is
    # refused by every revision, so it says nothing about this one.
    "invalid_tenant",
})
# Statuses that are the revision's whatever the code: the router authenticated the client and
# enforced its quota before forwarding, so an engine's 401/403/429 is about the engine.
REVISION_STATUSES = frozenset({401, 403, 404, 405, 429})
# The outcomes the rollout analysis counts as requests (ErrorRate's denominator, the samples
# of a custom query) and that give latency samples: answers the revision gave or failed to
# give. A client's own error or departure says nothing about the revision, and its share
# depends on the clients, so it would only dilute the error rate.
JUDGED = frozenset({Outcome.COMPLETED, Outcome.STREAM_ERROR, Outcome.REVISION_REFUSED,
                    Outcome.UPSTREAM_ERROR})
# End-to-end latency is observed for answers a revision gave (a refusal too: leaving the
# refused requests out would make a revision that refuses its slow prompts look fast). An
# upstream_error's duration is the router's connect and retry budget, not the revision's.
TIMED = frozenset({Outcome.COMPLETED, Outcome.STREAM_ERROR, Outcome.REVISION_REFUSED})
CLIENT_GONE_STATUS = 499  # nginx's (and the engine's) status for a client gone before the answer


def classify(status: int, error_code: str | None = None,
             finish_reasons: Iterable[str | None] = ()) -> Outcome:
    """The outcome of an answer with HTTP `status`. `error_code` is the error object's code
    (in a refusal's body, or an error frame inside a 200); `finish_reasons` are the choices'."""
    if 200 <= status < 300:
        failed = error_code is not None or "error" in finish_reasons
        return Outcome.STREAM_ERROR if failed else Outcome.COMPLETED
    if status == CLIENT_GONE_STATUS:
        return Outcome.CLIENT_GONE
    if error_code in REVISION_CODES:  # before the 5xx rule: an engine's 503 not_ready
        return Outcome.REVISION_REFUSED
    if status < 400 or status >= 500:
        return Outcome.UPSTREAM_ERROR
    if status in REVISION_STATUSES:
        return Outcome.REVISION_REFUSED
    return Outcome.CLIENT_ERROR


def stream_outcome(status: int, *, first_byte: bool, ended: bool, lost: bool,
                   error_code: str | None, finish_reasons: Sequence[str]) -> Outcome:
    """A relayed stream's outcome. `first_byte`: a byte of the answer reached the client;
    `ended`: the engine's stream ended; `lost`: the router lost the replica mid-stream (and
    ended the client's stream with its own error frame)."""
    if lost:
        return Outcome.STREAM_ERROR
    if not first_byte:
        return Outcome.CLIENT_GONE
    outcome = classify(status, error_code, finish_reasons)
    # A finish reason is the answer's last frame: a client gone after it got the whole answer.
    if outcome is Outcome.COMPLETED and not ended and not finish_reasons:
        return Outcome.CLIENT_GONE  # an abandoned answer is no completed one
    return outcome


def _error_code(error: Any) -> str:
    """An error object's code; "error" when it names none (a bare string, a code of null)."""
    if isinstance(error, dict):
        return str(error.get("code") or error.get("type") or "error")
    return "error"


def _usage(obj: dict[str, Any]) -> tuple[int, int] | None:
    """(prompt, completion) tokens of an answer or a frame, if it carries them."""
    with contextlib.suppress(KeyError, TypeError, ValueError):
        usage = obj["usage"]
        return int(usage["prompt_tokens"]), int(usage["completion_tokens"])
    return None


def _choices(obj: dict[str, Any]) -> list[dict[str, Any]]:
    choices = obj.get("choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def _text(choice: dict[str, Any]) -> str:
    """A choice's text: a chat delta's or message's content, or a completion's text."""
    for key in ("delta", "message"):
        part = choice.get(key)
        if isinstance(part, dict):
            return str(part.get("content") or "")
    return str(choice.get("text") or "")


@dataclass(slots=True)
class FrameReading:
    """What some complete SSE frames said."""

    texts: list[str] = field(default_factory=list)  # non-empty text pieces, in order
    finish_reasons: list[str] = field(default_factory=list)
    error_code: str | None = None  # the first error frame's code
    usage: tuple[int, int] | None = None  # (prompt, completion), the last one sent


# A frame that none of these is in carries no finish or error: skipped unparsed when the text
# is not wanted (the relay's per-token cost once the first content token was timed), but for
# its running usage, read without parsing the JSON (every streamed chunk carries one: the
# router asks for it, to bill a stream cut short).
_MARKERS = (b'"finish_reason":"', b'"finish_reason": "', b'"error"')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


def _running_usage(payload: bytes) -> tuple[int, int] | None:
    prompt, completion = _PROMPT_TOKENS.search(payload), _COMPLETION_TOKENS.search(payload)
    if prompt is None or completion is None:
        return None
    return int(prompt.group(1)), int(completion.group(1))


def read_frames(frames: bytes, *, want_text: bool = True) -> FrameReading:
    """Complete SSE frames (`data: {...}` lines; `id:`, comments and `[DONE]` skipped)."""
    reading = FrameReading()
    for line in frames.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if not payload.startswith(b"{"):
            continue
        if not want_text and not any(m in payload for m in _MARKERS):
            reading.usage = _running_usage(payload) or reading.usage
            continue
        try:
            obj = json.loads(payload)
        except ValueError:
            continue
        if "error" in obj and reading.error_code is None:
            reading.error_code = _error_code(obj["error"])
        for choice in _choices(obj):
            if text := _text(choice):
                reading.texts.append(text)
            if choice.get("finish_reason"):
                reading.finish_reasons.append(str(choice["finish_reason"]))
        reading.usage = _usage(obj) or reading.usage
    return reading


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole (non-streamed) answer as read from its status and body."""

    outcome: Outcome
    text: str | None = None  # the first choice's text, when the answer completed
    finish_reasons: tuple[str, ...] = ()
    usage: tuple[int, int] | None = None


def read_answer(status: int, body: bytes) -> Answer:
    """A non-streamed answer: a 2xx's choices, or a refusal's error code."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        # An unreadable 2xx is no answer the client can use; a refusal by its status alone.
        return Answer(classify(status, "unreadable_answer" if 200 <= status < 300 else None))
    error_code = _error_code(obj["error"]) if "error" in obj else None
    choices = _choices(obj)
    reasons = tuple(str(c["finish_reason"]) for c in choices if c.get("finish_reason"))
    outcome = classify(status, error_code, reasons)
    text = _text(choices[0]) if outcome is Outcome.COMPLETED and choices else None
    return Answer(outcome, text, reasons, _usage(obj))
