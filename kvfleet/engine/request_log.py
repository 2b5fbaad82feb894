"""Structured logs: JSON lines, one per finished request, never the text by default.

Prompts and outputs are customer data; they appear in the log only when the operator starts
the server with `--log-text` (a debugging aid). Every other record is ids, counts and
timings, so logs can be shipped and indexed without a data-handling review.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from typing import TextIO

from kvfleet.engine.metrics import FinishedRequestTimings

REQUEST_LOGGER = "kvfleet.engine.requests"
_request_logger = logging.getLogger(REQUEST_LOGGER)


class JsonLineFormatter(logging.Formatter):
    """One JSON object per record: `ts`, `level`, `logger`, `msg`, plus `record.fields`."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            payload.update(fields)
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, separators=(",", ":"), default=str)


def configure_json_logging(level: int = logging.INFO, stream: TextIO | None = None) -> None:
    """Route the `kvfleet` and `uvicorn` loggers to JSON lines on `stream` (stderr)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonLineFormatter())
    for name in ("kvfleet", "uvicorn", "uvicorn.error", "uvicorn.access"):
        log = logging.getLogger(name)
        log.handlers[:] = [handler]
        log.setLevel(level)
        log.propagate = False


@dataclass(frozen=True, slots=True)
class RequestLogRecord:
    request_id: str
    tenant: str
    idempotency_key: str | None
    priority: int
    timings: FinishedRequestTimings
    num_cached_tokens: int
    num_preemptions: int
    prompt: str | None = None
    output: str | None = None


def _seconds(end: float | None, start: float | None) -> float | None:
    if end is None or start is None:
        return None
    return round(max(0.0, end - start), 6)


def request_fields(record: RequestLogRecord) -> dict[str, object]:
    t = record.timings
    fields: dict[str, object] = {
        "event": "request_finished",
        "request_id": record.request_id,
        "tenant": record.tenant,
        "idempotency_key": record.idempotency_key,
        "priority": record.priority,
        "finish_reason": t.finish_reason,
        "prompt_tokens": t.num_prompt_tokens,
        "completion_tokens": t.num_output_tokens,
        "cached_tokens": record.num_cached_tokens,
        "preemptions": record.num_preemptions,
        "arrival_time": round(t.arrival_time, 6),
        "queue_s": _seconds(t.first_scheduled_time, t.arrival_time),
        "ttft_s": _seconds(t.first_token_time, t.arrival_time),
        "e2e_s": _seconds(t.finish_time, t.arrival_time),
        "tpot_s": (round((t.last_token_time - t.first_token_time)
                         / (t.num_output_tokens - 1), 6)
                   if t.num_output_tokens > 1 and t.first_token_time is not None
                   and t.last_token_time is not None else None),
    }
    if record.prompt is not None:
        fields["prompt"] = record.prompt
    if record.output is not None:
        fields["output"] = record.output
    return fields


def log_finished_request(record: RequestLogRecord) -> None:
    if _request_logger.isEnabledFor(logging.INFO):
        _request_logger.info("request finished", extra={"fields": request_fields(record)})
