"""What clients received, checked for what users would call a broken answer.

Greedy probes (kvfleet.router.probes) compare a revision's answers with stable's token by
token: right for a new image or engine setting, wrong for a legitimate model upgrade, whose
answers differ by design. What clients receive under their own sampling and caps never
matches from one revision to the next either. So the live answers are judged by their shape,
not their words: each completed answer of a pool in a canary step (both revisions) is checked
for four signs, and the Rollout's AnswerChecks gate (kvfleet.api.analysis) fails the canary
when its share of answers with a sign is over stable's, by more than a minimum difference that
its samples show. A new model that words things differently passes; one that cannot stop,
loops, garbles bytes or says nothing does not.

- `empty`: no visible text (nothing, or whitespace): a model that emits its end token at
  once, a template that ends the turn before it starts.
- `unfinished`: cut by max_tokens (finish_reason "length"), not ended by the model: a wrong
  end-of-sequence id, a template without the stop token. (Capped answers are common; only
  more of them than stable has counts.)
- `looping`: at least LOOP_MIN_CHARS long and compressing (zlib) to under LOOP_RATIO of its
  size: the same phrase over and over, a degenerate model.
- `garbled`: over GARBLED_SHARE of its characters are U+FFFD or control characters: bytes
  split or decoded wrongly by a broken tokenizer or detokenizer.

What is checked, and how much: answers to requests that shape their own answer are left out
(`stop` sequences, tools, `response_format`, `n`: a client could make them empty or cut at
will), `unfinished` counts only where the client allowed MIN_TOKENS_FOR_UNFINISHED or more, an
answer's first MAX_CHARS characters are read (frames after that are relayed unparsed), and a
router checks at most CHECKS_PER_SECOND answers a second per pool. An answer the client left
mid-way (a user stopping a loop) is checked for `looping` and `garbled` on what it had.

What it cannot see: fluent answers that are wrong (another fact, another language asked
for by no one, a refusal worded well), and any change on a pool too quiet for the gate's
samples. OutputAgreement covers the first where the weights should not change; a person
and the bake cover the rest. A tenant that steers its own requests to one revision (which
`x-kvfleet-revision` tells it) and asks for looping answers can still move that revision's
shares: the same hole as the error gates', open in issue 47.
"""

from __future__ import annotations

import zlib

from kvfleet.api.rollout import ANSWER_FLAGS

FLAGS = ANSWER_FLAGS
LOOP_MIN_CHARS = 200
# Prose compresses to about half its size at a few hundred characters; one phrase repeated
# to well under a quarter (measured on SmolLM2's answers: tests/integration/test_answers.py).
LOOP_RATIO = 0.25
GARBLED_SHARE = 0.02
MIN_TOKENS_FOR_UNFINISHED = 64
MAX_CHARS = 16384
CHECKS_PER_SECOND = 20.0
# Request fields with which a client shapes its own answer: not checked.
SHAPING_FIELDS = frozenset({"stop", "tools", "tool_choice", "functions", "response_format",
                            "n", "logit_bias"})


def checkable(body: dict[str, object]) -> bool:
    """Whether a request's answer says something about the revision (not the client)."""
    return not SHAPING_FIELDS & body.keys()


def flags(text: str, finish_reasons: list[str] | tuple[str, ...],
          max_tokens: int | None = None, partial: bool = False) -> list[str]:
    """The signs of an answer: its text (the first MAX_CHARS) and its choices' finish reasons;
    `max_tokens` the client's cap (None: the engine's default); `partial`: the client left
    before the end (only `looping` and `garbled` can show then)."""
    out = []
    if not text.strip() and not partial:
        out.append("empty")
    if "length" in finish_reasons and not partial and (
            max_tokens is None or max_tokens >= MIN_TOKENS_FOR_UNFINISHED):
        out.append("unfinished")
    if len(text) >= LOOP_MIN_CHARS:
        raw = text.encode("utf-8", "surrogatepass")
        if len(zlib.compress(raw, 6)) < LOOP_RATIO * len(raw):
            out.append("looping")
    if text:
        bad = sum(1 for c in text if c == "\ufffd" or (c < " " and c not in "\n\r\t"))
        if bad > GARBLED_SHARE * len(text):
            out.append("garbled")
    return out
