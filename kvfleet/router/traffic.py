"""Which revision a request goes to, from the pool's traffic table (`status.traffic`).

A conversation is bucketed by a hash of (pool, tenant, session key) into 0-99; buckets below
the canary's weight go to the canary. Raising the weight only adds buckets to the canary, so a
conversation changes revision at most once during a canary (and never back unless the canary is
aborted). The session key is the request's `user` field or its `x-session-id` header, else the
conversation's opening (a chat's first messages, which every later turn resends), else the
request id. So a tenant whose clients send neither still spreads over both revisions by
conversation, and each conversation stays on one. Shadow copies are picked by a second
hash with another salt, so which requests are mirrored does not follow the canary split.
Greedy probes (answer agreement, `kvfleet.router.probes`) are picked by a third salt, per
request, so every tenant and conversation is sampled, whichever revision answers it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvfleet.api.servingpool import ServingPoolStatus, TrafficRole


def bucket(*parts: str) -> int:
    """0-99, stable for the same parts on every router."""
    text = "\x1f".join(parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") % 100


# The messages that open a conversation: its system prompt and first user turn, whatever
# follows them.
OPENING_MESSAGES = 2


def session_key(body: dict[str, Any], session_header: str | None, sample_key: str) -> str:
    """What a request's canary-or-stable draw is keyed by: the client's session header, else
    its `user` with its conversation (so a backend that sends one constant `user` for all its
    end users still spreads its conversations by the weight, while each conversation sticks),
    else `sample_key`, the router's own random draw."""
    if session_header:
        return session_header
    user, conversation = body.get("user"), conversation_key(body)
    if not user and conversation is None:
        return sample_key
    return f"{user or ''}\x1f{conversation or ''}"


def conversation_key(body: dict[str, Any]) -> str | None:
    """A digest of a chat's opening messages, or of a completion's prompt (None for an odd
    body): the same for every turn of one conversation, different between conversations."""
    messages = body.get("messages")
    prompt = body.get("prompt")
    if isinstance(prompt, str) and "messages" not in body:
        return "prompt-" + hashlib.sha256(prompt[:4096].encode(errors="replace")).hexdigest()[:32]
    if not isinstance(messages, list) or not messages:
        return None
    opening = []
    for message in messages[:OPENING_MESSAGES + 1]:
        if not isinstance(message, dict):
            return None
        opening.append(message)
        if message.get("role") == "user":
            break
    text = json.dumps(opening, sort_keys=True, default=str)
    return "conv-" + hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class RoutePlan:
    live: str  # revision that answers the client
    shadow: str | None  # revision that gets a discarded copy, if any
    probe: str | None = None  # revision whose greedy answer is compared with stable's


@dataclass(frozen=True, slots=True)
class Synthetic:
    """What the routers send themselves while a quiet pool's step is judged (the pool's
    status.syntheticTraffic): `rate` requests a second, live ones counted first."""

    prompts: tuple[str, ...]
    rate: float
    max_tokens: int


@dataclass(frozen=True, slots=True)
class TrafficTable:
    stable: str
    canary: str | None = None
    canary_weight: int = 0
    shadow: str | None = None
    shadow_percent: int = 0
    probe: str | None = None  # the revision probed against stable (canary or shadow)
    probe_percent: int = 0
    synthetic: Synthetic | None = None

    @classmethod
    def from_status(cls, status: ServingPoolStatus | None) -> TrafficTable | None:
        """The table in `status.traffic`, or all traffic to `servingRevision` when the table is
        empty; None when the pool serves nothing yet. A table without a stable entry is
        ignored in favour of servingRevision (the Rollout controller never writes one)."""
        if status is None:
            return None
        entries = {t.role: t for t in status.traffic}
        stable = entries.get(TrafficRole.STABLE)
        if stable is None:
            return cls(status.serving_revision) if status.serving_revision else None
        canary = entries.get(TrafficRole.CANARY)
        shadow = entries.get(TrafficRole.SHADOW)
        probed = next((t for t in (canary, shadow) if t is not None and t.probe_percent > 0
                       and t.revision != stable.revision), None)
        return cls(
            stable=stable.revision,
            canary=canary.revision if canary is not None and canary.weight > 0 else None,
            canary_weight=canary.weight if canary is not None else 0,
            shadow=shadow.revision if shadow is not None and shadow.shadow_percent > 0 else None,
            shadow_percent=shadow.shadow_percent if shadow is not None else 0,
            probe=probed.revision if probed is not None else None,
            probe_percent=probed.probe_percent if probed is not None else 0,
            synthetic=None if (s := status.synthetic_traffic) is None or (
                canary is None and shadow is None) else Synthetic(
                    tuple(s.prompts), s.rate_per_second, s.max_tokens),
        )

    @property
    def revisions(self) -> set[str]:
        return {r for r in (self.stable, self.canary, self.shadow, self.probe) if r is not None}

    def route(self, pool: str, tenant: str, session: str, sample_key: str) -> RoutePlan:
        """`sample_key`: the router's own random key for the request, never a client's
        header: whoever sends x-request-id must not choose which requests are mirrored to the
        shadow revision or probed (filling the probe slots with its own prompts)."""
        live = self.stable
        if self.canary is not None and bucket("canary", pool, tenant, session) < \
                self.canary_weight:
            live = self.canary
        shadow = None
        if self.shadow is not None and self.shadow != live and \
                bucket("shadow", pool, sample_key) < self.shadow_percent:
            shadow = self.shadow
        probe = None
        if self.probe is not None and bucket("probe", pool, sample_key) < self.probe_percent:
            probe = self.probe
        return RoutePlan(live, shadow, probe)
