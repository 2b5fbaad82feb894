"""Fakes for engine tests that need no model: a runner over a fake KV cache and a tokenizer.

`FakeRunner` keeps, per KV slot, the (token id, position) written there. Before computing a
chunk it checks that every earlier position of the request is present in the block table at
the right slot (and, given `expected_tokens`, holds the right token), which catches a wrong
block table, a missed copy-on-write or a block shared with another request. Its "model"
predicts the next token from the tokens read back from its KV, so a scheduling bug changes
the output just as it would with a real model.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import torch

from kvfleet.engine.request import Request, SamplingParams
from kvfleet.engine.scheduler_output import SchedulerOutput

VOCAB_SIZE = 64
EOS_TOKEN_ID = 0

Slot = tuple[int, int] | None  # (token id, position)


def next_token(tokens: Sequence[int]) -> int:
    """The fake model: a deterministic function of the whole context, never eos."""
    h = len(tokens)
    for t in tokens[-8:]:
        h = (h * 31 + t) % 1_000_003
    return 1 + h % (VOCAB_SIZE - 1)


def make_request(request_id: str, prompt: Sequence[int] | int = 8, max_tokens: int = 4,
                 **kwargs: object) -> Request:
    """A request with `prompt` token ids (or that many deterministic ones), greedy."""
    if isinstance(prompt, int):
        # crc32, not hash(): str hashes change per process, and so would the tests' prompts.
        seed = zlib.crc32(request_id.encode())
        prompt = [1 + (seed + i * 7) % (VOCAB_SIZE - 1) for i in range(prompt)]
    params = kwargs.pop("sampling_params", None) or SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # The tests' fake clock starts at 1000.0: arrivals on it keep priority aging deterministic.
    kwargs.setdefault("arrival_time", 1000.0)
    return Request(request_id, prompt, sampling_params=params, **kwargs)  # type: ignore[arg-type]


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int,
                 expected_tokens: Callable[[str], Sequence[int]] | None = None) -> None:
        self.block_size = block_size
        self.slots: list[list[Slot]] = [[None] * block_size for _ in range(num_blocks)]
        self.expected_tokens = expected_tokens
        self.num_steps = 0

    def execute(self, output: SchedulerOutput) -> dict[str, torch.Tensor]:
        self.num_steps += 1
        for src, dst in output.block_copies:
            self.slots[dst] = list(self.slots[src])
        # Like a real forward pass: every chunk's KV is written, then each chunk attends.
        for chunk in output.chunks:
            for offset, token_id in enumerate(chunk.token_ids):
                self._write(chunk.block_ids, chunk.start_position + offset, token_id)
        logits: dict[str, torch.Tensor] = {}
        for chunk in output.chunks:
            end = chunk.start_position + len(chunk.token_ids)
            if len(chunk.block_ids) != -(-end // self.block_size):
                raise AssertionError(f"{chunk.request_id}: {len(chunk.block_ids)} blocks for "
                                     f"{end} positions")
            context = [self._read(chunk.request_id, chunk.block_ids, p) for p in range(end)]
            if self.expected_tokens is not None:
                expected = list(self.expected_tokens(chunk.request_id))[:end]
                if context != expected:
                    raise AssertionError(f"{chunk.request_id}: KV holds {context}, "
                                         f"expected {expected}")
            if chunk.sample:
                row = torch.full((VOCAB_SIZE,), -10.0)
                row[next_token(context)] = 10.0
                logits[chunk.request_id] = row
        return logits

    def _write(self, block_ids: Sequence[int], position: int, token_id: int) -> None:
        block = block_ids[position // self.block_size]
        self.slots[block][position % self.block_size] = (token_id, position)

    def _read(self, request_id: str, block_ids: Sequence[int], position: int) -> int:
        slot = self.slots[block_ids[position // self.block_size]][position % self.block_size]
        if slot is None or slot[1] != position:
            raise AssertionError(f"{request_id}: position {position} not in its KV ({slot})")
        return slot[0]


class FakeTokenizer:
    """Token i is the letter chr(ord('a') + i % 26); eos decodes to nothing."""

    eos_token_id = EOS_TOKEN_ID
    eos_token_ids = (EOS_TOKEN_ID,)
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1 + (ord(c) - ord("a")) % 26 for c in text if c.isalpha()]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + (t - 1) % 26) for t in token_ids if t != EOS_TOKEN_ID)
