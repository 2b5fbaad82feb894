"""A fake engine core and a byte-level tokenizer for the serving layer's unit tests.

`FakeCore` honours the contract `AsyncEngine` relies on (add / abort / step / unfinished):
each step it "computes" every unfinished request's prompt and appends one output token,
finishing on max_tokens, a stop token id or eos, and counts KV blocks so tests can check that
disconnects and aborts give every block back. Its output text is chosen by the test
(`script`), which makes streaming, stop strings and UTF-8 handling checkable exactly.
"""

from __future__ import annotations

import threading
import time

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kvfleet.engine.admission import AdmissionLimits, ServedModel
from kvfleet.engine.async_engine import AsyncEngine
from kvfleet.engine.chat_template import ChatTemplate
from kvfleet.engine.errors import InvalidRequestError
from kvfleet.engine.metrics import EngineMetrics, EngineStats
from kvfleet.engine.request import FinishReason, Request, RequestStatus
from kvfleet.engine.tokenizer import Tokenizer, _bytes_to_unicode

EOS = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_tokenizer() -> Tokenizer:
    """One token per byte (ids 0..255) plus `<eos>` (256): exact, tiny, real `tokenizers`."""
    spelling = _bytes_to_unicode()
    vocab = {spelling[b]: b for b in range(256)}
    vocab["<eos>"] = EOS
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return Tokenizer(backend, bos_token_id=None, eos_token_id=EOS, add_bos_token=False)


class FakeCore:
    def __init__(self, script: str = "hello world, this is a fake model. " * 8,
                 num_blocks: int = 64, block_size: int = 4, step_seconds: float = 0.0) -> None:
        self.script = list(script.encode())
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.step_seconds = step_seconds
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_aborts = 0
        self.fail_next_step = False
        self.max_batch = 0
        self._lock = threading.Lock()

    def add_request(self, request: Request) -> None:
        if request.sampling_params.max_tokens == 13:
            raise InvalidRequestError("sampling_params.max_tokens", "13 is unlucky (test hook)")
        request.transition(RequestStatus.QUEUED)
        self.requests[request.request_id] = request

    def abort_request(self, request_id: str,
                      reason: FinishReason = FinishReason.CANCELLED) -> None:
        request = self.requests.get(request_id)
        if request is not None and request.finish(reason, time.monotonic()):
            self.num_aborts += 1

    def has_unfinished_requests(self) -> bool:
        return any(not r.is_finished for r in self.requests.values())

    def blocks_in_use(self) -> int:
        return sum(-(-r.num_tokens // self.block_size) for r in self.requests.values()
                   if not r.is_finished)

    def stats(self) -> EngineStats:
        live = [r for r in self.requests.values() if not r.is_finished]
        return EngineStats(num_running=len(live), num_waiting=0,
                           kv_cache_usage=self.blocks_in_use() / self.num_blocks,
                           num_prefix_cache_queries=0, num_prefix_cache_hits=0,
                           num_preemptions=0)

    def step(self) -> None:
        self.num_steps += 1
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        if self.step_seconds:
            time.sleep(self.step_seconds)
        now = time.monotonic()
        live = [r for r in self.requests.values() if not r.is_finished]
        self.max_batch = max(self.max_batch, len(live))
        for request in live:
            if request.timings.first_scheduled_time is None:
                request.timings.first_scheduled_time = now
                request.transition(RequestStatus.PREFILLING)
            request.transition(RequestStatus.DECODING)
            params = request.sampling_params
            index = request.num_output_tokens
            token = self.script[index % len(self.script)]
            request.append_output_token(token, now)
            if token in params.stop_token_ids and index + 1 >= params.min_tokens:
                request.finish(FinishReason.STOP, now)
            elif request.num_output_tokens >= params.max_tokens:
                request.finish(FinishReason.LENGTH, now)
        # Finished requests hold no blocks (the real core frees them at the next boundary).


def make_engine(core: FakeCore | None = None, *, max_context: int = 256,
                limits: AdmissionLimits | None = None, log_text: bool = False
                ) -> tuple[AsyncEngine, FakeCore]:
    core = core or FakeCore()
    model = ServedModel(name="fake-model", revision="sha256:fake", max_context=max_context,
                        block_size=core.block_size, num_kv_blocks=core.num_blocks)
    engine = AsyncEngine(core, model, byte_tokenizer(), EngineMetrics(model.name, model.revision),
                         limits=limits, log_text=log_text)
    return engine, core


def chat_template() -> ChatTemplate:
    return ChatTemplate(CHAT_TEMPLATE)
