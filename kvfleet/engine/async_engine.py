"""`AsyncEngine`: the engine core driven by one background thread, bridged to asyncio.

The core is not thread-safe and does not need to be: exactly one thread (the engine thread)
ever touches it. The event loop talks to that thread through a command list (add, abort)
that is drained before every step, so an abort (client disconnect, deadline, drain) takes
effect within one engine step. After each step the thread turns every request's new tokens
into one `StreamEvent` and hands the batch to the loop with a single `call_soon_threadsafe`.

A `RequestStream` keeps every event it ever published (a few per token, bounded by
max_tokens), so any number of readers can follow it from the start: the HTTP response, and a
retry that carries the same idempotency key and replays the same sequence numbers.

Admission (what is refused before queueing, and why) lives in `admission`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from kvfleet.engine.admission import (
    AdmissionLimits,
    IdempotencyConflictError,
    ServedModel,
    check_admission,
)
from kvfleet.engine.idempotency import IdempotencyCache, IdempotencyConflict
from kvfleet.engine.metrics import EngineMetrics, EngineStats, FinishedRequestTimings
from kvfleet.engine.request import FinishReason, Request, SamplingParams
from kvfleet.engine.request_log import RequestLogRecord, log_finished_request
from kvfleet.engine.stop import StopStrings
from kvfleet.engine.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("kvfleet.engine.async")


class EngineCoreProtocol(Protocol):
    """What the async layer needs from the engine core (all calls on the engine thread)."""

    def add_request(self, request: Request) -> None: ...

    def abort_request(self, request_id: str,
                      reason: FinishReason = FinishReason.CANCELLED) -> None: ...

    def step(self) -> object: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...


@dataclass(frozen=True, slots=True)
class GenerationSpec:
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    tenant: str = "default"
    cache_scope: str = "default"
    priority: int = 0
    deadline_seconds: float | None = None
    idempotency_key: str | None = None
    body_fingerprint: str = ""
    skip_special_tokens: bool = True
    prompt_text: str | None = None  # only for --log-text
    # The engine's own request (the warm-up before READY): kept out of the request, token
    # and latency metrics, which describe clients' requests. Counted there, the warm-up's
    # first-use latency sat in a fresh pod's TTFT histogram, where a rollout's canary
    # analysis reads it (a real Prometheus put a TTFT p95 of 8 requests at 0.057 s when none
    # of them had taken over 0.05).
    internal: bool = False


@dataclass(frozen=True, slots=True)
class StreamEvent:
    seq: int
    text: str
    num_new_tokens: int
    finish_reason: str | None = None
    token_ids: tuple[int, ...] = ()  # the new tokens (the stopping token included)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


# A StreamEvent (sys.getsizeof: 88 B), its text object (49 B + the characters) and its list
# slot, rounded up.
EVENT_OVERHEAD_BYTES = 160


class RequestStream:
    """The published events of one request; readers iterate from the first event."""

    def __init__(self, request_id: str, spec: GenerationSpec, created: int) -> None:
        self.request_id = request_id
        self.spec = spec
        self.created = created
        self.events: list[StreamEvent] = []
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._changed = asyncio.Event()
        self.num_readers = 0

    @property
    def finished(self) -> bool:
        return bool(self.events) and self.events[-1].finish_reason is not None

    def publish(self, event: StreamEvent) -> None:
        if self.finished:
            return  # the first final event wins; the engine may report an abort twice
        self.events.append(event)
        self._changed.set()

    async def follow(self) -> AsyncIterator[StreamEvent]:
        index = 0
        while True:
            while index < len(self.events):
                event = self.events[index]
                index += 1
                yield event
                if event.finish_reason is not None:
                    return
            self._changed.clear()
            await self._changed.wait()

    def nbytes(self) -> int:
        """About what the kept events weigh: their text plus a fixed cost per event."""
        return sum(len(e.text) * 4 + EVENT_OVERHEAD_BYTES for e in self.events)

    async def result(self) -> list[StreamEvent]:
        async for _ in self.follow():
            pass
        return list(self.events)


@dataclass(slots=True)
class _Tracked:
    """Engine-thread state of one request."""

    request: Request
    stream: RequestStream
    detokenizer: IncrementalDetokenizer
    output: StopStrings  # the text so far, with the request's stop strings applied
    deadline: float | None
    num_sent_tokens: int = 0
    seq: int = 0
    forced_reason: str | None = None  # set when this layer ends the request itself


@dataclass(slots=True)
class _Commands:
    adds: list[_Tracked] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)


class AsyncEngine:
    def __init__(self, core: EngineCoreProtocol, model: ServedModel, tokenizer: Tokenizer,
                 metrics: EngineMetrics, *,
                 limits: AdmissionLimits | None = None,
                 idempotency: IdempotencyCache[RequestStream] | None = None,
                 log_text: bool = False) -> None:
        self.core = core
        self.model = model
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.limits = limits or AdmissionLimits()
        self._idempotency: IdempotencyCache[RequestStream] = idempotency or IdempotencyCache(
            size=RequestStream.nbytes)
        self._log_text = log_text
        self.accepting = False
        # Seconds slept after every step, and steps until the thread hangs: injected faults
        # only (`faults.token_delay`, `faults.stall_after`).
        self.step_delay = 0.0
        self.stall_after: int | None = None
        self._in_flight: dict[str, RequestStream] = {}
        self._per_tenant: dict[str, int] = {}
        self._next_id = 0
        self._lock = threading.Condition()
        self._commands = _Commands()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._needs_step = False  # engine thread only: an abort's blocks free at a step
        # The watchdog's view: when the engine thread last finished a loop turn, and why the
        # engine is failed (sticky: a dead or stalled engine is restarted, not trusted again).
        self._progress_at = time.monotonic()
        self.failure: str | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self.stall_seconds = 60.0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, stall_seconds: float = 60.0) -> None:
        self._loop = asyncio.get_running_loop()
        self.stall_seconds = stall_seconds
        self._progress_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine", daemon=True)
        self._thread.start()
        self._watchdog = asyncio.create_task(self._watch())

    def check(self) -> str | None:
        """Why the engine cannot serve, or None: its thread is gone, or requests are in flight
        and no loop turn finished in `stall_seconds` (one step of a full batch takes well
        under a second; a stuck kernel or a deadlock never finishes one)."""
        if self.failure is not None:
            return self.failure
        if self._thread is not None and not self._thread.is_alive() and not self._stop:
            return "the engine thread is not running"
        stalled = time.monotonic() - self._progress_at
        if self._in_flight and stalled > self.stall_seconds:
            return (f"no engine step finished in {stalled:.0f} s with {len(self._in_flight)} "
                    "requests in flight")
        return None

    async def _watch(self, period: float = 1.0) -> None:
        """Fails the engine once `check` finds a problem: it stops accepting, /health and
        /ready answer 503 with the reason (the kubelet restarts the pod, routers stop sending
        to it), and every in-flight stream ends now with an error event, not a hang."""
        while self.failure is None:
            await asyncio.sleep(period)
            if self._stop:
                return
            problem = self.check()
            if problem is None:
                continue
            self.failure, self.accepting = problem, False
            streams = list(self._in_flight.values())
            logger.error("engine failed: %s; ending %d requests with finish_reason error",
                         problem, len(streams))
            for stream in streams:
                stream.publish(StreamEvent(
                    seq=len(stream.events), text="", num_new_tokens=0, finish_reason="error",
                    num_prompt_tokens=len(stream.spec.prompt_token_ids),
                    num_output_tokens=sum(e.num_new_tokens for e in stream.events)))
                if not stream.accepted.done():
                    stream.accepted.set_result(None)
                self._forget(stream)

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def drain(self, grace_seconds: float) -> int:
        """Stop accepting; wait up to `grace_seconds` for in-flight requests, then cancel the
        rest (finish_reason `cancelled`). Returns how many were cancelled."""
        self.accepting = False
        deadline = time.monotonic() + grace_seconds
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        leftover = list(self._in_flight)
        for request_id in leftover:
            self.abort(request_id, "cancelled")
        for stream in [s for s in self._in_flight.values()]:
            await asyncio.wait_for(stream.result(), timeout=30.0)
        return len(leftover)

    # -- requests ----------------------------------------------------------------------------

    async def submit(self, spec: GenerationSpec) -> RequestStream:
        """Admit a request (or find its idempotent original); raises a ServingError."""
        if spec.idempotency_key is not None:
            try:
                original = self._idempotency.get(spec.tenant, spec.idempotency_key,
                                                 spec.body_fingerprint)
            except IdempotencyConflict:
                raise IdempotencyConflictError(
                    f"Idempotency-Key {spec.idempotency_key!r} was used with a different "
                    "request body; use a new key for a new request", "Idempotency-Key",
                ) from None
            if original is not None:
                await original.accepted
                return original
        self._admit(spec)
        self._next_id += 1
        request_id = f"cmpl-{self._next_id:x}-{time.time_ns() % 10**9:09d}"
        stream = RequestStream(request_id, spec, int(time.time()))
        now = time.monotonic()  # deadlines and timings: never moved by a clock step
        request = Request(
            request_id=request_id, prompt_token_ids=spec.prompt_token_ids,
            sampling_params=spec.sampling, tenant=spec.tenant, priority=spec.priority,
            deadline=None if spec.deadline_seconds is None else now + spec.deadline_seconds,
            idempotency_key=spec.idempotency_key, cache_salt=spec.cache_scope,
            arrival_time=now, prompt=spec.prompt_text,
        )
        tracked = _Tracked(
            request=request, stream=stream,
            detokenizer=IncrementalDetokenizer(self.tokenizer, spec.prompt_token_ids,
                                               spec.skip_special_tokens),
            output=StopStrings(spec.sampling.stop), deadline=request.deadline,
        )
        self._in_flight[request_id] = stream
        self._per_tenant[spec.tenant] = self._per_tenant.get(spec.tenant, 0) + 1
        if spec.idempotency_key is not None:
            self._idempotency.put(spec.tenant, spec.idempotency_key, spec.body_fingerprint,
                                  stream)
        with self._lock:
            self._commands.adds.append(tracked)
            self._lock.notify()
        await stream.accepted  # raises the core's rejection, if any
        return stream

    def _admit(self, spec: GenerationSpec) -> None:
        check_admission(len(spec.prompt_token_ids), spec.sampling.max_tokens, spec.tenant,
                        self.model, self.limits, accepting=self.accepting,
                        num_in_flight=len(self._in_flight),
                        num_tenant_in_flight=self._per_tenant.get(spec.tenant, 0))

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        """End a request at the next step boundary; harmless if it already finished."""
        with self._lock:
            self._commands.aborts.append((request_id, reason))
            self._lock.notify()

    def attach(self, stream: RequestStream) -> None:
        stream.num_readers += 1

    def detach(self, stream: RequestStream) -> None:
        """A reader went away (finished or disconnected). When the last one leaves a request
        without an idempotency key, nobody can come back for its output, so it is cancelled;
        with a key it runs on (bounded by max_tokens and its deadline) for the retry."""
        stream.num_readers -= 1
        if stream.num_readers <= 0 and not stream.finished and stream.spec.idempotency_key is None:
            self.abort(stream.request_id, "cancelled")

    # -- event-loop side of delivery ---------------------------------------------------------

    def _deliver(self, batch: list[tuple[RequestStream, StreamEvent | BaseException | None]]
                 ) -> None:
        for stream, item in batch:
            if item is None:
                if not stream.accepted.done():
                    stream.accepted.set_result(None)
                continue
            if isinstance(item, BaseException):
                if not stream.accepted.done():
                    stream.accepted.set_exception(item)
                self._forget(stream)
                key = stream.spec.idempotency_key
                if key is not None:  # a rejected request was never generated: retry afresh
                    self._idempotency.discard(stream.spec.tenant, key)
                continue
            if not stream.accepted.done():
                stream.accepted.set_result(None)
            stream.publish(item)
            if item.finish_reason is not None:
                self._forget(stream)

    def _forget(self, stream: RequestStream) -> None:
        if self._in_flight.pop(stream.request_id, None) is None:
            return
        tenant = stream.spec.tenant
        self._per_tenant[tenant] -= 1
        if not self._per_tenant[tenant]:
            del self._per_tenant[tenant]
        key = stream.spec.idempotency_key
        if key is not None:
            self._idempotency.mark_finished(tenant, key)

    # -- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                # Idle only when the core is too: finished requests' blocks are freed at the
                # next step boundary, so a core with nothing running still needs that step.
                while (not self._stop and not self._commands.adds and not self._commands.aborts
                       and not self._tracked and not self._needs_step
                       and not self.core.has_unfinished_requests()):
                    self._lock.wait(timeout=1.0)
                if self._stop:
                    return
                commands, self._commands = self._commands, _Commands()
                self._progress_at = time.monotonic()  # idle time is not a stall
            batch: list[tuple[RequestStream, StreamEvent | BaseException | None]] = []
            try:
                self._apply(commands, batch)
                # Admissions go out before the step, not with its tokens: a streaming
                # response's headers are then sent while its prefill runs, and the first
                # token has only its own event left to send (the response start took 5-8 ms
                # of the way from a first token to the client, measured).
                self._hand_over(batch)
                batch = []
                self._iterate(batch)
            except Exception:  # never let the engine thread die with requests waiting on it
                logger.exception("engine loop failed; ending %d requests with finish_reason "
                                 "error", len(self._tracked))
                self._fail_all(batch)
            self._hand_over(batch)
            self._progress_at = time.monotonic()

    def _hand_over(self, batch: list[tuple[RequestStream, StreamEvent | BaseException | None]]
                   ) -> None:
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, batch)

    def _iterate(self, batch: list[tuple[RequestStream, StreamEvent | BaseException | None]]
                 ) -> None:
        self._expire_deadlines()
        try:
            if self._tracked or self._needs_step or self.core.has_unfinished_requests():
                self._needs_step = False
                self.core.step()
                if self.step_delay > 0:
                    time.sleep(self.step_delay)
                if self.stall_after is not None:
                    self.stall_after -= 1
                    while self.stall_after <= 0 and not self._stop:  # the injected hang
                        time.sleep(0.1)
        except Exception:  # a failing step must not kill the server: fail its requests
            logger.exception("engine step failed; failing %d requests", len(self._tracked))
            for tracked in self._tracked.values():
                tracked.forced_reason = tracked.forced_reason or "error"
                self.core.abort_request(tracked.request.request_id, FinishReason.ERROR)
            self._needs_step = True
        self._collect(batch)
        self.metrics.observe_stats(self.core.stats())

    def _fail_all(self, batch: list[tuple[RequestStream, StreamEvent | BaseException | None]]
                  ) -> None:
        for tracked in self._tracked.values():
            batch.append((tracked.stream, StreamEvent(
                seq=tracked.seq, text="", num_new_tokens=0, finish_reason="error",
                num_prompt_tokens=tracked.request.num_prompt_tokens,
                num_output_tokens=tracked.num_sent_tokens)))
            try:
                self.core.abort_request(tracked.request.request_id, FinishReason.ERROR)
            except Exception:  # the core is already broken; the request is ended for clients
                logger.exception("abort of %s failed", tracked.request.request_id)
        self._tracked.clear()
        self._needs_step = True

    def _apply(self, commands: _Commands,
               batch: list[tuple[RequestStream, StreamEvent | BaseException | None]]) -> None:
        for tracked in commands.adds:
            try:
                self.core.add_request(tracked.request)
            except Exception as exc:
                batch.append((tracked.stream, exc))
                continue
            self._tracked[tracked.request.request_id] = tracked
            if not tracked.stream.spec.internal:
                self.metrics.observe_admitted(tracked.request.num_prompt_tokens)
            batch.append((tracked.stream, None))
        for request_id, reason in commands.aborts:
            tracked_or_none = self._tracked.get(request_id)
            if tracked_or_none is None or tracked_or_none.forced_reason is not None:
                continue
            tracked_or_none.forced_reason = reason
            self.core.abort_request(request_id, FinishReason(reason))
            self._needs_step = True

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for tracked in self._tracked.values():
            if (tracked.deadline is not None and now >= tracked.deadline
                    and tracked.forced_reason is None and not tracked.request.is_finished):
                tracked.forced_reason = "deadline"
                self.core.abort_request(tracked.request.request_id, FinishReason.DEADLINE)
                self._needs_step = True

    def _collect(self, batch: list[tuple[RequestStream, StreamEvent | BaseException | None]]
                 ) -> None:
        finished: list[str] = []
        for request_id, tracked in self._tracked.items():
            event = self._progress(tracked)
            if event is None:
                continue
            batch.append((tracked.stream, event))
            if event.finish_reason is not None:
                finished.append(request_id)
                self._record_finish(tracked, event.finish_reason)
        for request_id in finished:
            del self._tracked[request_id]

    def _progress(self, tracked: _Tracked) -> StreamEvent | None:
        request = tracked.request
        output_ids = request.output_token_ids
        new_ids = output_ids[tracked.num_sent_tokens:]
        tracked.num_sent_tokens = len(output_ids)
        if not tracked.stream.spec.internal:
            self.metrics.observe_new_tokens(len(new_ids))
        reason = tracked.forced_reason
        if reason is None and request.is_finished and request.finish_reason is not None:
            reason = request.finish_reason.value
        if (reason == "stop" and new_ids and (new_ids[-1] in request.sampling_params.stop_token_ids
                                              or new_ids[-1] == self.tokenizer.eos_token_id)):
            # Like vLLM: the token that stopped generation is counted, not shown.
            piece = tracked.detokenizer.add_tokens(new_ids[:-1])
        else:
            piece = tracked.detokenizer.add_tokens(new_ids)
        if reason is not None:
            piece += tracked.detokenizer.flush()
        delta = tracked.output.feed(piece, final=reason is not None)
        if tracked.output.hit:
            if reason is None:  # the core has not stopped on it (yet): stop it here
                reason = tracked.forced_reason = "stop"
                self.core.abort_request(request.request_id, FinishReason.STOP)
                self._needs_step = True
            elif reason == "length":
                reason = "stop"
        if not new_ids and reason is None:
            return None
        event = StreamEvent(
            seq=tracked.seq, text=delta, num_new_tokens=len(new_ids), finish_reason=reason,
            token_ids=tuple(new_ids), num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )
        tracked.seq += 1
        return event

    def _record_finish(self, tracked: _Tracked, finish_reason: str) -> None:
        request = tracked.request
        timings = request.timings
        finish_time = timings.finish_time or time.monotonic()
        result = FinishedRequestTimings(
            arrival_time=timings.arrival_time,
            first_scheduled_time=timings.first_scheduled_time,
            first_token_time=timings.first_token_time,
            last_token_time=timings.last_token_time,
            finish_time=finish_time,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            finish_reason=finish_reason,
        )
        if not tracked.stream.spec.internal:
            self.metrics.observe_finished(result)
        log_finished_request(RequestLogRecord(
            request_id=request.request_id, tenant=request.tenant,
            idempotency_key=request.idempotency_key, priority=request.priority,
            timings=result, num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            prompt=request.prompt if self._log_text else None,
            output=tracked.output.text if self._log_text else None,
        ))
