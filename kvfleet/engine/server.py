"""The OpenAI-compatible HTTP API of one engine (FastAPI), a thin edge over `AsyncEngine`.

Handlers only translate: wire model → `GenerationSpec`, `StreamEvent`s → wire chunks, and
typed errors → the OpenAI error shape `{"error": {message, type, param, code}}` with a
stable `code` and the HTTP status from `STATUS_BY_CODE`.

Tenancy: the tenant is read from a trusted header (set by the kvfleet router, which
authenticates clients), `x-kvfleet-tenant` by default. The prefix-cache scope is derived
from the tenant on the server and never read from the client, so no request can ask to share
another tenant's cached KV; tenants named with `--shared-prefix-tenants` share one scope.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from kvfleet.engine.admission import ServingError
from kvfleet.engine.async_engine import AsyncEngine, GenerationSpec, RequestStream, StreamEvent
from kvfleet.engine.chat_template import ChatTemplate
from kvfleet.engine.errors import InvalidRequestError
from kvfleet.engine.faults import Faults
from kvfleet.engine.idempotency import fingerprint
from kvfleet.engine.lifecycle import Lifecycle, LifecycleState
from kvfleet.engine.metrics import CONTENT_TYPE
from kvfleet.engine.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChunk,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChunk,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    ReadyResponse,
    SamplingDefaults,
    SamplingFields,
    Usage,
)
from kvfleet.engine.request import SamplingParams
from kvfleet.engine.router_token import RouterTokens

STATUS_BY_CODE: dict[str, int] = {
    "invalid_request_error": 400,
    "unsupported_parameter": 400,
    "context_length_exceeded": 400,
    "kv_capacity_exceeded": 400,
    "invalid_tenant": 400,
    # A chat request to a model without a chat template: the artifact's fault (a revision
    # that lost its template refuses every chat its predecessor served).
    "chat_template_missing": 400,
    "router_proof_required": 401,
    "model_not_found": 404,
    "method_not_allowed": 405,
    "idempotency_key_reused": 409,
    "request_too_large": 413,
    "queue_full": 429,
    "tenant_concurrency_exceeded": 429,
    "not_ready": 503,
    "internal_error": 500,
}
_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
DEADLINE_HEADER = "x-kvfleet-deadline-seconds"
ROUTER_TOKEN_HEADER = "x-kvfleet-router-token"
# Set by the router, believed only with its token: the tenant's TenantQuota allows a prefix
# cache shared with other tenants so allowed.
SHARED_PREFIX_HEADER = "x-kvfleet-shared-prefix"
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 404, 409, 413, 429, 503)
}


@dataclass(frozen=True, slots=True)
class ServerSettings:
    tenant_header: str = "x-kvfleet-tenant"
    default_tenant: str = "default"
    # With a router token set, only requests that carry it (ROUTER_TOKEN_HEADER) are served:
    # the router authenticated their tenant. Others are refused with 401, since serving them
    # as any tenant would bypass the TenantQuota the router enforces. (Re-read from its file
    # when that changes, the previous one accepted for a while: kvfleet.engine.router_token.)
    router_token: RouterTokens | None = None
    shared_prefix_tenants: frozenset[str] = field(default_factory=frozenset)
    shared_prefix_scope: str = "kvfleet-shared"
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int = 1024  # chat requests without max_tokens (capped by context)
    # The model's sampling defaults, for the fields a request leaves unset (the artifact's
    # spec.samplingDefaults); None: the OpenAI defaults.
    sampling_defaults: SamplingDefaults | None = None
    # A test's injected faults (see `faults`); the token delay is the engine loop's.
    faults: Faults = field(default_factory=Faults)


class ApiError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after


def error_response(code: str, message: str, param: str | None = None,
                   retry_after: float | None = None) -> JSONResponse:
    status = STATUS_BY_CODE.get(code, 400)
    kind = ("invalid_request_error" if status < 500 and status != 429
            else "rate_limit_error" if status == 429 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    return JSONResponse(body, status_code=status, headers=headers)


class BodySizeLimit:
    """ASGI middleware: 413 when a request body exceeds `max_bytes`, declared or streamed."""

    def __init__(self, app: Callable[..., Awaitable[None]], max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[..., Any],
                       send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = error_response(
            "request_too_large", f"the request body exceeds {self.max_bytes} bytes; send a "
            "shorter prompt", None)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await too_large(scope, receive, send)
                return
        received = 0

        async def limited_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise ApiError("request_too_large", f"the request body exceeds "
                                   f"{self.max_bytes} bytes; send a shorter prompt")
            return message

        try:
            await self.app(scope, limited_receive, send)
        except ApiError as exc:
            await error_response(exc.code, exc.message)(scope, receive, send)


def _check_supported(body: SamplingFields) -> None:
    def reject(param: str, why: str) -> None:
        raise ApiError("unsupported_parameter", f"{param}: {why}", param)

    if body.n != 1:
        reject("n", "only n=1 is served; send n separate requests")
    if body.presence_penalty or body.frequency_penalty:
        reject("presence_penalty" if body.presence_penalty else "frequency_penalty",
               "penalties are not supported by this engine; leave them at 0")
    if body.logit_bias:
        reject("logit_bias", "not supported by this engine")
    if isinstance(body, CompletionRequest):
        if body.logprobs is not None:
            reject("logprobs", "not supported by this engine")
        if body.echo:
            reject("echo", "not supported by this engine")
        if body.suffix:
            reject("suffix", "not supported by this engine")
        if body.best_of not in (None, 1):
            reject("best_of", "only best_of=1 is served")
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs or body.top_logprobs:
            reject("logprobs", "not supported by this engine")
        if body.tools:
            reject("tools", "tool calling is not supported by this engine")
        if body.response_format and body.response_format.get("type", "text") != "text":
            reject("response_format", "only {'type': 'text'} is supported")


@dataclass(frozen=True, slots=True)
class RequestHeaders:
    idempotency_key: str | None
    deadline_seconds: float | None


async def request_headers(
    idempotency_key: Annotated[str | None, Header(
        alias="Idempotency-Key", min_length=1, max_length=256,
        description="A retry with the same key (and body) gets the original result or "
        "stream instead of a second generation.")] = None,
    deadline_seconds: Annotated[float | None, Header(
        alias=DEADLINE_HEADER, gt=0, le=86_400,
        description="End the request with finish_reason 'deadline' this many seconds after "
        "arrival (the smaller of this and the body's deadline_seconds applies).")] = None,
) -> RequestHeaders:
    return RequestHeaders(idempotency_key, deadline_seconds)


def _without_422(doc: dict[str, Any]) -> dict[str, Any]:
    """FastAPI documents validation failures as 422; this API answers 400 (OpenAI's shape)."""
    for operations in doc.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    return doc


def _completion_prompt(body: CompletionRequest, engine: AsyncEngine
                       ) -> tuple[list[int], str | None]:
    """Token ids (and text, if given as text) of the one prompt of a completion request."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError("unsupported_parameter", "prompt: batched prompts are not served; "
                           "send one request per prompt", "prompt")
        single = prompt[0]
    else:
        single = prompt  # type: ignore[assignment]
    if isinstance(single, str):
        return engine.tokenizer.encode(single), single
    ids = [t for t in single if isinstance(t, int)]
    if len(ids) != len(single) or any(not 0 <= t < engine.tokenizer.vocab_size for t in ids):
        raise ApiError("invalid_request_error", f"prompt: token ids must be integers in "
                       f"[0, {engine.tokenizer.vocab_size})", "prompt")
    return ids, None


def _sampling(body: SamplingFields, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=max(0, body.top_k), seed=body.seed, min_tokens=min(body.min_tokens, max_tokens),
        stop=tuple(body.stop_strings()), stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
    )


@dataclass(slots=True)
class Serving:
    """What the app serves; `engine` is None while the model loads (LOADING)."""

    lifecycle: Lifecycle
    engine: AsyncEngine | None = None
    chat_template: ChatTemplate | None = None


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal in the OpenAI error shape, with the field it is about."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.code, exc.message, exc.param, exc.retry_after)

    @app.exception_handler(ServingError)
    async def _serving_error(_: Request, exc: ServingError) -> JSONResponse:
        return error_response(exc.code, exc.message, exc.param, exc.retry_after)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(exc.code, str(exc), exc.field)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid body"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        return error_response("invalid_request_error",
                              f"{param or 'body'}: {first.get('msg', 'invalid')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code,
                                                                 "invalid_request_error")
        resp = error_response(code, str(exc.detail))
        resp.status_code = exc.status_code
        return resp

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return error_response("internal_error", f"internal error ({type(exc).__name__}); "
                              "see the engine log")


class _Gate:
    """What every generating route checks and builds before the engine sees a request: the
    engine loaded and ready, the router's proof, the tenant, the model name, the spec."""

    def __init__(self, serving: Serving, cfg: ServerSettings) -> None:
        self.serving, self.cfg = serving, cfg

    def loaded(self) -> AsyncEngine:
        if self.serving.engine is None:
            raise ApiError("not_ready", f"the engine is {self.serving.lifecycle.state.value}; "
                           "retry on another replica", retry_after=1)
        return self.serving.engine

    def from_router(self, request: Request) -> bool:
        if self.cfg.router_token is None:
            return False
        if not self.cfg.router_token.accepts(request.headers.get(ROUTER_TOKEN_HEADER, "")):
            raise ApiError("router_proof_required", "this engine serves only requests that come "
                           "through the kvfleet router (send them to the router's Service)",
                           ROUTER_TOKEN_HEADER)
        return True

    def tenant_of(self, request: Request) -> str:
        self.from_router(request)
        tenant = request.headers.get(self.cfg.tenant_header, self.cfg.default_tenant)
        if not _TENANT_RE.match(tenant):
            raise ApiError("invalid_tenant", f"header {self.cfg.tenant_header} must match "
                           f"{_TENANT_RE.pattern}", self.cfg.tenant_header)
        return tenant

    def check_model(self, body: SamplingFields) -> None:
        model = self.loaded().model
        if body.model not in (None, "", model.name):
            raise ApiError("model_not_found", f"model {body.model!r} is not served here; "
                           f"this engine serves {model.name!r}", "model")

    def check_ready(self) -> AsyncEngine:
        if self.serving.lifecycle.state is not LifecycleState.READY:
            raise ApiError("not_ready", f"the engine is {self.serving.lifecycle.state.value}; "
                           "retry on another replica", retry_after=1)
        return self.loaded()

    def build_spec(self, request: Request, headers: RequestHeaders, body: SamplingFields,
                   prompt_ids: list[int], max_tokens: int, prompt_text: str | None
                   ) -> GenerationSpec:
        tenant = self.tenant_of(request)
        shared = tenant in self.cfg.shared_prefix_tenants or (
            self.cfg.router_token is not None and request.headers.get(SHARED_PREFIX_HEADER) == "1")
        scope = self.cfg.shared_prefix_scope if shared else tenant
        deadlines = [d for d in (headers.deadline_seconds, body.deadline_seconds) if d]
        return GenerationSpec(
            prompt_token_ids=tuple(prompt_ids), sampling=_sampling(body, max_tokens),
            tenant=tenant, cache_scope=scope,
            priority=body.priority, deadline_seconds=min(deadlines, default=None),
            idempotency_key=headers.idempotency_key,
            # Only a keyed request is ever compared with another (a 1k-token body's digest
            # is not free).
            body_fingerprint="" if headers.idempotency_key is None else fingerprint(
                [request.url.path, body.model_dump(mode="json")]),
            skip_special_tokens=body.skip_special_tokens, prompt_text=prompt_text,
        )

    async def run(self, request: Request, spec: GenerationSpec, stream_mode: bool,
                  render: Callable[[RequestStream, StreamEvent, bool], dict[str, Any]],
                  finish: Callable[[RequestStream, list[StreamEvent]], Any]) -> Response:
        engine = self.loaded()
        faults = self.cfg.faults
        if faults.fail_now():
            raise ApiError("internal_error", "injected fault ($KVFLEET_ENGINE_FAULTS)")
        if delay := faults.prompt_delay(len(spec.prompt_token_ids)):
            await asyncio.sleep(delay)
        stream = await engine.submit(spec)
        engine.attach(stream)
        if stream_mode:
            return _EngineStream(engine, stream, render,
                                 fail_after=FAULT_STREAM_EVENTS if faults.fail_stream_now()
                                 else None)
        try:
            events = await _result_or_disconnect(request, stream)
        finally:
            engine.detach(stream)
        if events is None:
            return Response(status_code=499)  # client gone; nobody reads this
        return JSONResponse(finish(stream, events).model_dump(mode="json"),
                            headers={"x-request-id": stream.request_id})


def _usage(last: StreamEvent) -> Usage:
    return Usage(prompt_tokens=last.num_prompt_tokens,
                 completion_tokens=last.num_output_tokens,
                 total_tokens=last.num_prompt_tokens + last.num_output_tokens,
                 prompt_tokens_details={"cached_tokens": last.num_cached_tokens})


def _ids(body: SamplingFields, events: list[StreamEvent]) -> list[int] | None:
    """The events' token ids when the request asked for them (`return_token_ids`)."""
    if not body.return_token_ids:
        return None
    return [token for event in events for token in event.token_ids]


def _add_generation_routes(app: FastAPI, gate: _Gate) -> None:
    """/v1/completions and /v1/chat/completions: a prompt, a spec, a run on the engine."""

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request,
                          headers: Annotated[RequestHeaders, Depends(request_headers)]
                          ) -> Response:
        engine = gate.check_ready()
        if gate.cfg.sampling_defaults is not None:
            body = gate.cfg.sampling_defaults.apply(body)
        model = engine.model
        gate.check_model(body)
        _check_supported(body)
        prompt_ids, prompt_text = _completion_prompt(body, engine)
        if not prompt_ids:
            raise ApiError("invalid_request_error", "prompt: is empty; send at least one "
                           "token", "prompt")
        spec = gate.build_spec(request, headers, body, prompt_ids, body.max_tokens or 16,
                               prompt_text)
        every_chunk = body.usage_on_every_chunk()

        def render(stream: RequestStream, event: StreamEvent, _: bool) -> dict[str, Any]:
            return CompletionStreamChunk(
                id=stream.request_id, created=stream.created, model=model.name,
                system_fingerprint=model.revision, seq=event.seq,
                choices=[CompletionChoice(text=event.text, finish_reason=event.finish_reason,
                                          token_ids=_ids(body, [event]))],
                usage=_usage(event) if event.finish_reason or every_chunk else None,
            ).model_dump(mode="json", exclude_none=True)

        def finish(stream: RequestStream, events: list[StreamEvent]) -> CompletionResponse:
            return CompletionResponse(
                id=stream.request_id, created=stream.created, model=model.name,
                system_fingerprint=model.revision,
                choices=[CompletionChoice(text="".join(e.text for e in events),
                                          finish_reason=events[-1].finish_reason,
                                          token_ids=_ids(body, events))],
                usage=_usage(events[-1]))

        return await gate.run(request, spec, body.stream, render, finish)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=_ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               headers: Annotated[RequestHeaders, Depends(request_headers)]
                               ) -> Response:
        engine = gate.check_ready()
        if gate.cfg.sampling_defaults is not None:
            body = gate.cfg.sampling_defaults.apply(body)
        model = engine.model
        gate.check_model(body)
        _check_supported(body)
        chat_template = gate.serving.chat_template
        if chat_template is None:
            raise ApiError("chat_template_missing", "this model has no chat template; use "
                           "/v1/completions", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = chat_template.render(messages, add_generation_prompt=body.add_generation_prompt)
        prompt_ids = engine.tokenizer.encode(text, add_special_tokens=False)
        if not prompt_ids:
            raise ApiError("invalid_request_error", "messages: render to an empty prompt",
                           "messages")
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = requested or max(1, min(gate.cfg.default_max_tokens,
                                             model.max_context - len(prompt_ids)))
        spec = gate.build_spec(request, headers, body, prompt_ids, max_tokens, text)
        every_chunk = body.usage_on_every_chunk()

        def render(stream: RequestStream, event: StreamEvent, first: bool) -> dict[str, Any]:
            delta = ChatDelta(role="assistant" if first else None, content=event.text)
            return ChatCompletionStreamChunk(
                id=stream.request_id, created=stream.created, model=model.name,
                system_fingerprint=model.revision, seq=event.seq,
                choices=[ChatStreamChoice(delta=delta, finish_reason=event.finish_reason,
                                          token_ids=_ids(body, [event]))],
                usage=_usage(event) if event.finish_reason or every_chunk else None,
            ).model_dump(mode="json", exclude_none=True)

        def finish(stream: RequestStream, events: list[StreamEvent]) -> ChatCompletionResponse:
            message = AssistantMessage(content="".join(e.text for e in events))
            return ChatCompletionResponse(
                id=stream.request_id, created=stream.created, model=model.name,
                system_fingerprint=model.revision,
                choices=[ChatChoice(message=message, finish_reason=events[-1].finish_reason,
                                    token_ids=_ids(body, events))],
                usage=_usage(events[-1]))

        return await gate.run(request, spec, body.stream, render, finish)


def _add_status_routes(app: FastAPI, gate: _Gate) -> None:
    """The model list, the tokenizer, liveness, readiness and metrics."""

    @app.get("/v1/models", response_model=ModelList, responses={503: {"model": ErrorResponse}})
    async def models() -> ModelList:
        model = gate.loaded().model
        return ModelList(data=[ModelCard(id=model.name, created=int(gate.serving.lifecycle.since),
                                         root=model.name, max_model_len=model.max_context,
                                         revision=model.revision)])

    @app.get("/tokenizer.json", include_in_schema=False)
    async def tokenizer_json() -> Response:
        """The model's tokenizer (HF tokenizer.json): the router counts prompt tokens with the
        same pipeline before admitting a request to a TenantQuota's token budget."""
        engine = gate.loaded()
        return Response(engine.tokenizer.to_json(), media_type="application/json",
                        headers={"x-kvfleet-revision": engine.model.revision})

    def engine_problem() -> str | None:
        return gate.serving.engine.check() if gate.serving.engine is not None else None

    @app.get("/health", response_model=HealthResponse,
             responses={503: {"model": HealthResponse}})
    async def health() -> JSONResponse:
        # Liveness: a dead or stalled engine thread (the watchdog's finding) fails it, so the
        # kubelet restarts the process; loading and draining are alive.
        problem = engine_problem()
        body = HealthResponse(status="ok" if problem is None else "failed",
                              state=gate.serving.lifecycle.state.value, reason=problem)
        return JSONResponse(body.model_dump(exclude_none=True),
                            status_code=200 if problem is None else 503)

    @app.get("/ready", response_model=ReadyResponse, responses={503: {"model": ReadyResponse}})
    async def ready() -> JSONResponse:
        problem = engine_problem()
        body = ReadyResponse(ready=gate.serving.lifecycle.is_ready and problem is None,
                             state=gate.serving.lifecycle.state.value, reason=problem)
        return JSONResponse(body.model_dump(exclude_none=True),
                            status_code=200 if body.ready else 503)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(gate.loaded().metrics.exposition(), media_type=CONTENT_TYPE)


def create_app(serving: Serving, settings: ServerSettings | None = None) -> FastAPI:
    cfg = settings or ServerSettings()
    app = FastAPI(title="kvfleet engine", version="v1",
                  description="OpenAI-compatible API of one kvfleet engine instance.")
    _add_error_handlers(app)
    gate = _Gate(serving, cfg)
    _add_generation_routes(app, gate)
    _add_status_routes(app, gate)

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _without_422(default_openapi())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(BodySizeLimit, max_bytes=cfg.max_body_bytes)
    return app


# An injected stream error (faults.stream_error_rate) ends a stream at this event (or at its
# last, if sooner): after its first tokens, as a step that throws mid-generation does.
FAULT_STREAM_EVENTS = 2


class _EngineStream(StreamingResponse):
    """The SSE answer of one engine stream, which lets go of the stream however the response
    ends: finished, the client gone mid-stream, or gone before the first byte. In the last
    case the body generator never starts, so a `finally` inside it would never run and the
    request would generate to max_tokens for nobody (tests/unit/test_server_api.py)."""

    def __init__(self, engine: AsyncEngine, stream: RequestStream,
                 render: Callable[[RequestStream, StreamEvent, bool], dict[str, Any]],
                 fail_after: int | None = None) -> None:
        super().__init__(_sse(stream, render, fail_after), media_type="text/event-stream",
                         headers={"x-request-id": stream.request_id})
        self._engine, self._stream = engine, stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine.detach(self._stream)


async def _sse(stream: RequestStream,
               render: Callable[[RequestStream, StreamEvent, bool], dict[str, Any]],
               fail_after: int | None = None) -> AsyncIterator[str]:
    """SSE frames: `id:` is the sequence number; the JSON carries it too (`seq`). With
    `fail_after` (an injected fault), the stream ends after that many events the way a failed
    engine step ends it: `finish_reason: "error"` (the request is aborted when it detaches)."""
    first = True
    async for event in stream.follow():
        if fail_after is not None and (event.seq >= fail_after or event.finish_reason):
            event = StreamEvent(event.seq, "", 0, "error")  # at the latest, instead of the end
        payload = json.dumps(render(stream, event, first), separators=(",", ":"))
        first = False
        yield f"id: {event.seq}\ndata: {payload}\n\n"
        if event.finish_reason == "error" and fail_after is not None:
            break
    yield "data: [DONE]\n\n"


async def _result_or_disconnect(request: Request, stream: RequestStream
                                ) -> list[StreamEvent] | None:
    """The request's events, or None if the client disconnected first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result = asyncio.ensure_future(stream.result())
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()
    return result.result() if result.done() and not result.cancelled() else None
