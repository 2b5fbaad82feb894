"""Prompt tokens counted at admission with the pool's own tokenizer.

Each revision's engines serve their tokenizer (`GET /tokenizer.json`, HF's format); the router
fetches it once per revision, in the background, and counts a request's prompt with it: the
message contents (or the prompt) plus `PER_MESSAGE` tokens a message for the chat template's
markup. Until a revision's tokenizer has arrived (or if it cannot be had), the count is an upper
bound, one token per 3 UTF-8 bytes. Either way the charge is corrected to the engine's own count
(its template included) when the answer ends (`QuotaLedger.settle`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from tokenizers import Tokenizer

from kvfleet.router.errors import BadRequest
from kvfleet.router.picker import EndpointLoad

log = logging.getLogger("kvfleet.router")

PER_MESSAGE = 4  # e.g. "<|im_start|>user\n" ... "<|im_end|>\n" in ChatML
# A prompt longer than this is tokenized on a worker thread (the tokenizer releases the GIL):
# a 4 MiB prompt took the event loop 3.5 s (Zen 5), and every other request's relay with it.
OFF_LOOP_BYTES = 32 << 10
HEAD_IDS = 2048  # ids of a token-id prompt kept as its text (`Prompt.head`)
# Long texts are counted in pieces of this many characters (`_count_ids`).
PIECE_CHARS = 64 << 10
RETRY_SECONDS = 30.0


def estimate(text: str) -> int:
    return max(1, -(-len(text.encode()) // 3))


@dataclass(frozen=True)
class Prompt:
    """What a request's prompt is made of: texts to tokenize, how many chat messages carry
    them (0 for a completion), and token ids given as such (a completion's `prompt` may be a
    list of ids, or a list of such lists: counted, never tokenized)."""

    texts: list[str]
    messages: int = 0
    ids: int = 0
    head: str = ""  # the first ids given, as numbers (prefix affinity only needs a head)

    @property
    def text(self) -> str:
        """The prompt as one text (prefix affinity, probe ids)."""
        return "\n".join(self.texts) if self.texts else self.head


def texts_of(body: dict[str, Any]) -> Prompt:
    """The request's prompt. BadRequest for `messages` that is not a list of message objects,
    for a `prompt` list that mixes texts and ids, and for text that is not Unicode (a lone
    surrogate, "\\ud800", is valid JSON that no tokenizer takes: a 500 at the engine would
    count against the revision)."""
    prompt = _texts_of(body)
    texts = prompt.texts
    field = "messages" if "messages" in body else "prompt"
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"{field}: the text holds a lone surrogate (an unpaired \\ud800-"
                             "\\udfff escape); send valid Unicode", field) from None
    return prompt


def _ids(prompt: list[Any]) -> int | None:
    """How many token ids `prompt` gives (a list of ints, or of lists of ints); None when it
    is texts."""
    if all(type(p) is int for p in prompt):
        return len(prompt)
    if all(isinstance(p, list) and p and all(type(i) is int for i in p) for p in prompt):
        return sum(len(p) for p in prompt)
    return None


def _texts_of(body: dict[str, Any]) -> Prompt:
    if "messages" in body:
        texts = []
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages: must be a list of message objects "
                             '({"role": ..., "content": ...})', "messages")
        for message in messages:
            content = message.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts += [str(p.get("text", "")) for p in content if isinstance(p, dict)]
        return Prompt(texts, len(messages))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        # (Ids were joined into one text of numbers and tokenized: 4 MiB of them took the
        # tokenizer's encodings to 600 MB a request.)
        if (ids := _ids(prompt)) is not None:
            first = prompt[0] if prompt and isinstance(prompt[0], list) else prompt
            return Prompt([], ids=ids, head=" ".join(map(str, first[:HEAD_IDS])))
        if not all(isinstance(p, str) for p in prompt):
            raise BadRequest("prompt: a text, a list of texts, a list of token ids, or a list "
                             "of non-empty lists of token ids", "prompt")
        return Prompt(list(prompt))
    return Prompt([str(prompt or "")])


def _pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in pieces of about `size` characters, each cut before a space (where the
    tokenizers' pre-tokenization splits anyway), or hard at `size` in a text without one."""
    start = 0
    while len(text) - start > size:
        cut = text.rfind(" ", start + size // 2, start + size)
        cut = cut if cut > start else start + size
        yield text[start:cut]
        start = cut
    yield text[start:]


def _count_ids(tokenizer: Tokenizer, texts: list[str]) -> int:
    """Tokens of `texts`, a piece at a time: the encodings of a whole 4 MiB prompt (ids,
    tokens, offsets, masks per token) took 240 MB, and ten at once the router past its
    memory limit. Cut before spaces, the count is the whole text's or within a token a piece."""
    total = 0
    for text in texts:
        pieces = list(_pieces(text)) if len(text) > PIECE_CHARS else [text]
        for start in range(0, len(pieces), 8):
            total += sum(len(e.ids) for e in tokenizer.encode_batch_fast(
                pieces[start:start + 8], add_special_tokens=False))
    return total


class TokenCounter:
    """Revision -> its tokenizer, fetched from one of its engines on first need."""

    def __init__(self, session: Callable[[], aiohttp.ClientSession]) -> None:
        self._session = session
        self._tokenizers: dict[str, Tokenizer] = {}
        self._failed_at: dict[str, float] = {}
        self._fetching: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def known(self, revision: str) -> bool:
        return revision in self._tokenizers

    async def count(self, revision: str, prompt: Prompt,
                    endpoints: Sequence[EndpointLoad]) -> int:
        """Prompt tokens of the request on `revision`; starts fetching its tokenizer from one
        of `endpoints` if it is not here yet (this request then gets the upper bound)."""
        texts, fixed = prompt.texts, prompt.ids + PER_MESSAGE * prompt.messages
        tokenizer = self._tokenizers.get(revision)
        if tokenizer is None:
            self._fetch_later(revision, endpoints)
            return max(1, sum(estimate(t) for t in texts) + fixed)
        if sum(len(t) for t in texts) > OFF_LOOP_BYTES:
            ids = await asyncio.to_thread(_count_ids, tokenizer, list(texts))
        else:
            ids = _count_ids(tokenizer, list(texts))
        return max(1, ids + fixed)

    def _fetch_later(self, revision: str, endpoints: Sequence[EndpointLoad]) -> None:
        failed = self._failed_at.get(revision)
        if not endpoints or revision in self._fetching or (
                failed is not None and time.monotonic() - failed < RETRY_SECONDS):
            return
        self._fetching.add(revision)
        task = asyncio.get_running_loop().create_task(self._fetch(revision, list(endpoints)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fetch(self, revision: str, endpoints: list[EndpointLoad]) -> None:
        try:
            for endpoint in endpoints:
                try:
                    async with self._session().get(
                            endpoint.url("/tokenizer.json"),
                            timeout=aiohttp.ClientTimeout(total=30),
                            **endpoint.connection()) as resp:
                        if resp.status != 200:
                            continue
                        text = await resp.text()
                    self._tokenizers[revision] = Tokenizer.from_str(text)
                    log.info("tokenizer of revision %s loaded from %s", revision[:12],
                             endpoint.address)
                    return
                except Exception as exc:  # network, HTTP, or tokenizers' bare Exception
                    log.warning("tokenizer of revision %s not loaded from %s (%s)",
                                revision[:12], endpoint.address, type(exc).__name__)
            self._failed_at[revision] = time.monotonic()
        finally:
            self._fetching.discard(revision)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
