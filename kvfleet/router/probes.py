"""Greedy probes: answer agreement between a canary and stable, token by token.

A revision with a broken template or tokenizer, or same-shaped wrong weights, is as fast and as
error-free as a good one; only what it answers tells it apart. The router mirrors a sample of
live requests as probes to both revisions — forced greedy (`temperature: 0`), capped at a few
tokens, asking the engines for the token ids, never billed, shed first under load — and scores
each pair here. The Rollout's built-in `OutputAgreement` gate reads the sums.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def agreement(canary: Sequence[int], stable: Sequence[int]) -> tuple[int, int]:
    """(agreed, compared) tokens of two greedy answers to one probe. Agreed is their common
    prefix: past the first difference each continues a different text, so nothing after it
    is evidence either way. Compared is the longer answer's length, so an answer that stops
    early (or runs on) disagrees on the tokens it lacks."""
    agreed = 0
    for a, b in zip(canary, stable, strict=False):
        if a != b:
            break
        agreed += 1
    return agreed, max(len(canary), len(stable))


# A probe never competes with the traffic it samples: the least urgent priority the engines
# accept, its own tenant (no share of a tenant's engine-side limits or its prefix cache), a
# few tokens (the first differences show early: bench/output_agreement.py).
PROBE_TENANT = "kvfleet-probe"
PROBE_PRIORITY = 1000
PROBE_MAX_TOKENS = 32
# Sampling fields a greedy probe does not carry over from the live request.
_DROPPED = ("stream", "stream_options", "seed", "n", "logprobs", "top_logprobs", "user",
            "max_completion_tokens", "min_tokens", "priority", "logit_bias",
            "presence_penalty", "frequency_penalty", "temperature", "top_p", "top_k")


def probe_body(body: dict[str, Any], max_tokens: int = PROBE_MAX_TOKENS) -> dict[str, Any]:
    """The greedy probe of a live request (its `model` already removed): the same prompt and
    stop conditions, temperature 0, at most `max_tokens`, the token ids asked for."""
    probe = {key: value for key, value in body.items() if key not in _DROPPED}
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    probe["max_tokens"] = min(asked, max_tokens) if isinstance(asked, int) and asked > 0 \
        else max_tokens
    probe.update(temperature=0.0, stream=False, return_token_ids=True,
                 priority=PROBE_PRIORITY)
    return probe


@dataclass(frozen=True)
class ProbeAnswer:
    ids: list[int]
    text: str  # what a client would have read


def probe_answer(status: int, data: bytes) -> ProbeAnswer | None:
    """The generated token ids and text of a probe's answer; None when it is no complete
    answer (an error status, an error inside the 200, a body without ids)."""
    if status != 200:
        return None
    try:
        choice = json.loads(data)["choices"][0]
        ids = choice["token_ids"]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if choice.get("finish_reason") == "error" or not isinstance(ids, list) or not all(
            isinstance(i, int) for i in ids):
        return None
    return ProbeAnswer(ids, text if isinstance(text, str) else "")


def compare_answers(canary: ProbeAnswer, stable: ProbeAnswer) -> tuple[int, int, bool]:
    """(agreed tokens, compared tokens, whether the two answers agree in full). The same ids
    with another text (a tokenizer broken only in decoding) agree on no token: the text is
    what the client reads."""
    agreed, compared = agreement(canary.ids, stable.ids)
    if canary.text != stable.text:
        agreed = 0 if agreed == compared else agreed
        return agreed, compared, False
    return agreed, compared, agreed == compared


def answered_by(data: bytes) -> str | None:
    """The revision an engine says answered (its `system_fingerprint`), if it says one. An
    engine started without `--revision` reports its weights' digest (`sha256:...`), which
    names no revision: None."""
    try:
        fingerprint = json.loads(data).get("system_fingerprint")
    except (ValueError, AttributeError):
        return None
    if not isinstance(fingerprint, str) or not fingerprint or fingerprint.startswith("sha256:"):
        return None
    return fingerprint


def same_revision(fingerprint: str | None, revision: str) -> bool:
    """Whether an answer's fingerprint names `revision` (both may be short: 12 digits)."""
    if fingerprint is None:
        return True  # an engine that says nothing (an older one) is taken at its address
    n = min(len(fingerprint), len(revision), 12)
    return fingerprint[:n] == revision[:n]


def probe_id(tenant: str, text: str) -> str:
    """A prompt's id in status and metrics: salted with its tenant, so it names the prompt to
    whoever can see that tenant's logs and reveals nothing of its text to anyone else."""
    return hashlib.sha256(f"{tenant}\x1f{text}".encode()).hexdigest()[:12]
