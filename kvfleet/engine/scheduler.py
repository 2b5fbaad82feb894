"""`Scheduler`: decides, each step, which tokens of which requests to compute.

There are no prefill and decode phases. Each request's `num_computed_tokens` catches up
with its `num_tokens`; a step grants tokens from `max_num_batched_tokens`, first to running
requests (one token each when decoding, a chunk when a prefill is still in progress), then to
waiting requests (a chunk of at most `long_prefill_token_threshold` tokens), as far as free KV
blocks allow. When a running request needs a block and none is free, the lowest-priority,
newest running request is preempted: its blocks are freed and it goes back to waiting, to be
recomputed later (its full blocks usually survive in the prefix cache).

Fairness: every scheduled token advances its tenant's virtual time by `1 / weight`; the next
waiting request comes from the tenant with the least virtual time (a tenant returning from
idle starts at the current minimum, so it cannot bank credit). Under the priority policy the
priority level (lowered by one per `priority_aging_seconds` of waiting, so low priority never
starves) is compared first. If that request cannot start because a flooding tenant holds
the running slots or the blocks, one of the flooder's requests is preempted for it, so a
flood delays another tenant's first token by about one step, not by a whole generation.

Threading: `add_request` and `abort_request` may be called from any thread; they only queue
work. Everything else runs on the engine thread, and the queued work is applied at the next
step boundary (the start of `schedule`), which is also where the blocks of finished and
cancelled requests are freed ("deferred free"): never while a step may still read them.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from kvfleet.engine.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from kvfleet.engine.errors import InvalidRequestError
from kvfleet.engine.kv_cache_manager import NO_HIT, KVCacheManager
from kvfleet.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from kvfleet.engine.scheduler_output import ScheduledChunk, SchedulerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 max_model_len: int, eos_token_ids: Iterable[int] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.kv = KVCacheManager(num_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admission order: earlier requests keep their slot
        self.num_preemptions = 0
        self._new: deque[Request] = deque()  # thread-safe inboxes
        self._aborts: deque[tuple[str, FinishReason]] = deque()
        self._to_free: list[Request] = []  # finished; blocks freed at the next boundary
        self._vtime: dict[str, float] = {}
        self._order: dict[str, int] = {}
        self._counter = itertools.count()

    # -- intake (any thread) -------------------------------------------------------------

    def check_admissible(self, request: Request) -> None:
        """Reject at once what could never run, naming the field to change."""
        if request.num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"has {request.num_prompt_tokens} tokens; the model's context is "
                f"{self.max_model_len}", "shorten the prompt")
        if request.max_num_tokens > self.max_model_len:
            raise InvalidRequestError(
                "sampling_params.max_tokens",
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.sampling_params.max_tokens}) exceeds the model's context of "
                f"{self.max_model_len} tokens",
                f"lower max_tokens to at most "
                f"{self.max_model_len - request.num_prompt_tokens}")
        if not self.kv.can_ever_fit(request.max_num_tokens):
            raise InvalidRequestError(
                "sampling_params.max_tokens",
                f"prompt + max_tokens needs {self.kv.num_blocks_for(request.max_num_tokens)} "
                f"KV blocks but the pool has {self.kv.num_blocks}",
                "lower max_tokens or shorten the prompt, or give the engine a larger KV pool")

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or any(
                r.request_id == request.request_id for r in list(self._new)):
            raise InvalidRequestError("request_id",
                                      f"request {request.request_id!r} already exists",
                                      "use a unique id per request")
        self.check_admissible(request)
        self._new.append(request)

    def abort_request(self, request_id: str,
                      reason: FinishReason = FinishReason.CANCELLED) -> None:
        """Cancel (idempotent; unknown or finished ids are ignored) at the next boundary."""
        self._aborts.append((request_id, reason))

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._new or self._aborts or self._to_free)

    # -- engine thread -------------------------------------------------------------------

    def fork_request(self, parent_id: str, child_id: str,
                     sampling_params: SamplingParams | None = None) -> Request:
        """A copy of a running request that shares its blocks (copy-on-write). Call between
        `update_from_output` and the next `schedule`."""
        parent = self.requests.get(parent_id)
        if parent is None or parent not in self.running:
            raise InvalidRequestError("parent_id", f"request {parent_id!r} is not running")
        if child_id in self.requests:
            raise InvalidRequestError("request_id", f"request {child_id!r} already exists")
        if len(self.running) >= self.config.max_num_running:
            raise InvalidRequestError("parent_id", f"cannot fork {parent_id!r}: all "
                                      f"{self.config.max_num_running} running slots are taken")
        child = replace(parent, request_id=child_id,
                        sampling_params=sampling_params or parent.sampling_params)
        child.output_token_ids = list(parent.output_token_ids)
        child.all_token_ids = list(parent.all_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.timings = replace(parent.timings)
        child.status = parent.status
        self.kv.fork(parent, child)
        self.requests[child_id] = child
        self._order[child_id] = next(self._counter)
        self.running.append(child)
        return child

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        """End a request now (e.g. a stop string matched); blocks go at the next boundary."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, reason, self.clock())

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        finished_ids = self._apply_boundary(now)
        budget = self.config.max_num_batched_tokens
        prefill = _PrefillAllowance(self.config.max_prefill_tokens_per_step)
        scheduled: dict[str, int] = {}
        copies: dict[str, list[tuple[int, int]]] = {}
        preempted = self._preempt_for_fairness(now)
        out_of_blocks = False

        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted earlier in this loop
                continue
            decoding = request.status == RequestStatus.DECODING
            num_new = self._num_new_tokens(request, budget if decoding else prefill.of(budget))
            if num_new == 0:  # a prompt in progress, out of this step's prefill allowance
                continue
            while not self.kv.can_allocate(request, num_new):
                victim = max(self.running, key=lambda r: (r.priority, self._order[r.request_id]))
                budget += scheduled.pop(victim.request_id, 0)
                copies.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.append(victim.request_id)
                out_of_blocks = True
                if victim is request:
                    break
            else:
                copies[request.request_id] = self.kv.allocate(request, num_new)
                scheduled[request.request_id] = num_new
                budget -= num_new
                if not decoding:
                    prefill.spend(num_new)

        # Admitting while short of blocks would only thrash: wait for blocks to come back.
        # A request preempted in this step is not readmitted in it either.
        while (not out_of_blocks and prefill.of(budget) > 0
               and len(self.running) < self.config.max_num_running):
            candidates = [r for r in self.waiting if r.request_id not in preempted]
            if not candidates:
                break
            request = self._pick_waiting(now, candidates)
            hit = self.kv.find_prefix_hit(request) if request.num_computed_tokens == 0 else NO_HIT
            num_new = min(request.num_tokens - hit.num_tokens,
                          self.config.long_prefill_token_threshold, prefill.of(budget))
            if not self.kv.can_allocate(request, num_new, hit):
                break  # no skipping ahead: a large request must not starve behind small ones
            copies[request.request_id] = self.kv.allocate(request, num_new, hit)
            self.waiting.remove(request)
            self.running.append(request)
            if request.timings.first_scheduled_time is None:
                request.timings.first_scheduled_time = now
                request.num_cached_tokens = request.num_computed_tokens
            request.transition(RequestStatus.PREFILLING)
            scheduled[request.request_id] = num_new
            budget -= num_new
            prefill.spend(num_new)

        return self._build_output(scheduled, copies, preempted, finished_ids)

    def update_from_output(self, output: SchedulerOutput,
                           sampled_token_ids: Mapping[str, int]) -> list[Request]:
        """Record the step: index newly full blocks, append sampled tokens, finish requests
        that hit a stop condition. Returns the requests that got a token or finished."""
        now = self.clock()
        updated: list[Request] = []
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.is_finished:
                continue
            self.kv.cache_blocks(request)
            if not chunk.sample:
                continue
            token_id = sampled_token_ids[request.request_id]
            request.append_output_token(token_id, now)
            request.transition(RequestStatus.DECODING)
            reason = self._stop_reason(request, token_id, now)
            if reason is not None:
                self._finish(request, reason, now)
            updated.append(request)
        return updated

    # -- internals -----------------------------------------------------------------------

    def _apply_boundary(self, now: float) -> tuple[str, ...]:
        """Apply queued intake and aborts, expire deadlines, free finished requests' blocks."""
        while self._new:
            request = self._new.popleft()
            if request.request_id in self.requests:  # lost a race with a same-id add
                request.finish(FinishReason.ERROR, now, "duplicate request id")
                continue
            if request.transition(RequestStatus.QUEUED):
                self._activate_tenant(request.tenant)
                self.requests[request.request_id] = request
                self._order[request.request_id] = next(self._counter)
                self.waiting.append(request)
        while self._aborts:
            request_id, reason = self._aborts.popleft()
            aborted = self.requests.get(request_id)
            if aborted is not None:
                self._finish(aborted, reason, now)
        for request in [*self.waiting, *self.running]:
            if request.deadline is not None and now >= request.deadline:
                self._finish(request, FinishReason.DEADLINE, now)
        finished_ids = []
        for request in self._to_free:
            self.kv.free(request)
            self.requests.pop(request.request_id, None)
            self._order.pop(request.request_id, None)
            finished_ids.append(request.request_id)
        self._to_free.clear()
        return tuple(finished_ids)

    def _finish(self, request: Request, reason: FinishReason, now: float) -> None:
        if not request.finish(reason, now):
            return
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._to_free.append(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.transition(RequestStatus.QUEUED)
        self.waiting.append(request)
        self.num_preemptions += 1

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        return min(request.num_tokens - request.num_computed_tokens,
                   self.config.long_prefill_token_threshold, budget)

    def _activate_tenant(self, tenant: str) -> None:
        """A tenant coming back from idle starts at the least active virtual time; with no
        tenant active, level with the furthest-ahead one, so nobody carries credit across an
        idle period (a newcomer at 0 would otherwise outrank a returning tenant)."""
        active = {r.tenant for r in (*self.waiting, *self.running)}
        floor = min((self._vtime.get(t, 0.0) for t in active),
                    default=max(self._vtime.values(), default=0.0))
        if tenant not in active:
            self._vtime[tenant] = max(self._vtime.get(tenant, 0.0), floor)

    def _preempt_for_fairness(self, now: float) -> list[str]:
        """Make room for the request next in line when its tenant holds fewer running slots
        (per weight) than another tenant, and it cannot start because the slots or the KV
        blocks are all taken: preempt that tenant's newest, least important request.

        Strict inequality after the move, so two tenants never take a slot back and forth;
        never preempts a request more important than the one it makes room for."""
        preempted: list[str] = []
        while self.waiting:
            candidate = self._pick_waiting(now, self.waiting)
            hit = (self.kv.find_prefix_hit(candidate) if candidate.num_computed_tokens == 0
                   else NO_HIT)
            num_new = min(candidate.num_tokens - hit.num_tokens,
                          self.config.long_prefill_token_threshold)
            if (len(self.running) < self.config.max_num_running
                    and self.kv.can_allocate(candidate, num_new, hit)):
                break
            victim = self._fairness_victim(candidate)
            if victim is None:
                break
            self._preempt(victim)
            preempted.append(victim.request_id)
        return preempted

    def _fairness_victim(self, candidate: Request) -> Request | None:
        weight = self.config.tenant_weight
        counts = Counter(r.tenant for r in self.running)
        mine = (counts[candidate.tenant] + 1) / weight(candidate.tenant)
        over = [t for t in counts if t != candidate.tenant and mine < counts[t] / weight(t)]
        if not over:
            return None
        tenant = max(over, key=lambda t: counts[t] / weight(t))
        victims = [r for r in self.running
                   if r.tenant == tenant and r.priority >= candidate.priority]
        if not victims:
            return None
        return max(victims, key=lambda r: (r.priority, self._order[r.request_id]))

    def _pick_waiting(self, now: float, candidates: list[Request]) -> Request:
        # Aging lifts a request at most to the best priority waiting: it ends starvation of
        # lower priorities without ranking same-priority requests by age over tenant share.
        best = min(r.priority for r in candidates)
        # Equal virtual times are common (a tenant arriving next to a flooding one starts
        # level with it): then the tenant holding fewer running slots per weight goes first.
        running = Counter(r.tenant for r in self.running)

        def key(request: Request) -> tuple[float, ...]:
            order = float(self._order[request.request_id])
            vtime = self._vtime.get(request.tenant, 0.0)
            share = running[request.tenant] / self.config.tenant_weight(request.tenant)
            if self.config.policy is SchedulingPolicy.PRIORITY:
                waited = now - request.timings.arrival_time
                level = max(best, math.floor(request.priority
                                             - waited / self.config.priority_aging_seconds))
                return (level, vtime, share, order)
            return (vtime, share, order)

        return min(candidates, key=key)

    def _build_output(self, scheduled: dict[str, int], copies: dict[str, list[tuple[int, int]]],
                      preempted: list[str], finished_ids: tuple[str, ...]) -> SchedulerOutput:
        chunks = []
        for request_id, num_new in scheduled.items():
            request = self.requests[request_id]
            start = request.num_computed_tokens
            end = start + num_new
            chunks.append(ScheduledChunk(
                request_id=request_id,
                token_ids=tuple(request.all_token_ids[start:end]),
                start_position=start,
                block_ids=tuple(self.kv.block_ids(request_id)),
                sample=end == request.num_tokens,
            ))
            request.num_computed_tokens = end
            tenant = request.tenant
            self._vtime[tenant] = (self._vtime.get(tenant, 0.0)
                                   + num_new / self.config.tenant_weight(tenant))
        return SchedulerOutput(
            chunks=tuple(chunks),
            num_scheduled_tokens=sum(scheduled.values()),
            block_copies=tuple(pair for pairs in copies.values() for pair in pairs),
            preempted_request_ids=tuple(preempted),
            finished_request_ids=finished_ids,
        )

    def _stop_reason(self, request: Request, token_id: int, now: float) -> FinishReason | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens and (
                (not params.ignore_eos and token_id in self.eos_token_ids)
                or token_id in params.stop_token_ids):
            return FinishReason.STOP
        if (request.num_output_tokens >= params.max_tokens
                or request.num_tokens >= self.max_model_len):
            return FinishReason.LENGTH
        if request.deadline is not None and now >= request.deadline:
            return FinishReason.DEADLINE
        return None


class _PrefillAllowance:
    """Prompt tokens one step may still compute under `max_prefill_tokens_per_step`: the
    step's first prefill chunk is never held back (so a long prompt keeps its pace), the
    others share what the cap leaves."""

    def __init__(self, cap: int | None) -> None:
        self.left = cap
        self.first = True

    def of(self, budget: int) -> int:
        """Tokens the next prefill chunk may have, out of the step's remaining budget."""
        if self.first or self.left is None:
            return budget
        return max(0, min(budget, self.left))

    def spend(self, tokens: int) -> None:
        self.first = False
        if self.left is not None:
            self.left -= tokens
