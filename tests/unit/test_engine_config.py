from __future__ import annotations

from typing import Any

import pytest

from kvfleet.engine.config import MIB, CacheConfig, SchedulerConfig, SchedulingPolicy


@pytest.mark.parametrize(("options", "message"), [
    ({"block_size": 0}, "cache.block_size must be a positive power of two, got 0"),
    ({"block_size": 12}, "cache.block_size must be a positive power of two, got 12"),
    ({"num_blocks": 0}, "cache.num_blocks must be positive"),
    ({"kv_cache_memory_bytes": -1}, "cache.kv_cache_memory_bytes must be positive"),
])
def test_cache_config_rejects_bad_values(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        CacheConfig(**options)


def test_num_blocks_comes_from_the_memory_budget_unless_given() -> None:
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K and V) x 4 bytes = 46080 B/token.
    assert CacheConfig(kv_cache_memory_bytes=512 * MIB).resolve_num_blocks(46080) == 728
    assert CacheConfig(num_blocks=10).resolve_num_blocks(46080) == 10
    with pytest.raises(ValueError, match="holds no block"):
        CacheConfig(kv_cache_memory_bytes=1000).resolve_num_blocks(46080)


@pytest.mark.parametrize(("options", "message"), [
    ({"max_num_batched_tokens": 0}, "scheduler.max_num_batched_tokens must be positive"),
    ({"max_num_running": 0}, "scheduler.max_num_running must be positive"),
    ({"long_prefill_token_threshold": 0}, "scheduler.long_prefill_token_threshold"),
    ({"policy": "lottery"}, "scheduler.policy must be one of"),
    ({"tenant_weights": {"a": 0}}, r"scheduler.tenant_weights\['a'\] must be positive"),
    ({"priority_aging_seconds": 0}, "scheduler.priority_aging_seconds must be positive"),
])
def test_scheduler_config_rejects_bad_values(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**options)


def test_scheduler_config_normalises_policy_and_freezes_weights() -> None:
    config = SchedulerConfig(policy="priority", tenant_weights={"gold": 2.0})  # type: ignore[arg-type]
    assert config.policy is SchedulingPolicy.PRIORITY
    assert config.tenant_weight("gold") == 2.0 and config.tenant_weight("other") == 1.0
    with pytest.raises(TypeError):
        config.tenant_weights["gold"] = 5.0  # type: ignore[index]
