"""A generation request: its tokens, sampling parameters, tenant, deadline and states.

A request has two independent state machines:

- compute state (`RequestStatus`), owned by the scheduler:
  ACCEPTED → QUEUED → PREFILLING → DECODING → COMPLETED | CANCELLED | FAILED,
  with PREFILLING/DECODING → QUEUED on preemption (the KV is recomputed later);
- delivery state (`DeliveryState`), owned by whoever streams the output to a client:
  CONNECTED → STREAMING → ACKED | DISCONNECTED.

Transitions are idempotent: asking for the state a request is already in, or for any change
of a finished request, changes nothing and returns False. So cancelling twice, or cancelling a
request that has just completed, is harmless.

Invariant: `0 <= num_computed_tokens <= num_tokens`, and `num_tokens == len(prompt) +
len(output)`; the KV of the first `num_computed_tokens` tokens lives in the request's blocks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from kvfleet.engine.errors import InvalidRequestError


class RequestStatus(StrEnum):
    ACCEPTED = "accepted"
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.COMPLETED, RequestStatus.CANCELLED, RequestStatus.FAILED})

_ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.ACCEPTED: frozenset({RequestStatus.QUEUED} | _FINISHED),
    RequestStatus.QUEUED: frozenset({RequestStatus.PREFILLING, RequestStatus.DECODING}
                                    | _FINISHED),
    RequestStatus.PREFILLING: frozenset({RequestStatus.DECODING, RequestStatus.QUEUED}
                                        | _FINISHED),
    RequestStatus.DECODING: frozenset({RequestStatus.QUEUED} | _FINISHED),
}


class DeliveryState(StrEnum):
    CONNECTED = "connected"
    STREAMING = "streaming"
    DISCONNECTED = "disconnected"
    ACKED = "acked"


_DELIVERY_ALLOWED: dict[DeliveryState, frozenset[DeliveryState]] = {
    DeliveryState.CONNECTED: frozenset({DeliveryState.STREAMING, DeliveryState.DISCONNECTED,
                                        DeliveryState.ACKED}),
    DeliveryState.STREAMING: frozenset({DeliveryState.DISCONNECTED, DeliveryState.ACKED}),
}


class FinishReason(StrEnum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"

    @property
    def status(self) -> RequestStatus:
        """The compute state a request ends in for this reason."""
        if self in (FinishReason.STOP, FinishReason.LENGTH):
            return RequestStatus.COMPLETED
        if self is FinishReason.ERROR:
            return RequestStatus.FAILED
        return RequestStatus.CANCELLED


def _invalid(field_name: str, problem: str, remedy: str = "") -> InvalidRequestError:
    return InvalidRequestError(f"sampling_params.{field_name}", problem, remedy)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction.

    `temperature == 0` is greedy decoding. `top_k == 0` disables top-k. `seed` makes a
    request's sampled tokens reproducible whatever else shares its batch. Until `min_tokens`
    tokens are generated, eos and `stop_token_ids` cannot be sampled.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a single stop string is a common, harmless shorthand
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise _invalid("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise _invalid("temperature", f"must be >= 0, got {self.temperature}",
                           "use 0 for greedy decoding")
        if not (0 < self.top_p <= 1):
            raise _invalid("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise _invalid("top_k", f"must be an integer >= 0 (0 disables it), got "
                           f"{self.top_k!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise _invalid("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got "
                           f"{self.min_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise _invalid("stop", "stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise _invalid("stop_token_ids", "token ids must be integers >= 0")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class RequestTimings:
    """Instants (`time.monotonic()` seconds: a wall-clock step never moves a deadline or a
    latency) of a request's life, None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it.

    `priority`: lower values are served first under the priority policy (vLLM's convention).
    `deadline`: absolute `time.monotonic()` instant after which the request ends with
    finish_reason `deadline`. `cache_salt`: the prefix-cache scope (tenant scope, model hash,
    adapter, template version); requests with different salts never share cached blocks.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = "default"
    priority: int = 0
    deadline: float | None = None
    idempotency_key: str | None = None
    cache_salt: str = ""
    arrival_time: float | None = None
    prompt: str | None = None

    status: RequestStatus = field(default=RequestStatus.ACCEPTED, init=False)
    delivery: DeliveryState = field(default=DeliveryState.CONNECTED, init=False)
    finish_reason: FinishReason | None = field(default=None, init=False)
    error_message: str | None = field(default=None, init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    all_token_ids: list[int] = field(default_factory=list, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)  # prefix-cache hit at first schedule
    num_preemptions: int = field(default=0, init=False)
    timings: RequestTimings = field(init=False)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt", "is empty", "send at least one token of prompt")
        self.all_token_ids = list(self.prompt_token_ids)
        arrival = time.monotonic() if self.arrival_time is None else self.arrival_time
        self.arrival_time = arrival
        self.timings = RequestTimings(arrival_time=arrival)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Tokens this request can ever hold: prompt plus every token it may generate."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def transition(self, new_status: RequestStatus) -> bool:
        """Move to `new_status`; False (and no change) if already there or not allowed."""
        if new_status is self.status or new_status not in _ALLOWED.get(self.status, frozenset()):
            return False
        self.status = new_status
        return True

    def finish(self, reason: FinishReason, now: float, error_message: str | None = None) -> bool:
        """End the request; idempotent (the first reason wins)."""
        if not self.transition(reason.status):
            return False
        self.finish_reason = reason
        self.error_message = error_message
        self.timings.finish_time = now
        return True

    def set_delivery(self, new_state: DeliveryState) -> bool:
        allowed = _DELIVERY_ALLOWED.get(self.delivery, frozenset())
        if new_state is self.delivery or new_state not in allowed:
            return False
        self.delivery = new_state
        return True

    def append_output_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.timings.first_token_time is None:
            self.timings.first_token_time = now
        self.timings.last_token_time = now
