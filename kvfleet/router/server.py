"""The router's HTTP edge: the OpenAI API in front of the pools.

Per request: authenticate the key (401), find the pool named by `model` (404) and check the
tenant may use it (403), take the TenantQuota's allowance (429 with Retry-After; nothing reaches
an engine), pick the revision (traffic table) and the replica (load, then prefix affinity),
forward with the router's proof, the tenant and its priority, and stream the answer back as it
comes. A replica that fails before the first byte went to the client is retried on another; one
that fails mid-stream ends the client's stream with an error event. The quota reservation is
settled with the engine's own token count when the answer ends or the client goes away. A
sampled share of requests is copied to the shadow revision in the background (never charged,
never delaying the live answer, shed first) and compared with the live answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvfleet.api.labels import short_revision
from kvfleet.api.tenantquota import PriorityClass
from kvfleet.router.errors import (
    BadRequest,
    NoEndpoint,
    PoolNotAllowed,
    QuotaExceeded,
    RouterError,
    Unauthorized,
    UnknownPool,
    UpstreamFailed,
)
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.picker import EndpointLoad, pick
from kvfleet.router.quota import QuotaLedger, Reservation
from kvfleet.router.state import PoolRoute, RouterState, carry_loads
from kvfleet.router.tokens import TokenCounter, texts_of

log = logging.getLogger(__name__)

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
# The engine gauges the replica choice reads from each engine's /metrics.
LOAD_GAUGES = ("kvfleet_engine_requests_waiting", "kvfleet_engine_requests_running",
               "kvfleet_engine_kv_cache_usage_ratio")


@dataclass(frozen=True, slots=True)
class RouterOptions:
    max_attempts: int = 3  # replicas tried before the first byte
    shadow_max_in_flight: int = 8
    shadow_max_tokens: int = 256
    scrape_interval: float = 0.2
    stale_after: float = 1.0
    connect_timeout: float = 2.0
    # "affinity" (load, then prefix affinity) or "round-robin" (the baseline it is measured
    # against in bench/router_prefix.py).
    pick_policy: str = "affinity"


def answer_text(answer: dict[str, Any]) -> str:
    """The text of a non-streamed chat or completion answer."""
    choice = answer["choices"][0]
    message = choice.get("message")
    return str(message.get("content") or "") if isinstance(message, dict) else str(
        choice.get("text") or "")


def stream_texts(frames: bytes) -> list[str]:
    """The text pieces of complete SSE frames (chat deltas or completion text)."""
    pieces = []
    for line in frames.split(b"\n"):
        if line.startswith(b"data: {"):
            with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
                choice = json.loads(line[6:])["choices"][0]
                delta = choice.get("delta")
                piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                if piece:
                    pieces.append(str(piece))
    return pieces


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
    """One live stream: the engine's SSE frames passed on as they arrive, usage read from the
    last one (and the text collected when a shadow answer will be compared with it). `close`
    releases what the request holds (the upstream connection, the replica's in-flight count,
    the quota reservation) exactly once, whether the stream ended, failed, or never started."""

    def __init__(self, router: Router, resp: aiohttp.ClientResponse, endpoint: EndpointLoad,
                 labels: tuple[str, str, str], reservation: Reservation, started: float,
                 live_text: asyncio.Future[str | None] | None) -> None:
        self.router, self.resp, self.endpoint, self.labels = router, resp, endpoint, labels
        self.reservation, self.started, self.live_text = reservation, started, live_text
        self.first: float | None = None
        self.generated = 0
        self.prompt: int | None = None
        self.code = "200"
        self.pieces: list[str] | None = [] if live_text is not None else None
        self.closed = False

    async def frames(self) -> AsyncIterator[bytes]:
        metrics, buffer = self.router.metrics, b""
        try:
            async for chunk in self.resp.content.iter_any():
                if self.first is None:
                    self.first = time.monotonic()
                    metrics.ttft.labels(*self.labels).observe(self.first - self.started)
                buffer += chunk
                if b"\n\n" in buffer:
                    frames, _, buffer = buffer.rpartition(b"\n\n")
                    if b'"usage"' in frames and (
                            usage := self.router._usage_of(frames, self.labels)):
                        self.prompt, self.generated = usage
                    if self.pieces is not None:
                        self.pieces += stream_texts(frames)
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.code = "stream_error"
            self.pieces = None
            error = {"error": {"message": f"the replica failed mid-stream ({type(exc).__name__})"
                               "; the answer is incomplete", "type": "server_error",
                               "code": "upstream_failed"}}
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.first is None and self.code == "200":
            self.code = "client_gone"  # before the first byte reached the client
        _resolve(self.live_text, "".join(self.pieces) if self.pieces is not None else None)
        self.resp.release()
        self.endpoint.in_flight -= 1
        now = time.monotonic()
        metrics = self.router.metrics
        self.router.ledger.settle(self.reservation, self.generated, now, self.prompt)
        metrics.requests.labels(*self.labels, self.code).inc()
        metrics.e2e.labels(*self.labels).observe(now - self.started)
        if self.first is not None and self.generated > 1:
            metrics.tpot.labels(*self.labels).observe(
                (now - self.first) / (self.generated - 1))


class _RelayResponse(StreamingResponse):
    """A streamed answer that calls `on_close` however it ends: a client gone before the first
    chunk means the generator never starts, and a generator that never started runs no
    `finally`."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _read_whole(resp: aiohttp.ClientResponse, endpoint: EndpointLoad
                      ) -> tuple[int, bytes, str | None]:
    """Status, body and content type of an upstream answer, which then lets go of the replica."""
    try:
        return resp.status, await resp.read(), resp.headers.get("content-type")
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise UpstreamFailed(f"the replica {endpoint.address} failed while answering "
                             f"({type(exc).__name__}); retry") from None
    finally:
        resp.release()
        endpoint.in_flight -= 1


def _resolve(future: asyncio.Future[str | None] | None, value: str | None) -> None:
    if future is not None and not future.done():
        future.set_result(value)


class Router:
    def __init__(self, state: RouterState, options: RouterOptions | None = None) -> None:
        self.options = options or RouterOptions()
        self.metrics = RouterMetrics()
        self.ledger = QuotaLedger()
        self.state = RouterState()
        self._session: aiohttp.ClientSession | None = None
        self._shadow_in_flight = 0
        self._turn = 0
        self.tokens = TokenCounter(lambda: self.session)
        self._tasks: set[asyncio.Task[None]] = set()
        self.update(state)

    # ---- state

    def update(self, state: RouterState) -> None:
        carry_loads(state, self.state)
        self.state = state
        self.ledger.set_quotas(state.quotas, time.monotonic())

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
        if self._session is not None:
            await self._session.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- endpoint load

    async def scrape_forever(self) -> None:
        while True:
            endpoints = self.state.all_endpoints()
            await asyncio.gather(*(self._scrape(e) for e in endpoints))
            await asyncio.sleep(self.options.scrape_interval)

    async def _scrape(self, endpoint: EndpointLoad) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.options.stale_after)
            async with self.session.get(f"http://{endpoint.address}/metrics",
                                        timeout=timeout) as resp:
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError):
            endpoint.failures += 1
            return
        values = {}
        for line in text.splitlines():
            if line.startswith(LOAD_GAUGES):
                name, _, value = line.rpartition(" ")
                values[name.split("{", 1)[0]] = float(value)
        endpoint.waiting, endpoint.running, endpoint.kv_usage = (
            values.get(name, 0.0) for name in LOAD_GAUGES)
        endpoint.scraped_at = time.monotonic()
        endpoint.failures = 0

    # ---- requests

    def _pool(self, tenant: str, model: object) -> PoolRoute:
        if not isinstance(model, str) or not model:
            raise BadRequest("model: name the ServingPool to use (GET /v1/models lists them)",
                             "model")
        pool = self.state.pools.get(model)
        if pool is None:
            raise UnknownPool(f"model {model!r} is no ServingPool this router serves; "
                              "GET /v1/models lists them", "model")
        quota = self.ledger.quota(tenant)
        if quota is not None and quota.allowed_pools and model not in quota.allowed_pools:
            raise PoolNotAllowed(f"tenant {tenant!r} may not use pool {model!r}: its "
                                 "TenantQuota's allowedPools does not list it", "model")
        return pool

    def models(self, authorization: str | None) -> dict[str, Any]:
        tenant = self.state.keys.tenant_for(authorization)
        quota = self.ledger.quota(tenant)
        names = [n for n in self.state.pools
                 if quota is None or not quota.allowed_pools or n in quota.allowed_pools]
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "kvfleet"}
                                           for n in sorted(names)]}

    async def handle(self, request: Request) -> Response:
        path = request.url.path
        pool_name = "-"
        try:
            tenant = self.state.keys.tenant_for(request.headers.get("authorization"))
            raw = await request.body()
            if len(raw) > MAX_BODY_BYTES:
                raise BadRequest(f"the body is over {MAX_BODY_BYTES} bytes")
            try:
                body = json.loads(raw)
            except ValueError:
                raise BadRequest("the body is not JSON") from None
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            pool = self._pool(tenant, body.get("model"))
            pool_name = pool.name
            if pool.table is None:
                raise NoEndpoint(f"pool {pool.name!r} serves no revision yet")
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or \
                DEFAULT_MAX_TOKENS[path]
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise BadRequest("max_tokens: must be a positive integer", "max_tokens")
            request_id = request.headers.get("x-request-id") or f"rtr-{uuid.uuid4().hex[:16]}"
            session = str(body.get("user") or request.headers.get(SESSION_HEADER) or
                          request_id)
            plan = pool.table.route(pool.name, tenant, session, request_id)
            texts, messages = texts_of(body)
            text = "\n".join(texts)
            prompt_tokens = self.tokens.count(
                plan.live, texts, messages, [e.address for e in pool.ready(plan.live)])
            reservation = self.ledger.admit(tenant, prompt_tokens, max_tokens,
                                            time.monotonic())
        except RouterError as exc:
            reason = exc.limit if isinstance(exc, QuotaExceeded) else exc.code
            if isinstance(exc, Unauthorized):
                reason = "unauthorized"
            self.metrics.rejections.labels(pool_name, reason).inc()
            return JSONResponse(exc.body(), exc.status, headers=exc.headers())
        quota = self.ledger.quota(tenant)
        body.pop("model", None)  # the engine serves one model under its own name
        # The quota's class is the most urgent a tenant gets; a client may ask for less.
        floor = PRIORITY[quota.priority_class if quota is not None else PriorityClass.STANDARD]
        asked = body.get("priority")
        body["priority"] = max(floor, asked) if isinstance(asked, int) else floor
        headers = {TENANT_HEADER: tenant, "x-request-id": request_id,
                   "content-type": "application/json"}
        if pool.router_token is not None:
            headers[ROUTER_TOKEN_HEADER] = pool.router_token
        if quota is not None and quota.shared_prefix_cache:
            headers[SHARED_PREFIX_HEADER] = "1"
        payload = json.dumps(body).encode()
        live_text: asyncio.Future[str | None] | None = None
        if plan.shadow is not None:
            # A greedy request's two answers should be the same text: compare them.
            if body.get("temperature") == 0:
                live_text = asyncio.get_running_loop().create_future()
            self._spawn(self._shadow(pool, plan.shadow, path, body, headers, text, tenant,
                                     live_text))
        try:
            return await self._live(pool, plan.live, path, payload, headers, text, tenant,
                                    reservation, bool(body.get("stream")), live_text)
        except BaseException:
            _resolve(live_text, None)  # the shadow task must not wait for a live answer
            raise

    async def _connect(self, pool: PoolRoute, revision: str, path: str, payload: bytes,
                       headers: dict[str, str], text: str, tenant: str
                       ) -> tuple[aiohttp.ClientResponse, EndpointLoad]:
        """An upstream response with status < 500 (or the last failure), trying up to
        max_attempts replicas."""
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
                resp = await self.session.post(f"http://{endpoint.address}{path}",
                                               data=payload, headers=headers)
            except (TimeoutError, aiohttp.ClientError) as exc:
                endpoint.in_flight -= 1
                endpoint.failures += 1
                last = f"{endpoint.address}: {type(exc).__name__}"
                continue
            if resp.status >= 500:
                last = f"{endpoint.address}: HTTP {resp.status}"
                resp.release()
                endpoint.in_flight -= 1
                continue
            return resp, endpoint
        raise NoEndpoint(f"pool {pool.name!r} revision {short_revision(revision)}: no replica "
                         f"answered ({last}); retry shortly")

    async def _request(self, pool: PoolRoute, revision: str, path: str, payload: bytes,
                       headers: dict[str, str], text: str, tenant: str
                       ) -> tuple[int, bytes, str | None]:
        """A whole (non-streamed) answer: status, body and content type."""
        resp, endpoint = await self._connect(pool, revision, path, payload, headers, text,
                                             tenant)
        return await _read_whole(resp, endpoint)

    async def _live(self, pool: PoolRoute, revision: str, path: str, payload: bytes,
                    headers: dict[str, str], text: str, tenant: str, reservation: Reservation,
                    stream: bool, live_text: asyncio.Future[str | None] | None = None
                    ) -> Response:
        labels = (pool.name, short_revision(revision), "live")
        started = time.monotonic()
        try:
            if not stream:
                status, data, content_type = await self._request(
                    pool, revision, path, payload, headers, text, tenant)
            else:
                resp, endpoint = await self._connect(pool, revision, path, payload, headers,
                                                     text, tenant)
                status = resp.status
                if status != 200:  # a refusal: a JSON body, not a stream
                    status, data, content_type = await _read_whole(resp, endpoint)
        except RouterError as exc:
            self.ledger.settle(reservation, 0, time.monotonic(), 0)  # never answered
            self.metrics.requests.labels(*labels, str(exc.status)).inc()
            _resolve(live_text, None)
            return JSONResponse(exc.body(), exc.status, headers=exc.headers())
        out_headers = {REVISION_HEADER: short_revision(revision)}
        if not stream or status != 200:
            generated, prompt = 0, None
            if status == 200:
                with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
                    answer = json.loads(data)
                    _resolve(live_text, answer_text(answer))
                    usage = answer["usage"]
                    generated, prompt = int(usage["completion_tokens"]), int(
                        usage["prompt_tokens"])
                    self._count_tokens(labels, prompt, generated)
                self.metrics.e2e.labels(*labels).observe(time.monotonic() - started)
            _resolve(live_text, None)  # no text to compare (a refusal, an unreadable body)
            self.ledger.settle(reservation, generated, time.monotonic(), prompt)
            self.metrics.requests.labels(*labels, str(status)).inc()
            return Response(data, status, headers=out_headers,
                            media_type=content_type or "application/json")
        relay = _Relay(self, resp, endpoint, labels, reservation, started, live_text)
        return _RelayResponse(
            relay.frames(), relay.close,
            headers={**out_headers, "cache-control": "no-cache"},
            media_type="text/event-stream")

    def _count_tokens(self, labels: tuple[str, str, str], prompt: int, generated: int) -> None:
        self.metrics.tokens.labels(*labels, "prompt").inc(prompt)
        self.metrics.tokens.labels(*labels, "generation").inc(generated)

    def _usage_of(self, frames: bytes, labels: tuple[str, str, str]
                  ) -> tuple[int, int] | None:
        """(prompt, completion) tokens of the frame that carries the usage, if any."""
        for line in frames.split(b"\n"):
            if line.startswith(b"data: {") and b'"usage"' in line:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    usage = json.loads(line[6:])["usage"]
                    counts = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
                    self._count_tokens(labels, *counts)
                    return counts
        return None

    async def _shadow(self, pool: PoolRoute, revision: str, path: str, body: dict[str, Any],
                      headers: dict[str, str], text: str, tenant: str,
                      live_text: asyncio.Future[str | None] | None) -> None:
        """A discarded copy on the shadow revision (non-streaming, capped), compared with the
        live answer of the same request when it is greedy (temperature 0)."""
        labels = (pool.name, short_revision(revision))
        if self._shadow_in_flight >= self.options.shadow_max_in_flight:
            self.metrics.shadow.labels(*labels, "shed").inc()
            return
        self._shadow_in_flight += 1
        started = time.monotonic()
        status, outcome, data = "503", "error", b""
        try:
            limit = self.options.shadow_max_tokens
            shadow_body = {**body, "stream": False}
            shadow_body.pop("stream_options", None)
            for key in ("max_tokens", "max_completion_tokens"):
                if isinstance(shadow_body.get(key), int):
                    shadow_body[key] = min(shadow_body[key], limit)
            shadow_body.setdefault("max_tokens", limit)
            code, data, _ = await self._request(
                pool, revision, path, json.dumps(shadow_body).encode(),
                {**headers, "x-kvfleet-traffic": "shadow"}, text, tenant)
            status, outcome = str(code), "answered" if code == 200 else "error"
        except RouterError as exc:
            status = str(exc.status)
        finally:
            self._shadow_in_flight -= 1
        shadow_labels = (pool.name, short_revision(revision), "shadow")
        self.metrics.requests.labels(*shadow_labels, status).inc()
        self.metrics.e2e.labels(*shadow_labels).observe(time.monotonic() - started)
        shadow_text: str | None = None
        capped = False
        if outcome == "answered":
            with contextlib.suppress(ValueError, KeyError, TypeError, IndexError):
                answer = json.loads(data)
                shadow_text = answer_text(answer)
                capped = answer["choices"][0].get("finish_reason") == "length"
                usage = answer["usage"]
                self._count_tokens(shadow_labels, int(usage["prompt_tokens"]),
                                   int(usage["completion_tokens"]))
        if outcome == "answered" and live_text is not None and shadow_text is not None:
            try:
                live = await asyncio.wait_for(asyncio.shield(live_text), timeout=600)
            except TimeoutError:
                live = None
            if live is not None:
                outcome, diverged_at = compare(live, shadow_text, capped)
                if diverged_at is not None:
                    self.metrics.divergence.labels(*labels).observe(diverged_at)
        self.metrics.shadow.labels(*labels, outcome).inc()


def build_app(router: Router, ready: Callable[[], bool] = lambda: True) -> Starlette:
    async def completions(request: Request) -> Response:
        return await router.handle(request)

    async def models(request: Request) -> Response:
        try:
            return JSONResponse(router.models(request.headers.get("authorization")))
        except RouterError as exc:
            return JSONResponse(exc.body(), exc.status, headers=exc.headers())

    async def metrics(_: Request) -> Response:
        return Response(router.metrics.exposition(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readiness(_: Request) -> Response:
        ok = ready() and bool(router.state.pools)
        return JSONResponse({"ready": ok, "pools": len(router.state.pools)},
                            200 if ok else 503)

    return Starlette(routes=[
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", readiness, methods=["GET"]),
    ])
