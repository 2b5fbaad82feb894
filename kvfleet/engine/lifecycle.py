"""The lifecycle of one engine instance: LOADING → WARMING → READY → DRAINING.

`/health` answers as long as the process serves HTTP at all; `/ready` only in READY, which is
reached after a real warm-up generation has gone through the whole path (tokenize, schedule,
forward, sample, detokenize), so a load balancer never sends traffic to an engine that loaded
its weights but cannot generate. DRAINING is terminal: SIGTERM stops admission, in-flight
requests get a grace period, the rest are cancelled, and the process exits 0.
"""

from __future__ import annotations

import logging
import time
from enum import StrEnum

from kvfleet.engine.async_engine import AsyncEngine, GenerationSpec
from kvfleet.engine.request import SamplingParams

logger = logging.getLogger("kvfleet.engine.lifecycle")


class LifecycleState(StrEnum):
    LOADING = "LOADING"
    WARMING = "WARMING"
    READY = "READY"
    DRAINING = "DRAINING"


_NEXT: dict[LifecycleState, frozenset[LifecycleState]] = {
    LifecycleState.LOADING: frozenset({LifecycleState.WARMING, LifecycleState.DRAINING}),
    LifecycleState.WARMING: frozenset({LifecycleState.READY, LifecycleState.DRAINING}),
    LifecycleState.READY: frozenset({LifecycleState.DRAINING}),
    LifecycleState.DRAINING: frozenset(),
}


class WarmupError(RuntimeError):
    """The warm-up generation did not complete; the engine must not report READY."""


class Lifecycle:
    def __init__(self) -> None:
        self.state = LifecycleState.LOADING
        self.since = time.time()

    @property
    def is_ready(self) -> bool:
        return self.state is LifecycleState.READY

    def advance(self, new_state: LifecycleState) -> bool:
        """Move forward; False (no change) for a repeated or backward transition."""
        if new_state not in _NEXT[self.state]:
            return False
        logger.info("lifecycle %s -> %s", self.state.value, new_state.value,
                    extra={"fields": {"event": "lifecycle", "from": self.state.value,
                                      "to": new_state.value}})
        self.state = new_state
        self.since = time.time()
        return True


async def warm_up(engine: AsyncEngine, lifecycle: Lifecycle, prompt_token_ids: tuple[int, ...],
                  max_tokens: int = 2) -> None:
    """WARMING → READY after one greedy generation succeeds; raises WarmupError otherwise."""
    lifecycle.advance(LifecycleState.WARMING)
    engine.accepting = True  # the warm-up goes through normal admission
    spec = GenerationSpec(prompt_token_ids=prompt_token_ids,
                          sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                  ignore_eos=True),
                          tenant="kvfleet-warmup", cache_scope="kvfleet-warmup", internal=True)
    stream = await engine.submit(spec)
    events = await stream.result()
    reason = events[-1].finish_reason
    if reason not in ("length", "stop"):
        engine.accepting = False
        raise WarmupError(f"warm-up generation ended with finish_reason {reason!r}; see the "
                          "engine log for the failing step")
    if not lifecycle.advance(LifecycleState.READY):
        engine.accepting = False  # a drain began during warm-up
