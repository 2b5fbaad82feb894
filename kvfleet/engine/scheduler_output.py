"""`SchedulerOutput`: the only contract between the scheduler and the model runner.

The scheduler decides, the runner computes. The runner never looks at requests, queues or
the block pool; it receives, per step, which tokens of which request to run at which
positions, and where their KV lives (the block table). Everything it needs is in here.

Invariants (checked by the scheduler's tests, relied on by the runner):
- `chunk.start_position` equals the request's `num_computed_tokens` before the step, so the
  runner's KV for positions `< start_position` is already in `chunk.block_ids`.
- `chunk.block_ids` covers positions `[0, start_position + len(chunk.token_ids))`:
  position p lives in block `block_ids[p // block_size]` at slot `p % block_size`.
- `block_copies` are applied (src -> dst, whole blocks) before the forward pass of this step;
  they implement copy-on-write for blocks shared after a fork.
- `sample` is True exactly when the chunk reaches the end of the request's known tokens, so
  the logits of its last position are needed to produce the next token.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[int, ...]
    sample: bool


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    num_scheduled_tokens: int
    block_copies: tuple[tuple[int, int], ...] = ()
    preempted_request_ids: tuple[str, ...] = ()
    finished_request_ids: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.chunks
