"""Admission control: what an engine refuses before queueing, as a pure function.

Checked in this order, cheapest and most permanent first, so a request that can never run is
told so (400) rather than asked to retry (429):

    ServingError                         .code is stable, .param names the field if any
    ├── NotAcceptingError                starting up or draining (503, retry elsewhere)
    ├── ContextLengthError               prompt + max_tokens beyond the model's context (400)
    ├── KVCapacityError                  could never fit the whole KV pool (400)
    ├── QueueFullError                   too many requests in flight (429 + Retry-After)
    ├── TenantConcurrencyError           the tenant has too many in flight (429 + Retry-After)
    └── IdempotencyConflictError         key reused with a different body (409)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.engine.errors import KvfleetEngineError


class ServingError(KvfleetEngineError):
    code = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after


class ContextLengthError(ServingError):
    code = "context_length_exceeded"


class KVCapacityError(ServingError):
    code = "kv_capacity_exceeded"


class QueueFullError(ServingError):
    code = "queue_full"


class TenantConcurrencyError(ServingError):
    code = "tenant_concurrency_exceeded"


class NotAcceptingError(ServingError):
    code = "not_ready"


class IdempotencyConflictError(ServingError):
    code = "idempotency_key_reused"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the server says about the model and what admission checks against."""

    name: str
    revision: str
    max_context: int
    block_size: int
    num_kv_blocks: int


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_in_flight: int = 512  # admitted, unfinished requests (running + waiting)
    max_in_flight_per_tenant: int = 256
    retry_after_seconds: int = 1


def check_admission(num_prompt: int, max_tokens: int, tenant: str, model: ServedModel,
                    limits: AdmissionLimits, *, accepting: bool, num_in_flight: int,
                    num_tenant_in_flight: int) -> None:
    """Raise the ServingError that refuses this request, or return if it may be queued."""
    if not accepting:
        raise NotAcceptingError("the engine is not accepting requests (starting or "
                                "draining); retry on another replica",
                                retry_after=limits.retry_after_seconds)
    if num_prompt >= model.max_context:
        raise ContextLengthError(
            f"the prompt has {num_prompt} tokens; this model's context is "
            f"{model.max_context} tokens and at least one must be left to generate. "
            "Shorten the prompt", "prompt")
    if num_prompt + max_tokens > model.max_context:
        raise ContextLengthError(
            f"max_tokens={max_tokens} plus the prompt's {num_prompt} tokens exceeds the "
            f"model's context of {model.max_context} tokens; set max_tokens <= "
            f"{model.max_context - num_prompt}", "max_tokens")
    kv_tokens = model.num_kv_blocks * model.block_size
    if num_prompt + max_tokens > kv_tokens:
        raise KVCapacityError(
            f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) needs more "
            f"KV cache than this engine has in total ({kv_tokens} tokens), so it could "
            "never run; lower max_tokens or send it to a larger pool", "max_tokens")
    if num_in_flight >= limits.max_in_flight:
        raise QueueFullError(f"the engine queue is full ({limits.max_in_flight} "
                             "requests in flight); retry after the delay given",
                             retry_after=limits.retry_after_seconds)
    if num_tenant_in_flight >= limits.max_in_flight_per_tenant:
        raise TenantConcurrencyError(
            f"tenant {tenant!r} already has {limits.max_in_flight_per_tenant} "
            "requests in flight, its limit on this engine; retry after the delay given",
            retry_after=limits.retry_after_seconds)
