"""kvfleet.engine: a vLLM-style inference engine (paged KV cache, continuous batching).

The public surface is `__all__`. Names resolve lazily, so importing a light module such as
`kvfleet.engine.config` (the CLI does) does not load torch.

Errors (see `kvfleet.engine.errors`):

    KvfleetEngineError
    ├── ModelLoadError
    │   ├── UnsupportedModelError
    │   └── ModelVerificationError  weights differ from the artifact manifest's sha256
    └── InvalidRequestError        .field names the request field
        └── ChatTemplateRejected   the model's chat template refuses the conversation
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfleet.engine.block_pool import BlockPool
    from kvfleet.engine.config import CacheConfig, SchedulerConfig, SchedulingPolicy
    from kvfleet.engine.engine import EngineCore, build_engine_core
    from kvfleet.engine.errors import (
        ChatTemplateRejected,
        InvalidRequestError,
        KvfleetEngineError,
        ModelLoadError,
        ModelVerificationError,
        UnsupportedModelError,
    )
    from kvfleet.engine.kv_cache_manager import KVCacheManager, PrefixHit, make_cache_salt
    from kvfleet.engine.llm import LLM, RequestOutput
    from kvfleet.engine.model.loader import LoadedModel, default_model_path, load_model
    from kvfleet.engine.request import (
        DeliveryState,
        FinishReason,
        Request,
        RequestStatus,
        RequestTimings,
        SamplingParams,
    )
    from kvfleet.engine.sampler import Sampler, StepLogits
    from kvfleet.engine.scheduler import Scheduler
    from kvfleet.engine.scheduler_output import ScheduledChunk, SchedulerOutput

_EXPORTS: dict[str, str] = {
    "LLM": "llm",
    "RequestOutput": "llm",
    "SamplingParams": "request",
    "Request": "request",
    "RequestStatus": "request",
    "DeliveryState": "request",
    "FinishReason": "request",
    "RequestTimings": "request",
    "CacheConfig": "config",
    "SchedulerConfig": "config",
    "SchedulingPolicy": "config",
    "EngineCore": "engine",
    "build_engine_core": "engine",
    "Scheduler": "scheduler",
    "SchedulerOutput": "scheduler_output",
    "ScheduledChunk": "scheduler_output",
    "KVCacheManager": "kv_cache_manager",
    "PrefixHit": "kv_cache_manager",
    "make_cache_salt": "kv_cache_manager",
    "BlockPool": "block_pool",
    "Sampler": "sampler",
    "StepLogits": "sampler",
    "load_model": "model.loader",
    "default_model_path": "model.loader",
    "LoadedModel": "model.loader",
    "KvfleetEngineError": "errors",
    "ModelLoadError": "errors",
    "UnsupportedModelError": "errors",
    "ModelVerificationError": "errors",
    "InvalidRequestError": "errors",
    "ChatTemplateRejected": "errors",
}

__all__ = [
    "LLM",
    "BlockPool",
    "CacheConfig",
    "ChatTemplateRejected",
    "DeliveryState",
    "EngineCore",
    "FinishReason",
    "InvalidRequestError",
    "KVCacheManager",
    "KvfleetEngineError",
    "LoadedModel",
    "ModelLoadError",
    "ModelVerificationError",
    "PrefixHit",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "RequestTimings",
    "Sampler",
    "SamplingParams",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulingPolicy",
    "StepLogits",
    "UnsupportedModelError",
    "build_engine_core",
    "default_model_path",
    "load_model",
    "make_cache_salt",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfleet.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvfleet.engine.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
