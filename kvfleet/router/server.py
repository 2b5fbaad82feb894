"""The router's HTTP edge: the OpenAI API in front of the pools.

Per request: authenticate the key (401), find the pool named by `model` (404) and check the
tenant may use it (403), take the TenantQuota's allowance (429 with Retry-After; nothing reaches
an engine), pick the revision (traffic table) and the replica (load, then prefix affinity),
forward with the router's proof, the tenant and its priority, and stream the answer back as it
comes. A replica that fails before the first byte went to the client is retried on another; one
that fails mid-stream ends the client's stream with an error event. The quota reservation is
settled with the engine's own token count when the answer ends or the client goes away. A
sampled share of requests is copied to the shadow revision in the background (never charged,
never delaying the live answer, shed first) and compared with the live answer. Every live and
shadow request is counted by what its client got (kvfleet.router.outcome), which is what the
Rollout analysis judges a revision by.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import aiohttp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvfleet.api.labels import short_revision
from kvfleet.api.tenantquota import PriorityClass, TenantQuotaSpec
from kvfleet.router import access, answers
from kvfleet.router.errors import (
    BadRequest,
    BodyTimeout,
    BodyTooLarge,
    NoEndpoint,
    QuotaExceeded,
    RouterError,
    TenantRefused,
    Unauthorized,
    UpstreamFailed,
)
from kvfleet.router.fleet_ledger import COMMAND_SECONDS, SharedLedger, connect
from kvfleet.router.hold import WAIT_HEADER, Holds
from kvfleet.router.intake import Intake
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.outcome import (
    TIMED,
    Answer,
    Outcome,
    classify,
    read_answer,
    read_frames,
    stream_outcome,
)
from kvfleet.router.picker import EndpointLoad, pick
from kvfleet.router.probes import (
    PROBE_MAX_TOKENS,
    PROBE_TENANT,
    answered_by,
    compare_answers,
    probe_answer,
    probe_body,
    probe_id,
    same_revision,
)
from kvfleet.router.quota import QuotaLedger, Reservation, no_quota
from kvfleet.router.state import PoolRoute, RouterState, carry_loads
from kvfleet.router.tokens import TokenCounter, texts_of
from kvfleet.router.traffic import RoutePlan, session_key

log = logging.getLogger(__name__)
T = TypeVar("T")

TENANT_HEADER = "x-kvfleet-tenant"
ROUTER_TOKEN_HEADER = "x-kvfleet-router-token"
SHARED_PREFIX_HEADER = "x-kvfleet-shared-prefix"
SESSION_HEADER = "x-session-id"
REVISION_HEADER = "x-kvfleet-revision"
# vLLM's convention: lower is scheduled first.
PRIORITY = {PriorityClass.CRITICAL: -2, PriorityClass.HIGH: -1, PriorityClass.STANDARD: 0,
            PriorityClass.BATCH: 1}
# Engines' default for a chat request without max_tokens, reserved at admission.
DEFAULT_MAX_TOKENS = {"/v1/chat/completions": 1024, "/v1/completions": 16}
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_OBJECTS = 100_000  # `{` and `[` in a body (messages, content parts, tool calls)
BODY_SECONDS = 30.0  # a body's whole arrival, from its headers
# The engine gauges the replica choice reads from each engine's /metrics.
LOAD_GAUGES = ("kvfleet_engine_requests_waiting", "kvfleet_engine_requests_running",
               "kvfleet_engine_kv_cache_usage_ratio")
# (namespace, pool, short revision, traffic): the labels of a revision's request series.
Labels = tuple[str, str, str, str]
# A quiet pool's synthetic requests (Router.synthesize): the tenant they run as (a reserved
# name: its own prefix-cache scope, no TenantQuota), how often the rate is topped up, and how
# many one pool may have in flight on one router (a slow canary must not gather a pile).
SYNTHETIC_TENANT = "kvfleet-synthetic"
SYNTHETIC_TICK = 0.5
SYNTHETIC_MAX_IN_FLIGHT = 8


def _engine_headers(pool: PoolRoute, tenant: str, extra: dict[str, str]) -> dict[str, str]:
    """What every request to an engine carries: the tenant (its cache scope), JSON, and the
    pool's router token (engines refuse a request without it)."""
    headers = {TENANT_HEADER: tenant, "content-type": "application/json", **extra}
    if pool.router_token is not None:
        headers[ROUTER_TOKEN_HEADER] = pool.router_token
    return headers


async def _discard(message: dict[str, Any]) -> None:
    """The ASGI send of a synthetic request's answer: nobody reads it."""


@dataclass(frozen=True, slots=True)
class _Check:
    """An answer to check for broken signs (kvfleet.router.answers): the client's cap."""

    max_tokens: int | None


@dataclass(frozen=True, slots=True)
class RouterOptions:
    max_attempts: int = 3  # replicas tried before the first byte
    shadow_max_in_flight: int = 8
    shadow_max_tokens: int = 256
    shadow_timeout: float = 120.0  # a shadow copy still unanswered then frees its slot
    probe_max_in_flight: int = 4  # greedy probe pairs; more are shed
    probe_max_tokens: int = PROBE_MAX_TOKENS
    probe_timeout: float = 60.0
    scrape_interval: float = 0.2
    stale_after: float = 1.0
    connect_timeout: float = 2.0
    # A stalled engine must not hold a client, a replica's in-flight count and a tenant's
    # concurrency slot for ever: a stream fails after this long without a byte (its first
    # comes after queueing and prefill), a whole answer after `answer_timeout` (it comes in
    # one piece, after the whole generation).
    stream_idle_timeout: float = 120.0
    answer_timeout: float = 900.0
    # A streaming client that takes no data for this long is dropped (billed what was relayed).
    send_timeout: float = 60.0
    # "affinity" (load, then prefix affinity) or "round-robin" (the baseline it is measured
    # against in bench/router_prefix.py).
    pick_policy: str = "affinity"
    # The quota of tenants without a TenantQuota (--default-quota); None: they are refused.
    default_quota: TenantQuotaSpec | None = None
    # The shared quota ledger (--redis redis://host:port/db, under --redis-prefix); None:
    # each router replica enforces its share of every limit (kvfleet.router.fleet_ledger).
    redis_url: str | None = None
    redis_prefix: str = "kvfleet"
    redis_timeout: float = COMMAND_SECONDS
    # Requests held for a pool at zero while it wakes (kvfleet.router.hold).
    hold_per_pool: int = 64
    hold_per_tenant: int = 16
    hold_seconds: float = 300.0


def compare(live: str, shadow: str, shadow_capped: bool) -> tuple[str, int | None]:
    """("identical" | "diverged" | "length", first differing character). A shadow answer cut
    at the router's shadow max_tokens cap that is a prefix of the live one is identical as far
    as it goes; any other difference in length alone is "length"."""
    for i, (a, b) in enumerate(zip(live, shadow, strict=False)):
        if a != b:
            return "diverged", i
    if len(live) == len(shadow) or (shadow_capped and len(shadow) < len(live)):
        return "identical", None
    return "length", None


class _Relay:
    """One live stream: the engine's SSE frames passed on as they arrive, each complete frame
    read for the first text (TTFT), an error, the finish reasons and the usage (and the text
    collected when a shadow answer will be compared with it, or the answer is `checked` for
    broken signs: kvfleet.router.answers). `close` releases what the request
    holds (the upstream connection, the replica's in-flight count, the quota reservation) and
    counts its outcome exactly once, whether the stream ended, failed, or never started."""

    def __init__(self, router: Router, resp: aiohttp.ClientResponse, endpoint: EndpointLoad,
                 labels: Labels, reservation: Reservation, started: float,
                 live_text: asyncio.Future[str | None] | None,
                 checked: _Check | None = None) -> None:
        self.router, self.resp, self.endpoint, self.labels = router, resp, endpoint, labels
        self.reservation, self.started, self.live_text = reservation, started, live_text
        self.first_byte = False
        self.first_text: float | None = None
        self.usage: tuple[int, int] | None = None  # (prompt, completion), the engine's count
        self.error_code: str | None = None
        self.finish_reasons: list[str] = []
        self.lost = False  # the replica was lost mid-stream
        self.ended = False  # the engine's stream ended (else the client left first)
        self.pieces: list[str] | None = [] if live_text is not None or checked else None
        self.chars = 0  # collected; past answers.MAX_CHARS the frames go unparsed
        self.checked = checked
        self.closed = False

    async def frames(self) -> AsyncIterator[bytes]:
        buffer = b""
        try:
            async for chunk in self.resp.content.iter_any():
                self.first_byte = True
                buffer += chunk
                if b"\n\n" in buffer:
                    frames, _, buffer = buffer.rpartition(b"\n\n")
                    self._read(frames)
                yield chunk
            self._read(buffer)  # a last frame without its blank line
            self.ended = True
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.lost = True
            error = {"error": {"message": f"the replica failed mid-stream ({type(exc).__name__})"
                               "; the answer is incomplete", "type": "server_error",
                               "code": "upstream_failed"}}
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            self.close()

    def _read(self, frames: bytes) -> None:
        """TTFT is the time to the first frame with text: a role-only delta, an empty frame or
        an error frame is no token the client can show."""
        collecting = self.pieces is not None and self.chars < answers.MAX_CHARS
        want_text = self.first_text is None or collecting
        reading = read_frames(frames, want_text=want_text)
        if reading.texts and self.first_text is None:
            self.first_text = time.monotonic()
            self.router.metrics.observe_ttft(self.labels, self.reservation.input_tokens,
                                             self.first_text - self.started)
        if collecting and self.pieces is not None:
            self.pieces += reading.texts
            self.chars += sum(map(len, reading.texts))
        self.error_code = self.error_code or reading.error_code
        self.finish_reasons += reading.finish_reasons
        self.usage = reading.usage or self.usage

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        outcome = stream_outcome(self.resp.status, first_byte=self.first_byte,
                                 ended=self.ended, lost=self.lost, error_code=self.error_code,
                                 finish_reasons=self.finish_reasons)
        completed = outcome is Outcome.COMPLETED and self.pieces is not None
        text = "".join(self.pieces or [])[:answers.MAX_CHARS] if completed else None
        _resolve(self.live_text, text)
        if self.checked is not None and (completed or outcome is Outcome.CLIENT_GONE):
            # (A client that left mid-way, a user stopping a loop, leaves what it had.)
            self.router.metrics.check_answer(
                self.labels, "".join(self.pieces or [])[:answers.MAX_CHARS],
                self.finish_reasons, self.checked.max_tokens, partial=not completed)
        self.resp.release()
        self.endpoint.in_flight -= 1
        now = time.monotonic()
        router = self.router
        prompt, generated = self.usage or (None, 0)
        router.settle(self.reservation, generated, now, prompt)
        if self.usage is not None:
            router._count_tokens(self.labels, *self.usage)
        router._record(self.labels, outcome, now - self.started, self.reservation.input_tokens)
        if self.first_text is not None and generated > 1:
            router.metrics.observe_tpot(self.labels, self.reservation.input_tokens,
                                        (now - self.first_text) / (generated - 1))


class _RelayResponse(Response):
    """A relayed stream, sent on the ASGI connection by plain asyncio: Starlette's
    StreamingResponse watches for the disconnect through an anyio task group whose cancel
    formats task reprs (with Starlette's middleware, a fifth of the router's busy samples:
    bench/README, router overhead). `on_close` runs however the answer ends: a client gone
    before the first chunk means the generator never starts, and a generator that never started
    runs no `finally`."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None],
                 headers: dict[str, str], send_seconds: float) -> None:
        self.content, self._on_close, self.send_seconds = content, on_close, send_seconds
        self.status_code, self.media_type, self.background = 200, "text/event-stream", None
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def timed(message: dict[str, Any]) -> None:
            # A client that stops reading blocks the send once the socket's buffers are full:
            # it held the engine's stream, the replica's in-flight count and the tenant's
            # slot for as long as it liked. It is dropped as if it had hung up.
            try:
                async with asyncio.timeout(self.send_seconds):
                    await send(message)
            except TimeoutError:
                log.debug("dropped a client that took no data for %.0f s", self.send_seconds)
                raise ClientGone from None

        async def stream() -> None:
            await timed({"type": "http.response.start", "status": 200,
                         "headers": self.raw_headers})
            async for chunk in self.content:
                await timed({"type": "http.response.body", "body": chunk, "more_body": True})
            await timed({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await _unless_gone(receive, stream())
        except ClientGone:
            pass  # (the generator was cancelled: its relay closes below)
        finally:
            self._on_close()


async def _read_whole(resp: aiohttp.ClientResponse, endpoint: EndpointLoad
                      ) -> tuple[int, bytes, str | None]:
    """Status, body and content type of an upstream answer, which then lets go of the replica."""
    try:
        return resp.status, await resp.read(), resp.headers.get("content-type")
    except (TimeoutError, aiohttp.ClientError) as exc:
        log.debug("replica %s failed while answering: %s", endpoint.address,
                  type(exc).__name__)
        # (The client is told what happened, never where: pod addresses stay in the log.)
        raise UpstreamFailed(f"a replica failed while answering ({type(exc).__name__}); "
                             "retry") from None
    finally:
        resp.release()
        endpoint.in_flight -= 1


class ClientGone(Exception):
    """The client hung up before its whole answer came."""


async def _unless_gone(receive: Callable[[], Awaitable[Any]] | None, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (and `work` cancelled) when the client whose ASGI
    `receive` this is hangs up first. The body is read by then, so the next ASGI message is
    the disconnect."""
    task = asyncio.ensure_future(work)
    if receive is None:
        return await task

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if gone.done() and not gone.cancelled():
            gone.exception()  # (a receive that failed: the client is gone all the same)
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its replica let go
    if task.cancelled():
        raise ClientGone
    return task.result()


def _resolve(future: asyncio.Future[str | None] | None, value: str | None) -> None:
    if future is not None and not future.done():
        future.set_result(value)


async def _read_body(request: Request) -> bytes:
    """The request's body, refused (413) as soon as it is known to be over MAX_BODY_BYTES: by
    its Content-Length before reading, or while reading a chunked one. A client cannot make
    the router buffer more than the limit."""
    too_large = BodyTooLarge(f"the body is over {MAX_BODY_BYTES} bytes; send a shorter prompt")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    try:
        # (A body announced and never sent held its tenant's intake budget for ever, and
        # four keys' worth of them refused every tenant.)
        async with asyncio.timeout(BODY_SECONDS):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeout(f"the body did not arrive within {BODY_SECONDS:.0f} s") from None
    return b"".join(chunks)


def _parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; BadRequest for anything else, and before parsing for a body
    whose structure would take far more memory than its bytes."""
    if raw.count(b"{") + raw.count(b"[") > MAX_OBJECTS:
        # (4 MiB of `{},` parse into 1.4 million dicts, 90 MB, and of `[],` as much: ten such
        # bodies took the router to 1 GB. Brackets inside strings count too: the bound is far
        # above what any conversation holds, code included.)
        raise BadRequest(f"the body holds more than {MAX_OBJECTS} JSON objects and arrays")
    try:
        body = json.loads(raw)  # (4 MiB in 2 ms: the tokenizing is what takes time)
    except ValueError:
        raise BadRequest("the body is not JSON") from None
    except RecursionError:  # `[[[[...` thousands deep: the parser's stack, not ours
        raise BadRequest("the body nests JSON too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _declared_size(request: Request) -> int:
    """The bytes a request's body will take: its Content-Length, else the most it may."""
    declared = request.headers.get("content-length")
    return min(int(declared), MAX_BODY_BYTES) if declared is not None and \
        declared.isdigit() else MAX_BODY_BYTES


def _billed_stream(body: dict[str, Any]) -> dict[str, Any]:
    """A streamed request asks the engine for the running usage on every chunk (vLLM's
    `continuous_usage_stats`): a client that hangs up mid-stream is billed the output tokens
    relayed until then, not 0 (usage otherwise comes only with the last chunk)."""
    options = body.get("stream_options")
    if not body.get("stream") or not (options is None or isinstance(options, dict)):
        return body  # (a malformed stream_options is the engine's 400 to give)
    return {**body, "stream_options": {**(options or {}), "continuous_usage_stats": True}}


def _shadow_payload(body: dict[str, Any], max_tokens: int) -> bytes:
    """The shadow copy of a request: not streamed, its max_tokens capped."""
    shadow_body = {**body, "stream": False}
    shadow_body.pop("stream_options", None)
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(shadow_body.get(key), int):
            shadow_body[key] = min(shadow_body[key], max_tokens)
    shadow_body.setdefault("max_tokens", max_tokens)
    return json.dumps(shadow_body).encode()


class Router:
    def __init__(self, state: RouterState, options: RouterOptions | None = None) -> None:
        self.options = options or RouterOptions()
        self.metrics = RouterMetrics()
        self.ledger = QuotaLedger()
        self.shared: SharedLedger | None = None
        self.intake = Intake()
        if self.options.redis_url:
            self.shared = connect(self.options.redis_url, self.options.redis_prefix,
                                  self.ledger, self.metrics.shared_ledger_up.set,
                                  self.options.redis_timeout)
            self.metrics.shared_ledger_up.set(1)
        self.state = RouterState()
        self._session: aiohttp.ClientSession | None = None
        self._shadow_in_flight = 0
        self._probes_in_flight = 0
        # Quiet pools' synthetic requests (kvfleet.router.traffic.Synthetic): live arrivals
        # since the last tick, the credit towards the next request, those in flight.
        self._arrivals: collections.Counter[tuple[str, str]] = collections.Counter()
        self._credit: dict[tuple[str, str], float] = {}
        self._synthetic_in_flight: collections.Counter[tuple[str, str]] = collections.Counter()
        self._synthetic_turn = 0
        # Answers each pool may still have checked this second (answers.CHECKS_PER_SECOND).
        self._check_budget: dict[tuple[str, str], tuple[float, float]] = {}
        self._diverged: set[tuple[str, str, str]] = set()  # first divergence already shown
        self._turn = 0
        self.tokens = TokenCounter(lambda: self.session)
        self._tasks: set[asyncio.Task[None]] = set()
        o = self.options
        self.holds = Holds(o.hold_per_pool, o.hold_per_tenant, o.hold_seconds,
                           lambda pool, n: self.metrics.held.labels(*pool).set(n))
        self.update(state)

    # ---- state

    def update(self, state: RouterState) -> None:
        carry_loads(state, self.state, time.monotonic())
        self.state = state
        self.ledger.set_quotas(state.quotas, time.monotonic(),
                               state.default_quota or self.options.default_quota)
        self.metrics.slos = {(p.namespace, p.name): p.slos for p in state.pools.values()}
        self.metrics.declare(state.routed_series())
        self.metrics.declare_probes(state.probed_series())
        self.holds.notify()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.options.connect_timeout)
            self._session = aiohttp.ClientSession(
                timeout=timeout, auto_decompress=False,
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30))
        return self._session

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.tokens.close()
        if self.shared is not None:
            await self.shared.drain()
            await self.shared.client.aclose()
        if self._session is not None:
            await self._session.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- quota

    async def admit(self, tenant: str, prompt_tokens: int, max_tokens: int) -> Reservation:
        """The request's allowance, from the shared ledger when there is one."""
        if self.shared is not None:
            return await self.shared.admit(tenant, prompt_tokens, max_tokens, time.monotonic())
        return self.ledger.admit(tenant, prompt_tokens, max_tokens, time.monotonic())

    def settle(self, reservation: Reservation, generated: int, now: float,
               prompt: int | None) -> None:
        (self.shared or self.ledger).settle(reservation, generated, now, prompt)

    def _may_check(self, pool: tuple[str, str]) -> bool:
        """Whether this answer of `pool` is checked: at most answers.CHECKS_PER_SECOND a second
        (reading every frame of every answer would cost a busy pool's router its CPU)."""
        now = time.monotonic()
        level, at = self._check_budget.get(pool, (answers.CHECKS_PER_SECOND, now))
        level = min(answers.CHECKS_PER_SECOND, level + (now - at) * answers.CHECKS_PER_SECOND)
        allowed = level >= 1
        self._check_budget[pool] = (level - 1 if allowed else level, now)
        return allowed

    # ---- a quiet pool's synthetic requests

    async def synthesize_forever(self, tick: float = SYNTHETIC_TICK) -> None:
        """While a pool's step is judged and it has probe prompts, keep its request rate at
        least at their rate: live requests count first, synthetic ones make up the rest (no
        credit saved up beyond one second's worth, so a busy spell or a pause buys no burst)."""
        while True:
            await asyncio.sleep(tick)
            self.synthesize(tick)

    def synthesize(self, seconds: float) -> None:
        """One tick: each router keeps its share of the rate (the rate over the Ready
        routers, as quota shares are), so the pool gets the policy's rate in all."""
        arrivals, self._arrivals = self._arrivals, collections.Counter()
        # (A cluster-wide router knows a pool under two names: `name` and `ns/name`.)
        pools = {id(pool): pool for pool in self.state.pools.values()}
        for pool in pools.values():
            key = (pool.namespace, pool.name)
            synthetic = pool.table.synthetic if pool.table is not None else None
            if synthetic is None:
                self._credit.pop(key, None)
                continue
            rate = synthetic.rate / self.ledger.replicas
            credit = self._credit.get(key, 0.0) + rate * seconds - arrivals[key]
            credit = max(0.0, min(credit, max(1.0, rate)))
            while credit >= 1 and self._synthetic_in_flight[key] < SYNTHETIC_MAX_IN_FLIGHT:
                credit -= 1
                prompt = synthetic.prompts[self._synthetic_turn % len(synthetic.prompts)]
                self._synthetic_turn += 1
                self._synthetic_in_flight[key] += 1
                self._spawn(self._synthetic(pool, prompt, synthetic.max_tokens))
            self._credit[key] = credit

    async def _synthetic(self, pool: PoolRoute, prompt: str, max_tokens: int) -> None:
        """One request of the router's own, routed as a live one is (canary by weight, shadow
        copy, probe) and counted as traffic "synthetic"; billed to no tenant."""
        key = (pool.namespace, pool.name)
        try:
            table = pool.table
            if table is None:
                return
            sample_key = uuid.uuid4().hex
            plan = table.route(pool.name, SYNTHETIC_TENANT, sample_key, sample_key)
            if not pool.ready(plan.live):
                return  # (no Ready replica: nothing to measure, and no failure of its own)
            body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}],
                                    "max_tokens": max_tokens, "stream": True,
                                    "priority": PRIORITY[PriorityClass.STANDARD]}
            headers = _engine_headers(pool, SYNTHETIC_TENANT,
                                      {"x-request-id": f"syn-{sample_key[:16]}"})
            path = "/v1/chat/completions"
            prompt_tokens = await self.tokens.count(plan.live, texts_of(body),
                                                    pool.ready(plan.live))
            # (Admitted by no ledger: settled from the start, so settling changes nothing.)
            reservation = Reservation(SYNTHETIC_TENANT, prompt_tokens, max_tokens, settled=True)
            if plan.shadow is not None:
                self._spawn(self._shadow(pool, plan.shadow, path, body, headers, prompt,
                                         SYNTHETIC_TENANT, prompt_tokens, None))
            if plan.probe is not None:
                self._spawn(self._probe(pool, plan.probe, path, body, prompt, SYNTHETIC_TENANT))
            response = await self._live(
                pool, plan.live, path, json.dumps(_billed_stream(body)).encode(), headers,
                prompt, SYNTHETIC_TENANT, reservation, True, fallback=table.stable,
                traffic="synthetic")  # (not checked: its cap is the policy's, not a client's)
            if isinstance(response, _RelayResponse):
                await response({"type": "http"}, None, _discard)
        except Exception as exc:  # (one failed synthetic request must not end the loop)
            log.debug("pool %s/%s: a synthetic request failed: %r", *key, exc)
        finally:
            self._synthetic_in_flight[key] -= 1

    # ---- endpoint load

    async def scrape_forever(self) -> None:
        while True:
            endpoints = self.state.all_endpoints()
            await asyncio.gather(*(self._scrape(e) for e in endpoints))
            await asyncio.sleep(self.options.scrape_interval)

    async def _scrape(self, endpoint: EndpointLoad) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.options.stale_after)
            async with self.session.get(endpoint.url("/metrics"), timeout=timeout,
                                        **endpoint.connection()) as resp:
                text = await resp.text()
            if resp.status != 200:  # an error page says nothing of the load: not idle
                raise ValueError(f"HTTP {resp.status}")
            values = {}
            for line in text.splitlines():
                if line.startswith(LOAD_GAUGES):
                    name, _, value = line.rpartition(" ")
                    values[name.split("{", 1)[0]] = float(value)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            endpoint.failures += 1
            return
        endpoint.waiting, endpoint.running, endpoint.kv_usage = (
            values.get(name, 0.0) for name in LOAD_GAUGES)
        endpoint.scraped_at = time.monotonic()
        endpoint.failures = 0

    # ---- requests

    def _pool(self, tenant: str, model: object) -> PoolRoute:
        if not isinstance(model, str) or not model:
            raise BadRequest("model: name the ServingPool to use (GET /v1/models lists them)",
                             "model")
        return access.resolve(self.state, tenant, self.ledger.quota(tenant), model)

    def _tenant(self, authorization: str | None) -> str:
        """The key's tenant, if it may send anything: fail closed on a TenantQuota that cannot
        be read or is missing (unless the router has a default quota)."""
        tenant = self.state.keys.tenant_for(authorization)
        if (why := self.state.refused.get(tenant)) is not None:
            raise TenantRefused(f"tenant {tenant!r} is refused: {why}")
        if self.ledger.quota(tenant) is None:
            raise no_quota(tenant)
        return tenant

    def models(self, authorization: str | None) -> dict[str, Any]:
        tenant = self._tenant(authorization)
        names = access.visible(self.state, tenant, self.ledger.quota(tenant))
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "kvfleet"}
                                           for n in names]}

    async def handle(self, request: Request) -> Response:
        path = request.scope["path"]
        namespace, pool_name = "-", "-"
        try:
            tenant = self._tenant(request.headers.get("authorization"))
            (self.shared or self.ledger).precheck(tenant, time.monotonic())
            # The body is read, parsed and tokenized against the tenant's own budget of bytes
            # in flight: one key's bodies cannot take the router's memory (`Intake`).
            with self.intake.hold(tenant, _declared_size(request)):
                body = _parse_body(await _read_body(request))
                pool = self._pool(tenant, body.get("model"))
                namespace, pool_name = pool.namespace, pool.name
                if pool.table is None:
                    raise NoEndpoint(f"pool {pool.name!r} serves no revision yet")
                max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or \
                    DEFAULT_MAX_TOKENS[path]
                if not isinstance(max_tokens, int) or max_tokens < 1:
                    raise BadRequest("max_tokens: must be a positive integer", "max_tokens")
                if not isinstance(body.get("stream", False), bool):
                    # ("false" is truthy here and false to a lenient parser: one answer shape
                    # for the router, another for the engine, and an answer billed as neither.)
                    raise BadRequest("stream: must be true or false (a JSON boolean)", "stream")
                request_id = request.headers.get("x-request-id") or f"rtr-{uuid.uuid4().hex[:16]}"
                sample_key = uuid.uuid4().hex
                session = session_key(body, request.headers.get(SESSION_HEADER), sample_key)
                plan = pool.table.route(pool.name, tenant, session, sample_key)
                stable = pool.table.stable
                canary = pool.table.canary
                prompt = texts_of(body)
                text = prompt.text
                prompt_tokens = await self.tokens.count(plan.live, prompt, pool.ready(plan.live))
                reservation = await self.admit(tenant, prompt_tokens, max_tokens)
                self._arrivals[(pool.namespace, pool.name)] += 1
                # Both revisions' answers are checked while a canary has live traffic (the
                # AnswerChecks gate compares their shares of broken signs); a refused request
                # takes nothing of the check budget.
                capped = "max_tokens" in body or "max_completion_tokens" in body
                checked = _Check(max_tokens if capped else None) if (
                    canary is not None and answers.checkable(body)
                    and self._may_check((pool.namespace, pool.name))) else None
            self.metrics.last_request.labels(namespace, pool_name).set_to_current_time()
            if pool.wakes and not pool.ready(plan.live):
                pool, plan = await self._woken(request, pool, plan, tenant, reservation)
        except RouterError as exc:
            reason = exc.limit if isinstance(exc, QuotaExceeded) else exc.code
            if isinstance(exc, Unauthorized):
                reason = "unauthorized"
            self.metrics.rejections.labels(namespace, pool_name, reason).inc()
            return JSONResponse(exc.body(), exc.status, headers=exc.headers())
        except ClientGone:
            return Response(status_code=499)  # hung up while held (no one reads it)
        quota = self.ledger.quota(tenant)
        body.pop("model", None)  # the engine serves one model under its own name
        # The quota's class is the most urgent a tenant gets; a client may ask for less.
        floor = PRIORITY[quota.priority_class if quota is not None else PriorityClass.STANDARD]
        asked = body.get("priority")
        body["priority"] = max(floor, asked) if isinstance(asked, int) else floor
        headers = _engine_headers(pool, tenant, {"x-request-id": request_id})
        if quota is not None and quota.shared_prefix_cache:
            headers[SHARED_PREFIX_HEADER] = "1"
        payload = json.dumps(_billed_stream(body)).encode()
        live_text: asyncio.Future[str | None] | None = None
        if plan.shadow is not None:
            # A greedy request's two answers should be the same text: compare them.
            if body.get("temperature") == 0:
                live_text = asyncio.get_running_loop().create_future()
            self._spawn(self._shadow(pool, plan.shadow, path, body, headers, text, tenant,
                                     prompt_tokens, live_text))
        if plan.probe is not None:
            self._spawn(self._probe(pool, plan.probe, path, body, text, tenant))
        try:
            return await self._live(pool, plan.live, path, payload, headers, text, tenant,
                                    reservation, bool(body.get("stream")), live_text,
                                    fallback=stable, client=request, checked=checked)
        except BaseException:
            _resolve(live_text, None)  # the shadow task must not wait for a live answer
            raise

    async def _woken(self, request: Request, pool: PoolRoute, plan: RoutePlan, tenant: str,
                     reservation: Reservation) -> tuple[PoolRoute, RoutePlan]:
        """Hold a request for a pool with no Ready replica of its revision until one is (the
        pool is at zero, or waking); the pool and plan as the router then knows them. A
        request that is not held to the end (hold full, no replica in time, its client gone)
        gives its reservation back: no engine saw it."""
        key = (pool.namespace, pool.name)

        def current() -> PoolRoute | None:
            # (the state is replaced whole on every change: look the pool up again)
            return next((p for p in self.state.pools.values()
                         if (p.namespace, p.name) == key), None)

        def ready() -> bool:
            now = current()
            return now is not None and now.table is not None and bool(
                now.ready(plan.live) or now.ready(now.table.stable or ""))

        try:
            await _unless_gone(request.receive, self.holds.wait(
                key, tenant, ready, self.holds.wait_for(request.headers.get(WAIT_HEADER))))
        except (RouterError, ClientGone):
            self.settle(reservation, 0, time.monotonic(), 0)
            raise
        woken = current()
        assert woken is not None and woken.table is not None
        if not woken.ready(plan.live) and woken.table.stable is not None:
            plan = replace(plan, live=woken.table.stable)  # the table moved on meanwhile
        return woken, plan

    async def _connect(self, pool: PoolRoute, revision: str, path: str, payload: bytes,
                       headers: dict[str, str], text: str, tenant: str, streamed: bool = False
                       ) -> tuple[aiohttp.ClientResponse, EndpointLoad]:
        """An upstream response with status < 500 (or the last failure), trying up to
        max_attempts replicas."""
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.options.connect_timeout,
            sock_read=self.options.stream_idle_timeout if streamed else
            self.options.answer_timeout)
        tried: set[str] = set()
        last: str = "no Ready replica"
        for _ in range(self.options.max_attempts):
            if self.options.pick_policy == "round-robin":
                ready = [e for e in pool.ready(revision) if e.address not in tried]
                self._turn += 1
                endpoint = ready[self._turn % len(ready)] if ready else None
            else:
                endpoint = pick(pool.ready(revision), tenant, text, time.monotonic(),
                                stale_after=self.options.stale_after, exclude=frozenset(tried))
            if endpoint is None:
                break
            tried.add(endpoint.address)
            endpoint.in_flight += 1
            try:
                resp = await self._post(pool, endpoint, path, payload, headers, timeout)
            except (TimeoutError, aiohttp.ClientError) as exc:
                endpoint.in_flight -= 1
                endpoint.failures += 1
                last = type(exc).__name__
                log.debug("replica %s of %s/%s: %s", endpoint.address, pool.namespace,
                          pool.name, last)
                continue
            except BaseException:  # cancelled (a shadow or probe out of time): not in flight
                endpoint.in_flight -= 1
                raise
            if resp.status >= 500 or resp.status == 401:
                # 401: the engine refused this router's token (a Secret re-minted and not yet
                # seen by one side): the replica's fault, never the client's key.
                last = f"HTTP {resp.status}" + (
                    " (the engine refused the router's token)" if resp.status == 401 else "")
                log.debug("replica %s of %s/%s: %s", endpoint.address, pool.namespace,
                          pool.name, last)
                if resp.status == 401:
                    endpoint.refused_at = time.monotonic()
                resp.release()
                endpoint.in_flight -= 1
                continue
            return resp, endpoint
        raise NoEndpoint(f"pool {pool.name!r} revision {short_revision(revision)}: no replica "
                         f"answered ({last}); retry shortly")

    async def _post(self, pool: PoolRoute, endpoint: EndpointLoad, path: str, payload: bytes,
                    headers: dict[str, str], timeout: aiohttp.ClientTimeout
                    ) -> aiohttp.ClientResponse:
        """One attempt on `endpoint`. An engine that refuses the pool's token (401) while the
        token it replaced is in its grace period is asked again with that one: its Secret
        file has not been rewritten yet, and a rotation must fail no request."""
        url, tls = endpoint.url(path), endpoint.connection()
        resp = await self.session.post(url, data=payload, headers=headers, timeout=timeout,
                                       **tls)
        previous = pool.previous(time.monotonic())
        if resp.status != 401 or previous is None or \
                headers.get(ROUTER_TOKEN_HEADER) != pool.router_token:
            return resp
        resp.release()
        return await self.session.post(url, data=payload, timeout=timeout,
                                       headers={**headers, ROUTER_TOKEN_HEADER: previous}, **tls)

    async def _request(self, pool: PoolRoute, revision: str, path: str, payload: bytes,
                       headers: dict[str, str], text: str, tenant: str
                       ) -> tuple[int, bytes, str | None]:
        """A whole (non-streamed) answer: status, body and content type."""
        resp, endpoint = await self._connect(pool, revision, path, payload, headers, text,
                                             tenant)
        return await _read_whole(resp, endpoint)

    async def _live(self, pool: PoolRoute, revision: str, path: str, payload: bytes,
                    headers: dict[str, str], text: str, tenant: str, reservation: Reservation,
                    stream: bool, live_text: asyncio.Future[str | None] | None = None,
                    fallback: str | None = None, client: Request | None = None,
                    checked: _Check | None = None, traffic: str = "live") -> Response:
        """The client's answer from `revision`. If none of its replicas answers before the
        first byte (a canary's pods going away as a rollback drains them, while this router
        still routes to it), `fallback` (stable) answers instead: the failure is the
        revision's, counted against it, and not the client's. A `client` that hangs up
        while waiting for a whole answer cancels it upstream (the engine stops generating)
        and is charged its whole output reservation: the engine worked, and how far it got
        is not known (a streamed answer is billed by what was relayed). A `checked` answer
        (the pool is in a canary step) is checked for broken signs once complete."""
        labels = (pool.namespace, pool.name, short_revision(revision), traffic)
        started = time.monotonic()
        try:
            if not stream:
                receive = None if client is None else client.receive
                status, data, content_type = await _unless_gone(receive, self._request(
                    pool, revision, path, payload, headers, text, tenant))
            else:
                resp, endpoint = await self._connect(pool, revision, path, payload, headers,
                                                     text, tenant, streamed=True)
                status = resp.status
                if status != 200 or resp.content_type != "text/event-stream":
                    # A refusal, or a whole answer where a stream was asked for: a JSON body,
                    # billed by its usage (reading it for frames would bill 0 tokens).
                    status, data, content_type = await _read_whole(resp, endpoint)
                    stream = False
        except ClientGone:
            now = time.monotonic()
            self._record(labels, Outcome.CLIENT_GONE, now - started, reservation.input_tokens)
            self.settle(reservation, reservation.output_reserved, now, None)
            _resolve(live_text, None)
            return Response(status_code=499)  # (no one reads it)
        except RouterError as exc:
            now = time.monotonic()
            self._record(labels, classify(exc.status, exc.code), now - started,
                         reservation.input_tokens)
            if isinstance(exc, NoEndpoint) and fallback not in (None, revision):
                assert fallback is not None
                return await self._live(pool, fallback, path, payload, headers, text, tenant,
                                        reservation, stream, live_text, client=client,
                                        checked=checked, traffic=traffic)
            self.settle(reservation, 0, now, 0)  # never answered
            _resolve(live_text, None)
            return JSONResponse(exc.body(), exc.status, headers=exc.headers())
        out_headers = {REVISION_HEADER: short_revision(revision)}
        if not stream or status != 200:
            self._settle_whole(labels, read_answer(status, data), reservation, started,
                               live_text, checked)
            return Response(data, status, headers=out_headers,
                            media_type=content_type or "application/json")
        relay = _Relay(self, resp, endpoint, labels, reservation, started, live_text, checked)
        return _RelayResponse(relay.frames(), relay.close,
                              {**out_headers, "cache-control": "no-cache"},
                              self.options.send_timeout)

    def _settle_whole(self, labels: Labels, answer: Answer, reservation: Reservation,
                      started: float, live_text: asyncio.Future[str | None] | None,
                      checked: _Check | None = None) -> None:
        """A whole answer (or refusal) relayed: its text to the shadow comparison (and the
        answer checks), its tokens to the quota and the metrics, its outcome counted."""
        now = time.monotonic()
        _resolve(live_text, answer.text)  # None unless completed: nothing to compare
        if checked is not None and answer.text is not None:
            self.metrics.check_answer(labels, answer.text[:answers.MAX_CHARS],
                                      answer.finish_reasons, checked.max_tokens)
        prompt, generated = answer.usage or (None, 0)
        if answer.usage is not None:
            self._count_tokens(labels, *answer.usage)
        self.settle(reservation, generated, now, prompt)
        self._record(labels, answer.outcome, now - started, reservation.input_tokens)

    def _record(self, labels: Labels, outcome: Outcome, seconds: float,
                prompt_tokens: int) -> None:
        self.metrics.count(labels, prompt_tokens, outcome)
        if outcome in TIMED:
            self.metrics.observe_e2e(labels, prompt_tokens, seconds)

    def _count_tokens(self, labels: Labels, prompt: int, generated: int) -> None:
        self.metrics.tokens.labels(*labels, "prompt").inc(prompt)
        self.metrics.tokens.labels(*labels, "generation").inc(generated)

    async def _shadow(self, pool: PoolRoute, revision: str, path: str, body: dict[str, Any],
                      headers: dict[str, str], text: str, tenant: str, prompt_tokens: int,
                      live_text: asyncio.Future[str | None] | None) -> None:
        """A discarded copy on the shadow revision (non-streaming, capped), compared with the
        live answer of the same request when it is greedy (temperature 0)."""
        labels = (pool.namespace, pool.name, short_revision(revision))
        if self._shadow_in_flight >= self.options.shadow_max_in_flight:
            self.metrics.shadow.labels(*labels, "shed").inc()
            return
        self._shadow_in_flight += 1
        started = time.monotonic()
        try:
            code, data, _ = await asyncio.wait_for(self._request(
                pool, revision, path, _shadow_payload(body, self.options.shadow_max_tokens),
                {**headers, "x-kvfleet-traffic": "shadow"}, text, tenant),
                self.options.shadow_timeout)
            answer = read_answer(code, data)
        except RouterError as exc:
            answer = Answer(classify(exc.status, exc.code))
        except TimeoutError:  # a stalled shadow revision must not keep its slot
            answer = Answer(Outcome.UPSTREAM_ERROR)
        finally:
            self._shadow_in_flight -= 1
        shadow_labels = (*labels, "shadow")
        self._record(shadow_labels, answer.outcome, time.monotonic() - started, prompt_tokens)
        if answer.usage is not None:
            self._count_tokens(shadow_labels, *answer.usage)
        compared = await self._compare_shadow(labels, answer, live_text)
        self.metrics.shadow.labels(*labels, compared).inc()

    async def _compare_shadow(self, labels: tuple[str, str, str], answer: Answer,
                              live_text: asyncio.Future[str | None] | None) -> str:
        """The shadow comparison's outcome: "error" when the shadow did not complete,
        "answered" when there is no live text to compare with, else `compare`'s."""
        if answer.outcome is not Outcome.COMPLETED:
            return "error"
        if live_text is None or answer.text is None:
            return "answered"
        try:
            live = await asyncio.wait_for(asyncio.shield(live_text), timeout=600)
        except TimeoutError:
            live = None
        if live is None:
            return "answered"
        compared, diverged_at = compare(live, answer.text, "length" in answer.finish_reasons)
        if diverged_at is not None:
            self.metrics.divergence.labels(*labels).observe(diverged_at)
        return compared


    async def _probe(self, pool: PoolRoute, revision: str, path: str, body: dict[str, Any],
                     text: str, tenant: str) -> None:
        """This request as a greedy probe to `revision` and to stable, their answers compared
        token by token (the OutputAgreement gate). Never billed; shed while
        `probe_max_in_flight` pairs run or either revision has a queue on every replica."""
        stable = pool.table.stable if pool.table is not None else None
        if stable is None or stable == revision:
            return
        labels = (pool.namespace, pool.name, short_revision(revision))
        queued = any(all(e.waiting > 0 for e in pool.ready(r)) for r in (revision, stable))
        if self._probes_in_flight >= self.options.probe_max_in_flight or queued:
            self.metrics.probes.labels(*labels, "shed").inc()
            return
        self._probes_in_flight += 1
        payload = json.dumps(probe_body(body, self.options.probe_max_tokens)).encode()
        headers = _engine_headers(pool, PROBE_TENANT, {"x-kvfleet-traffic": "probe"})
        try:
            answers: list[Any] = await asyncio.wait_for(asyncio.gather(
                *(self._request(pool, r, path, payload, headers, text, PROBE_TENANT)
                  for r in (revision, stable)), return_exceptions=True),
                self.options.probe_timeout)
        except TimeoutError:
            answers = [None, None]
        finally:
            self._probes_in_flight -= 1
        wrong = [(r, who) for r, a in zip((revision, stable), answers, strict=True)
                 if isinstance(a, tuple) and not same_revision(who := answered_by(a[1]), r)]
        if wrong:
            # The pair would compare one revision with itself (or the wrong one): an address
            # that now belongs to another pod, a pod that labels itself what it is not.
            log.error("pool %s/%s: a probe to revision %s was answered by revision %s; not "
                      "compared", pool.namespace, pool.name, short_revision(wrong[0][0]),
                      wrong[0][1])
            self.metrics.probes.labels(*labels, "misrouted").inc()
            return
        canary, baseline = (probe_answer(a[0], a[1]) if isinstance(a, tuple) else None
                            for a in answers)
        if canary is None or baseline is None:
            self.metrics.probes.labels(*labels, "error").inc()
            return
        agreed, compared, in_full = compare_answers(canary, baseline)
        self.metrics.probes.labels(*labels, "compared").inc()
        if in_full:
            self.metrics.probes_agreed.labels(*labels).inc()
        self.metrics.probe_tokens.labels(*labels, "agreed").inc(agreed)
        self.metrics.probe_tokens.labels(*labels, "compared").inc(compared)
        if agreed < compared and labels not in self._diverged:
            self._diverged.add(labels)
            self.metrics.first_divergence.labels(*labels, probe_id(tenant, text)).set(agreed)


COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


def build_app(router: Router, ready: Callable[[], bool] = lambda: True) -> Callable[..., Any]:
    """The router's ASGI app. The two completion routes, every request the router relays,
    go straight to `Router.handle`, past Starlette's middleware and route matching (work a
    relayed request does not need: bench/README, router overhead); the rest through Starlette."""

    async def models(request: Request) -> Response:
        try:
            return JSONResponse(router.models(request.headers.get("authorization")))
        except RouterError as exc:
            return JSONResponse(exc.body(), exc.status, headers=exc.headers())

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readiness(_: Request) -> Response:
        ok = ready() and bool(router.state.pools)
        return JSONResponse({"ready": ok, "pools": len(router.state.pools)},
                            200 if ok else 503)

    async def completions(request: Request) -> Response:
        return await router.handle(request)

    rest = Starlette(routes=[
        # (the front takes their POSTs; here the other methods get Starlette's 405)
        *(Route(path, completions, methods=["POST"]) for path in sorted(COMPLETION_PATHS)),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", readiness, methods=["GET"]),
    ])

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and \
                scope["path"] in COMPLETION_PATHS:
            response = await router.handle(Request(scope, receive))
            await response(scope, receive, send)
        else:
            await rest(scope, receive, send)

    return app


def build_metrics_app(router: Router) -> Callable[..., Any]:
    """`/metrics`, served on a port of its own (`kvfleet router --metrics-port`): the series
    name pools, revisions and a salted prompt id, which are Prometheus's to read, not a
    client's; the clients' port does not answer it."""

    async def metrics(_: Request) -> Response:
        return Response(router.metrics.exposition(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])
