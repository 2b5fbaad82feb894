"""`LLM`: offline batch generation, vLLM's `LLM` in miniature.

    llm = LLM()                                  # the embedded SmolLM2-135M-Instruct
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    outputs = llm.generate([[{"role": "user", "content": "Hi"}]])   # chat, via the template

Every prompt is validated before any is queued, so a bad one fails the whole call with an
`InvalidRequestError` naming the field (and which prompt), and nothing is truncated silently.
Stop strings are matched on the detokenized text here; the output is cut before the match.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from kvfleet.engine.config import (
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    CacheConfig,
    SchedulerConfig,
    SchedulingPolicy,
)
from kvfleet.engine.engine import EngineCore, build_engine_core
from kvfleet.engine.errors import InvalidRequestError
from kvfleet.engine.metrics import EngineStats
from kvfleet.engine.request import FinishReason, Request, SamplingParams
from kvfleet.engine.stop import StopStrings
from kvfleet.engine.tokenizer import IncrementalDetokenizer

ChatMessages = Sequence[Mapping[str, Any]]
PromptInput = str | ChatMessages


class TokenizerProtocol(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class ChatTemplateProtocol(Protocol):
    def render(self, messages: ChatMessages, add_generation_prompt: bool = True,
               **extra: Any) -> str: ...


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One finished request. Times are `time.monotonic()` seconds: only differences mean
    anything."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    num_cached_tokens: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - \
            self.arrival_time


class LLM:
    def __init__(self, model: str | Path | None = None, *, block_size: int = 16,
                 num_kv_blocks: int | None = None,
                 kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES,
                 enable_prefix_caching: bool = True, max_num_batched_tokens: int = 2048,
                 max_num_running: int = 64, long_prefill_token_threshold: int = 512,
                 policy: str = "fcfs", batch_invariant: bool = False,
                 show_progress: bool = True, device: str = "auto", dtype: str = "auto",
                 kv_cache_dtype: str = "auto", int8_activations: bool = False,
                 int16_activations: bool = False) -> None:
        """`device` auto|cpu|cuda[:N], `dtype` and `kv_cache_dtype` auto|float32|bfloat16|
        float16, `int8_activations` and `int16_activations` as for `kvfleet serve` (see
        kvfleet.engine.device and `build_engine_core`)."""
        from kvfleet.engine import device as placement
        from kvfleet.engine.model.loader import load_model

        where = placement.resolve_device(device)
        self.model = load_model(model, show_progress=show_progress, device=str(where),
                                dtype=dtype)
        weights = self.model.model.embed_tokens.dtype
        kv = placement.dtype_name(placement.resolve_kv_dtype(kv_cache_dtype, weights))
        cache = CacheConfig(block_size=block_size, num_blocks=num_kv_blocks,
                            kv_cache_memory_bytes=kv_cache_memory_bytes,
                            enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv)
        scheduler = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                    max_num_running=max_num_running,
                                    long_prefill_token_threshold=long_prefill_token_threshold,
                                    policy=SchedulingPolicy(policy))
        self.core = build_engine_core(self.model, cache, scheduler,
                                      batch_invariant=batch_invariant,
                                      int8_activations=int8_activations,
                                      int16_activations=int16_activations)
        self.tokenizer: TokenizerProtocol = self.model.tokenizer
        self.chat_template: ChatTemplateProtocol | None = self.model.chat_template
        self._ids = itertools.count()

    @classmethod
    def from_core(cls, core: EngineCore, tokenizer: TokenizerProtocol,
                  chat_template: ChatTemplateProtocol | None = None) -> LLM:
        """An LLM over an already built core (tests use a fake runner this way)."""
        llm = cls.__new__(cls)
        llm.core, llm.tokenizer, llm.chat_template = core, tokenizer, chat_template
        llm._ids = itertools.count()
        return llm

    def stats(self) -> EngineStats:
        return self.core.stats()

    def generate(self, prompts: PromptInput | Sequence[PromptInput] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 use_tqdm: bool = True, tenant: str = "default",
                 priority: int = 0) -> list[RequestOutput]:
        """Generate for each prompt (text, a chat conversation, or token ids); outputs come
        back in prompt order."""
        texts, token_lists = self._prompts(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(token_lists))
        requests = []
        for i, (text, token_ids, sp) in enumerate(zip(texts, token_lists, params, strict=True)):
            where = f" (prompts[{i}])" if len(token_lists) > 1 else ""
            try:
                request = Request(f"llm-{next(self._ids)}", token_ids, sampling_params=sp,
                                  tenant=tenant, priority=priority, prompt=text)
                self.core.scheduler.check_admissible(request)
            except InvalidRequestError as exc:
                raise InvalidRequestError(exc.field, exc.problem + where, exc.remedy) from None
            requests.append(request)
        for request in requests:
            self.core.add_request(request)
        return self._run(requests, use_tqdm)

    def _prompts(self, prompts: PromptInput | Sequence[PromptInput] | None,
                 prompt_token_ids: Sequence[Sequence[int]] | None,
                 ) -> tuple[list[str | None], list[list[int]]]:
        if prompt_token_ids is not None:
            if prompts is not None:
                raise InvalidRequestError("prompts", "give prompts or prompt_token_ids, not both")
            return [None] * len(prompt_token_ids), [list(ids) for ids in prompt_token_ids]
        if prompts is None:
            raise InvalidRequestError("prompts", "no prompt given")
        items: list[Any] = ([prompts] if isinstance(prompts, str) or _is_conversation(prompts)
                            else list(prompts))
        texts: list[str | None] = []
        for i, prompt in enumerate(items):
            if isinstance(prompt, str):
                texts.append(prompt)
            elif _is_conversation(prompt):
                if self.chat_template is None:
                    raise InvalidRequestError(f"prompts[{i}]", "is a chat conversation but the "
                                              "model has no chat template", "send plain text")
                texts.append(self.chat_template.render(prompt, add_generation_prompt=True))
            else:
                raise InvalidRequestError(f"prompts[{i}]", "must be a string or a list of "
                                          f"chat messages, got {type(prompt).__name__}")
        if not texts:
            raise InvalidRequestError("prompts", "is an empty list")
        # A rendered chat template already spells its own special tokens.
        return texts, [self.tokenizer.encode(t or "", add_special_tokens=not _is_conversation(p))
                       for t, p in zip(texts, items, strict=True)]

    @staticmethod
    def _params(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise InvalidRequestError("sampling_params", f"has {len(sampling_params)} entries "
                                      f"for {n} prompts", "give one, or one per prompt")
        return list(sampling_params)

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        stopping = {r.request_id: _StopText(self.tokenizer, r) for r in requests
                    if r.sampling_params.stop}
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), desc="generating", unit="req",
                  disable=not use_tqdm) as bar:
            try:
                while self.core.has_unfinished_requests():
                    for request in self.core.step():
                        watch = stopping.get(request.request_id)
                        if watch is not None and not request.is_finished and watch.advance():
                            self.core.finish_request(request.request_id, FinishReason.STOP)
                    for request in requests:
                        if request.is_finished and request.request_id not in done:
                            done[request.request_id] = self._output(
                                request, stopping.get(request.request_id))
                            bar.update(1)
            except BaseException:
                # A failed step or Ctrl-C: end our requests so the engine stays usable. The
                # boundary step only frees blocks; it runs no model.
                for request in requests:
                    self.core.abort_request(request.request_id, FinishReason.ERROR)
                self.core.scheduler.schedule()
                raise
        return [done[r.request_id] for r in requests]

    def _output(self, request: Request, stopping: _StopText | None) -> RequestOutput:
        reason = request.finish_reason or FinishReason.ERROR
        if stopping is None:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        else:
            stopping.advance(final=True)
            text = stopping.output.text
            if stopping.output.hit and reason is FinishReason.LENGTH:
                reason = FinishReason.STOP  # the stop string came with the last token
        timings = request.timings
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=tuple(request.prompt_token_ids), text=text,
            token_ids=tuple(request.output_token_ids), finish_reason=reason.value,
            num_cached_tokens=request.num_cached_tokens, arrival_time=timings.arrival_time,
            first_token_time=timings.first_token_time, finish_time=timings.finish_time)


class _StopText:
    """One request's output decoded as it grows, with its stop strings applied
    (kvfleet.engine.stop, as on the serving path): each step decodes only the new tokens."""

    def __init__(self, tokenizer: TokenizerProtocol, request: Request) -> None:
        self.request = request
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
        self.output = StopStrings(request.sampling_params.stop)
        self.fed = 0

    def advance(self, final: bool = False) -> bool:
        """Feed the tokens generated since the last call; True once a stop string appeared."""
        ids = self.request.output_token_ids[self.fed:]
        self.fed += len(ids)
        piece = self.detokenizer.add_tokens(ids)
        self.output.feed(piece + self.detokenizer.flush() if final else piece, final)
        return self.output.hit


def _is_conversation(value: object) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0
            and all(isinstance(m, Mapping) for m in value))
