"""Engine configuration: one frozen dataclass per subsystem, validated on construction.

Every check raises `ValueError` naming the field and the accepted range, so a bad flag or
ServingPool setting fails at start-up with a message the operator can act on, never later in
the middle of a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

MIB = 1024 * 1024
DEFAULT_KV_CACHE_MEMORY_BYTES = 512 * MIB


class SchedulingPolicy(StrEnum):
    """Order in which waiting requests are admitted (fairness across tenants applies to both)."""

    FCFS = "fcfs"
    PRIORITY = "priority"  # lower `Request.priority` value first, aged by waiting time


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache: `num_blocks` blocks of `block_size` token slots each.

    `num_blocks=None` means "size the pool from `kv_cache_memory_bytes`", which needs the
    model's bytes per token (see `resolve_num_blocks`).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES
    enable_prefix_caching: bool = True
    # float32, bfloat16 or float16 (see kvfleet.engine.device: "auto" is resolved there).
    kv_cache_dtype: str = "float32"

    def __post_init__(self) -> None:
        _require(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            f"cache.block_size must be a positive power of two, got {self.block_size}",
        )
        _require(
            self.num_blocks is None or self.num_blocks > 0,
            f"cache.num_blocks must be positive (or None to size from memory), "
            f"got {self.num_blocks}",
        )
        _require(
            self.kv_cache_memory_bytes > 0,
            f"cache.kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}",
        )
        _require(self.kv_cache_dtype in ("float32", "bfloat16", "float16"),
                 f"cache.kv_cache_dtype must be float32, bfloat16 or float16, got "
                 f"{self.kv_cache_dtype!r}")

    def resolve_num_blocks(self, kv_bytes_per_token: int) -> int:
        """The pool size: explicit `num_blocks`, else as many blocks as the budget holds."""
        if self.num_blocks is not None:
            return self.num_blocks
        _require(kv_bytes_per_token > 0, f"kv_bytes_per_token must be positive, got "
                 f"{kv_bytes_per_token}")
        num_blocks = self.kv_cache_memory_bytes // (kv_bytes_per_token * self.block_size)
        _require(
            num_blocks > 0,
            f"cache.kv_cache_memory_bytes={self.kv_cache_memory_bytes} holds no block of "
            f"{self.block_size} tokens at {kv_bytes_per_token} bytes per token; raise it",
        )
        return num_blocks


# `kvfleet serve`'s cap on a step's prompt tokens on the CPU (see SchedulerConfig): about 50
# ms of prefill on 2 cores of an AVX2 host. Closed loop of 16 / 32 streams there (prompts
# 32-256 tokens, 96 out): TTFT p50 0.15 / 0.19 s, p95 0.36 / 0.40 s, where no cap gave 1.96 /
# 2.28 and 2.74 / 4.93 s, at the same decode throughput. A GPU computes a step's prompts in
# milliseconds; there the cap is off unless set.
CPU_PREFILL_TOKENS_PER_STEP = 64


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Token-budget scheduling.

    - `max_num_batched_tokens`: tokens computed per step, prefill and decode together.
    - `max_num_running`: requests holding KV blocks at once (the decode batch size).
    - `long_prefill_token_threshold`: the largest prefill chunk one request gets per step,
      so a long prompt cannot monopolise a step and stall everyone's decode.
    - `max_prefill_tokens_per_step`: prompt tokens of one step's prefill chunks together,
      except that its first chunk always gets up to `long_prefill_token_threshold`; None: the
      step's budget. A low cap prefills a burst of arrivals a few per step, so they start
      decoding, and finish, one after another. Without it, requests admitted together finish
      together, their successors arrive together, and each such wave waits on one long step
      of all their prompts (a closed loop of 16 streams on 2 cores: TTFT p50 ~2 s, not 0.2).
    - `tenant_weights`: relative token share per tenant; unnamed tenants weigh 1.0.
    - `priority_aging_seconds`: under the priority policy, each this many seconds of waiting
      raise a request by one priority level, so low priority never starves.
    """

    max_num_batched_tokens: int = 2048
    max_num_running: int = 64
    long_prefill_token_threshold: int = 512
    max_prefill_tokens_per_step: int | None = None
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    priority_aging_seconds: float = 10.0

    def __post_init__(self) -> None:
        _require(
            self.max_num_batched_tokens > 0,
            f"scheduler.max_num_batched_tokens must be positive, got "
            f"{self.max_num_batched_tokens}",
        )
        _require(
            self.max_num_running > 0,
            f"scheduler.max_num_running must be positive, got {self.max_num_running}",
        )
        _require(
            self.long_prefill_token_threshold > 0,
            f"scheduler.long_prefill_token_threshold must be positive, got "
            f"{self.long_prefill_token_threshold}",
        )
        _require(
            self.max_prefill_tokens_per_step is None or self.max_prefill_tokens_per_step > 0,
            f"scheduler.max_prefill_tokens_per_step must be positive or unset, got "
            f"{self.max_prefill_tokens_per_step}",
        )
        try:
            # Accept the plain string a CLI flag or a ServingPool field carries.
            object.__setattr__(self, "policy", SchedulingPolicy(self.policy))
        except ValueError:
            raise ValueError(
                f"scheduler.policy must be one of {[p.value for p in SchedulingPolicy]}, "
                f"got {self.policy!r}"
            ) from None
        for tenant, weight in self.tenant_weights.items():
            _require(
                weight > 0,
                f"scheduler.tenant_weights[{tenant!r}] must be positive, got {weight}",
            )
        _require(
            self.priority_aging_seconds > 0,
            f"scheduler.priority_aging_seconds must be positive, got "
            f"{self.priority_aging_seconds}",
        )
        # Freeze the mapping too: a frozen dataclass with a mutable dict inside is not frozen.
        object.__setattr__(self, "tenant_weights", MappingProxyType(dict(self.tenant_weights)))

    def tenant_weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)
