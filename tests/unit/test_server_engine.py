"""AsyncEngine, lifecycle, metrics and request logs over a fake core.

Budget: a few seconds. Cancellation is measured in engine steps, not wall time.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fakes import FakeCore, chat_template, make_engine

from kvfleet.engine.admission import NotAcceptingError
from kvfleet.engine.async_engine import AsyncEngine, GenerationSpec, RequestStream
from kvfleet.engine.idempotency import IdempotencyCache, IdempotencyConflict
from kvfleet.engine.lifecycle import Lifecycle, LifecycleState, WarmupError, warm_up
from kvfleet.engine.request import SamplingParams
from kvfleet.engine.request_log import REQUEST_LOGGER, JsonLineFormatter
from kvfleet.engine.server import Serving, create_app


def spec(max_tokens: int = 200, **kwargs: object) -> GenerationSpec:
    return GenerationSpec(prompt_token_ids=(1, 2, 3),
                          sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                          **kwargs)  # type: ignore[arg-type]


async def started(core: FakeCore, log_text: bool = False) -> tuple[AsyncEngine, Lifecycle]:
    engine, _ = make_engine(core, log_text=log_text)
    engine.start()
    lifecycle = Lifecycle()
    await warm_up(engine, lifecycle, (1, 2, 3))
    return engine, lifecycle


async def wait_events(stream: RequestStream, n: int) -> None:
    for _ in range(2000):
        if len(stream.events) >= n:
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"fewer than {n} events")


@pytest.mark.asyncio
async def test_last_reader_leaving_cancels_within_one_step_and_frees_blocks() -> None:
    core = FakeCore(step_seconds=0.01)
    engine, _ = await started(core)
    try:
        stream = await engine.submit(spec())
        engine.attach(stream)
        await wait_events(stream, 3)
        steps_before = core.num_steps
        engine.detach(stream)
        events = await asyncio.wait_for(stream.result(), 5)
        assert events[-1].finish_reason == "cancelled"
        # The step running when the reader left may finish; no further step computes it.
        assert core.num_steps - steps_before <= 2
        assert len(events) - 1 <= 3 + 2
        assert core.blocks_in_use() == 0 and engine.num_in_flight == 0
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_request_with_idempotency_key_outlives_its_reader() -> None:
    engine, _ = await started(FakeCore())
    try:
        stream = await engine.submit(spec(max_tokens=20, idempotency_key="k",
                                          body_fingerprint="f"))
        engine.attach(stream)
        engine.detach(stream)
        events = await asyncio.wait_for(stream.result(), 5)
        assert events[-1].finish_reason == "length"
        again = await engine.submit(spec(max_tokens=20, idempotency_key="k",
                                         body_fingerprint="f"))
        assert again is stream
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_failing_step_fails_its_requests_and_the_engine_keeps_serving() -> None:
    core = FakeCore(step_seconds=0.005)
    engine, _ = await started(core)
    try:
        stream = await engine.submit(spec())
        await wait_events(stream, 1)
        core.fail_next_step = True
        events = await asyncio.wait_for(stream.result(), 5)
        assert events[-1].finish_reason == "error"
        after = await engine.submit(spec(max_tokens=4))
        assert (await after.result())[-1].finish_reason == "length"
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_drain_lets_short_requests_finish_then_cancels_the_rest() -> None:
    core = FakeCore(step_seconds=0.005)
    engine, lifecycle = await started(core)
    app = create_app(Serving(lifecycle, engine, chat_template()))
    try:
        short = await engine.submit(spec(max_tokens=5))
        long = await engine.submit(spec(max_tokens=200))
        lifecycle.advance(LifecycleState.DRAINING)
        drain = asyncio.ensure_future(engine.drain(grace_seconds=0.3))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://kvfleet") as client:
            assert (await client.get("/ready")).status_code == 503
            r = await client.post("/v1/completions", json={"prompt": "x"})
            assert (r.status_code, r.json()["error"]["code"]) == (503, "not_ready")
        assert await asyncio.wait_for(drain, 10) == 1
        assert short.events[-1].finish_reason == "length"
        assert long.events[-1].finish_reason == "cancelled"
        assert core.blocks_in_use() == 0
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_lifecycle_reaches_ready_only_through_a_warm_up_generation() -> None:
    lifecycle = Lifecycle()
    assert not lifecycle.advance(LifecycleState.READY)  # no skipping WARMING
    core = FakeCore()
    core.fail_next_step = True
    engine, _ = make_engine(core)
    engine.start()
    try:
        with pytest.raises(WarmupError):
            await warm_up(engine, lifecycle, (1, 2))
        assert lifecycle.state is LifecycleState.WARMING and not engine.accepting
        await warm_up(engine, lifecycle, (1, 2))
        assert lifecycle.is_ready
        assert lifecycle.advance(LifecycleState.DRAINING)
        assert not lifecycle.advance(LifecycleState.READY)
    finally:
        await engine.stop()


@pytest.fixture
def request_log() -> Iterator[io.StringIO]:
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonLineFormatter())
    log = logging.getLogger(REQUEST_LOGGER)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield buffer
    finally:
        log.removeHandler(handler)


@pytest.mark.asyncio
@pytest.mark.parametrize("log_text", [False, True])
async def test_one_json_log_line_per_finished_request_text_only_on_request(
        request_log: io.StringIO, log_text: bool) -> None:
    engine, _ = await started(FakeCore(), log_text=log_text)
    try:
        stream = await engine.submit(spec(max_tokens=6, tenant="acme", prompt_text="SECRET"))
        await stream.result()
    finally:
        await engine.stop()
    lines = [json.loads(line) for line in request_log.getvalue().splitlines()]
    mine = [line for line in lines if line["request_id"] == stream.request_id]
    assert len(mine) == 1
    record = mine[0]
    assert record["event"] == "request_finished" and record["tenant"] == "acme"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (3, 6)
    assert record["finish_reason"] == "length"
    assert record["ttft_s"] >= 0 and record["e2e_s"] >= record["ttft_s"]
    assert ("SECRET" in json.dumps(record)) is log_text
    assert ("output" in record) is log_text


@pytest.mark.asyncio
async def test_metrics_use_design_names_and_only_low_cardinality_labels() -> None:
    engine, _ = await started(FakeCore())
    try:
        for n in (1, 4, 4):
            await (await engine.submit(spec(max_tokens=n))).result()
    finally:
        await engine.stop()
    families = {f.name: f for f in text_string_to_metric_families(
        engine.metrics.exposition().decode())}
    p = "kvfleet_engine_"
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "queue_time_seconds", "requests_running",
                 "requests_waiting", "kv_cache_usage_ratio", "prompt_tokens",
                 "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
                 "preemptions", "requests"):
        assert p + name in families, name
    for family in families.values():
        for sample in family.samples:
            assert set(sample.labels) <= {"model", "revision", "finish_reason", "le"}

    def value(family: str, suffix: str = "", **labels: str) -> float:
        return sum(s.value for s in families[p + family].samples
                   if s.name == p + family + suffix
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    # The 3 requests, not the warm-up (the engine's own, its first-use latency no client's);
    # TPOT only for requests with more than one token.
    assert value("time_to_first_token_seconds", "_count") == 3
    assert value("time_per_output_token_seconds", "_count") == 2
    assert value("generation_tokens", "_total") == 1 + 4 + 4
    assert value("prompt_tokens", "_total") == 3 * 3
    assert value("requests", "_total", finish_reason="length") == 3
    assert value("requests_running") == 0


def test_idempotency_cache_expires_finished_entries_and_bounds_its_size() -> None:
    now = [0.0]
    cache: IdempotencyCache[str] = IdempotencyCache(capacity=2, ttl_seconds=10,
                                                    clock=lambda: now[0])
    cache.put("t", "a", "f1", "A")
    with pytest.raises(IdempotencyConflict):
        cache.get("t", "a", "f2")
    assert cache.get("u", "a", "f1") is None  # scoped by tenant
    now[0] = 100.0
    assert cache.get("t", "a", "f1") == "A"  # running entries never expire
    cache.mark_finished("t", "a")
    now[0] = 111.0
    assert cache.get("t", "a", "f1") is None
    for key in "xyz":
        cache.put("t", key, "f", key)
        cache.mark_finished("t", key)
    assert len(cache) == 2 and cache.get("t", "x", "f") is None


def test_idempotency_cache_bounds_finished_bytes_and_never_evicts_a_running_request() -> None:
    cache: IdempotencyCache[str] = IdempotencyCache(capacity=3, ttl_seconds=60,
                                                    max_bytes=10, size=len)
    for key in "abc":  # three requests running at once, each over the byte budget
        cache.put("t", key, "f", key * 8)
    cache.put("t", "d", "f", "d")  # a fourth: over the count, but every entry is running
    assert len(cache) == 4 and cache.get("t", "a", "f") == "a" * 8
    cache.mark_finished("t", "a")  # finished, and the count (4 > 3) drops it at once
    assert cache.get("t", "a", "f") is None and len(cache) == 3
    cache.mark_finished("t", "b")  # 8 bytes finished: within 10
    assert len(cache) == 3 and cache.finished_bytes == 8
    cache.mark_finished("t", "c")  # 16 bytes finished: the least recently used goes
    assert cache.get("t", "b", "f") is None and cache.get("t", "c", "f") == "c" * 8
    assert cache.finished_bytes == 8
    assert cache.get("t", "d", "f") == "d"  # still running, still there


@pytest.mark.asyncio
async def test_a_bug_outside_the_step_ends_requests_with_error_instead_of_hanging() -> None:
    core = FakeCore(step_seconds=0.005)
    engine, _ = await started(core)
    try:
        stream = await engine.submit(spec())
        await wait_events(stream, 1)
        original = core.stats
        calls = iter(range(1_000_000))

        def broken_once() -> object:
            if next(calls) == 0:
                raise RuntimeError("injected bug in the stats snapshot")
            return original()

        core.stats = broken_once  # type: ignore[method-assign,assignment]
        events = await asyncio.wait_for(stream.result(), 5)
        assert events[-1].finish_reason == "error"
        after = await engine.submit(spec(max_tokens=3))
        assert (await asyncio.wait_for(after.result(), 5))[-1].finish_reason == "length"
        assert core.blocks_in_use() == 0
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_a_wall_clock_step_moves_no_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """NTP steps the wall clock an hour ahead mid-request: a 30 s deadline still has its 30 s
    (deadlines run on the monotonic clock), and an hour back does not extend one either."""
    core = FakeCore(step_seconds=0.005)
    engine, _ = await started(core)
    try:
        stream = await engine.submit(spec(max_tokens=250, deadline_seconds=30.0))
        await wait_events(stream, 1)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 3600)
        await wait_events(stream, len(stream.events) + 20)
        assert not stream.finished, stream.events[-1]
        short = await engine.submit(spec(max_tokens=250, deadline_seconds=0.2))
        monkeypatch.setattr(time, "time", lambda: real() - 3600)
        events = await asyncio.wait_for(short.result(), 5)
        assert events[-1].finish_reason == "deadline"
    finally:
        await engine.stop()


async def _probes(app: object) -> tuple[httpx.Response, httpx.Response]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),  # type: ignore[arg-type]
                                 base_url="http://kvfleet") as client:
        return await client.get("/health"), await client.get("/ready")


@pytest.mark.asyncio
async def test_a_stalled_engine_fails_its_probes_and_ends_its_streams() -> None:
    """The engine thread stops making progress with a request in flight (a stuck kernel, a
    deadlock): within the stall limit plus the watchdog's period, liveness and readiness
    answer 503 with the reason, the stream ends with an error event instead of hanging, and
    new requests are refused."""
    core = FakeCore(step_seconds=0.005)
    engine, lifecycle = await started(core)
    app = create_app(Serving(lifecycle, engine, chat_template()))
    stuck = threading.Event()
    try:
        health, ready = await _probes(app)
        assert (health.status_code, ready.status_code) == (200, 200)
        engine.stall_seconds = 0.3
        stream = await engine.submit(spec(max_tokens=200))
        await wait_events(stream, 2)
        real_step = core.step

        def stall() -> None:
            stuck.wait(30)
            real_step()

        core.step = stall  # type: ignore[method-assign]
        events = await asyncio.wait_for(stream.result(), 5)
        assert events[-1].finish_reason == "error"
        health, ready = await _probes(app)
        assert (health.status_code, ready.status_code) == (503, 503)
        assert "no engine step finished in" in health.json()["reason"]
        assert "1 requests in flight" in ready.json()["reason"]
        with pytest.raises(NotAcceptingError):
            await engine.submit(spec(max_tokens=3))
    finally:
        stuck.set()
        await engine.stop()


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the kill
async def test_a_dead_engine_thread_fails_its_probes_even_when_idle() -> None:
    core = FakeCore(step_seconds=0.005)
    engine, lifecycle = await started(core)
    app = create_app(Serving(lifecycle, engine, chat_template()))
    try:
        def die() -> None:
            raise SystemExit("injected: the engine thread exits")  # not an Exception

        core.step = die  # type: ignore[method-assign]
        stream = await engine.submit(spec(max_tokens=200))
        events = await asyncio.wait_for(stream.result(), 5)
        assert events[-1].finish_reason == "error"
        health, ready = await _probes(app)
        assert health.status_code == 503 and ready.status_code == 503
        assert health.json()["reason"] == "the engine thread is not running"
    finally:
        await engine.stop()
