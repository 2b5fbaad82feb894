"""The HTTP API over a fake engine core: wire shapes, streaming, errors, tenancy, idempotency.

Budget: a few seconds (no model; the fake core steps in microseconds unless a test slows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio
from server_fakes import FakeCore, chat_template, make_engine

from kvfleet.engine.admission import AdmissionLimits
from kvfleet.engine.async_engine import AsyncEngine
from kvfleet.engine.lifecycle import Lifecycle, warm_up
from kvfleet.engine.server import ServerSettings, Serving, create_app

SCRIPT = "hello world, this is a fake model. " * 8


@dataclass
class Served:
    client: httpx.AsyncClient
    engine: AsyncEngine
    core: FakeCore
    lifecycle: Lifecycle
    app: Any  # the ASGI app, for tests that play the server's part themselves


async def _serve(core: FakeCore | None = None, *, max_context: int = 256,
                 limits: AdmissionLimits | None = None,
                 settings: ServerSettings | None = None) -> AsyncIterator[Served]:
    engine, core = make_engine(core, max_context=max_context, limits=limits)
    engine.start()
    lifecycle = Lifecycle()
    await warm_up(engine, lifecycle, (1, 2, 3))
    app = create_app(Serving(lifecycle, engine, chat_template()), settings)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://kvfleet") as client:
            yield Served(client, engine, core, lifecycle, app)
    finally:
        await engine.stop()


@pytest_asyncio.fixture
async def served() -> AsyncIterator[Served]:
    async for s in _serve():
        yield s


def sse_events(body: str) -> tuple[list[int], list[dict[str, Any]], bool]:
    """(SSE ids, JSON payloads, whether the stream ended with [DONE])."""
    ids: list[int] = []
    payloads: list[dict[str, Any]] = []
    done = False
    for frame in body.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        if lines["data"] == "[DONE]":
            done = True
            continue
        ids.append(int(lines["id"]))
        payloads.append(json.loads(lines["data"]))
    return ids, payloads, done


@pytest.mark.asyncio
async def test_completion_returns_text_usage_and_revision(served: Served) -> None:
    r = await served.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 11})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == SCRIPT[:11]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 11, "total_tokens": 14,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["system_fingerprint"] == "sha256:fake"
    assert r.headers["x-request-id"] == body["id"]


@pytest.mark.asyncio
async def test_stream_has_monotonic_seq_and_final_usage(served: Served) -> None:
    r = await served.client.post("/v1/completions",
                                 json={"prompt": "abc", "max_tokens": 9, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    ids, payloads, done = sse_events(r.text)
    assert done
    assert ids == list(range(len(ids))) == [p["seq"] for p in payloads]
    assert len({p["id"] for p in payloads}) == 1
    assert "".join(p["choices"][0]["text"] for p in payloads) == SCRIPT[:9]
    assert all(p["choices"][0].get("finish_reason") is None for p in payloads[:-1])
    final = payloads[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 9
    assert final["system_fingerprint"] == "sha256:fake"


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_return_token_ids_gives_the_generated_ids_streamed_or_not(
        served: Served, path: str) -> None:
    prompt: dict[str, Any] = {"prompt": "abc"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]}
    plain = (await served.client.post(path, json={**prompt, "max_tokens": 7})).json()
    assert "token_ids" not in plain["choices"][0] or plain["choices"][0]["token_ids"] is None
    whole = (await served.client.post(path, json={**prompt, "max_tokens": 7,
                                                  "return_token_ids": True})).json()
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == whole["usage"]["completion_tokens"] == 7
    r = await served.client.post(path, json={**prompt, "max_tokens": 7, "stream": True,
                                             "return_token_ids": True})
    _, payloads, _ = sse_events(r.text)
    assert [t for p in payloads for t in p["choices"][0].get("token_ids", [])] == ids


@pytest.mark.asyncio
async def test_chat_renders_template_and_streams_role_first(served: Served) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = await served.client.post("/v1/chat/completions",
                                 json={"messages": messages, "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    rendered = "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    assert body["usage"]["prompt_tokens"] == len(rendered.encode())
    assert body["choices"][0]["message"] == {"role": "assistant", "content": SCRIPT[:5]}
    r = await served.client.post("/v1/chat/completions",
                                 json={"messages": messages, "max_tokens": 5, "stream": True})
    _, payloads, _ = sse_events(r.text)
    assert payloads[0]["object"] == "chat.completion.chunk"
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in p["choices"][0]["delta"] for p in payloads[1:])
    assert "".join(p["choices"][0]["delta"]["content"] for p in payloads) == SCRIPT[:5]


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_guidellm_bodies_get_usage_on_every_chunk(served: Served, path: str) -> None:
    # What guidellm (the vLLM project's benchmark client) sends for a synthetic request:
    # vLLM's stream options, ignore_eos, stop null, max_completion_tokens and content parts.
    body: dict[str, Any] = {
        "stream": True, "stop": None, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if path == "/v1/completions":
        body |= {"prompt": "abc", "max_tokens": 6}
    else:
        body |= {"max_completion_tokens": 6,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    r = await served.client.post(path, json=body)
    assert r.status_code == 200, r.text
    _, payloads, done = sse_events(r.text)
    assert done
    counts = [p["usage"]["completion_tokens"] for p in payloads]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(p["usage"]["prompt_tokens"] > 0 for p in payloads)
    # Without continuous_usage_stats only the last chunk carries usage.
    body["stream_options"] = {"include_usage": True}
    _, payloads, _ = sse_events((await served.client.post(path, json=body)).text)
    assert ["usage" in p for p in payloads] == [False] * (len(payloads) - 1) + [True]


@pytest.mark.asyncio
async def test_stop_string_is_cut_and_never_leaks_into_the_stream(served: Served) -> None:
    for stream in (False, True):
        r = await served.client.post("/v1/completions", json={
            "prompt": "x", "max_tokens": 40, "stop": ["world"], "stream": stream})
        if stream:
            _, payloads, _ = sse_events(r.text)
            text = "".join(p["choices"][0]["text"] for p in payloads)
            reason = payloads[-1]["choices"][0]["finish_reason"]
        else:
            text = r.json()["choices"][0]["text"]
            reason = r.json()["choices"][0]["finish_reason"]
        assert (text, reason) == ("hello ", "stop")
    assert not served.core.has_unfinished_requests()


@pytest.mark.asyncio
async def test_vllm_extras_reach_the_sampling_params(served: Served) -> None:
    r = await served.client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 20, "top_k": 5, "min_tokens": 2, "ignore_eos": True,
        "stop_token_ids": [ord("o")], "priority": 3, "seed": 7, "temperature": 0.5})
    assert r.status_code == 200, r.text
    # The stop token is counted in usage but not shown (vLLM's convention).
    assert r.json()["usage"]["completion_tokens"] == 5
    assert r.json()["choices"][0] == {"index": 0, "text": "hell", "finish_reason": "stop",
                                      "logprobs": None, "token_ids": None}
    request = next(r for r in served.core.requests.values() if r.priority == 3)
    params = request.sampling_params
    assert (params.top_k, params.min_tokens, params.ignore_eos, params.seed) == (5, 2, True, 7)


@pytest.mark.asyncio
@pytest.mark.parametrize(("body", "status", "code", "param"), [
    ({"prompt": "abc", "max_tokens": 254}, 400, "context_length_exceeded", "max_tokens"),
    ({"prompt": "a" * 300, "max_tokens": 1}, 400, "context_length_exceeded", "prompt"),
    ({"prompt": "abc", "max_tokens": 1, "temperature": -1}, 400, "invalid_request_error",
     "temperature"),
    ({"prompt": "abc", "max_tokens": 1, "bogus": 1}, 400, "invalid_request_error", "bogus"),
    ({"prompt": "abc", "n": 2}, 400, "unsupported_parameter", "n"),
    ({"prompt": "abc", "logprobs": 2}, 400, "unsupported_parameter", "logprobs"),
    ({"prompt": "abc", "model": "gpt-9"}, 404, "model_not_found", "model"),
    ({"prompt": ""}, 400, "invalid_request_error", "prompt"),
    ({"prompt": [999999]}, 400, "invalid_request_error", "prompt"),
    ({"prompt": "abc", "max_tokens": 13}, 400, "invalid_request_error",
     "sampling_params.max_tokens"),
])
async def test_bad_requests_get_openai_errors_naming_the_field(
        served: Served, body: dict[str, Any], status: int, code: str, param: str) -> None:
    r = await served.client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert error["message"] and error["type"]


@pytest.mark.asyncio
async def test_request_that_never_fits_the_kv_pool_is_400() -> None:
    # 64 blocks x 4 tokens = 256 KV tokens, context 1024: fits the context, never the pool.
    async for s in _serve(max_context=1024):
        r = await s.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 300})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "kv_capacity_exceeded"
        assert not s.core.requests.keys() - {next(iter(s.core.requests))}  # only the warm-up


@pytest.mark.asyncio
async def test_tenant_over_concurrency_and_full_queue_get_429_with_retry_after() -> None:
    limits = AdmissionLimits(max_in_flight=2, max_in_flight_per_tenant=1, retry_after_seconds=2)
    async for s in _serve(FakeCore(step_seconds=0.01), limits=limits):
        slow = {"prompt": "abc", "max_tokens": 60}
        first = asyncio.ensure_future(s.client.post("/v1/completions", json=slow,
                                                    headers={"x-kvfleet-tenant": "a"}))
        while s.engine.num_in_flight < 1:
            await asyncio.sleep(0.005)
        r = await s.client.post("/v1/completions", json=slow, headers={"x-kvfleet-tenant": "a"})
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "tenant_concurrency_exceeded"
        assert r.headers["retry-after"] == "2"
        second = asyncio.ensure_future(s.client.post("/v1/completions", json=slow,
                                                     headers={"x-kvfleet-tenant": "b"}))
        while s.engine.num_in_flight < 2:
            await asyncio.sleep(0.005)
        r = await s.client.post("/v1/completions", json=slow, headers={"x-kvfleet-tenant": "c"})
        assert (r.status_code, r.json()["error"]["code"]) == (429, "queue_full")
        assert [f.status_code for f in await asyncio.gather(first, second)] == [200, 200]


@pytest.mark.asyncio
async def test_body_too_large_is_413() -> None:
    async for s in _serve(settings=ServerSettings(max_body_bytes=1000)):
        r = await s.client.post("/v1/completions", json={"prompt": "a" * 2000})
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"


@pytest.mark.asyncio
async def test_prefix_cache_scope_comes_from_the_tenant_never_the_client() -> None:
    settings = ServerSettings(shared_prefix_tenants=frozenset({"s1", "s2"}))
    async for s in _serve(settings=settings):
        salts = {}
        for tenant in ("a", "b", "s1", "s2", None):
            headers = {"x-kvfleet-tenant": tenant} if tenant else {}
            r = await s.client.post("/v1/completions", headers=headers,
                                    json={"prompt": "abc", "max_tokens": 1, "user": tenant})
            assert r.status_code == 200
            request = s.core.requests[r.json()["id"]]
            assert request.tenant == (tenant or "default")
            salts[tenant] = request.cache_salt
        assert len({salts["a"], salts["b"], salts["s1"], salts[None]}) == 4
        assert salts["s1"] == salts["s2"]
        r = await s.client.post("/v1/completions", json={"prompt": "abc", "cache_salt": "a"})
        assert r.status_code == 400  # the client cannot pick a scope
        r = await s.client.post("/v1/completions", json={"prompt": "abc"},
                                headers={"x-kvfleet-tenant": "bad tenant!"})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_tenant")


@pytest.mark.asyncio
async def test_idempotency_key_returns_the_original_instead_of_generating_twice(
        served: Served) -> None:
    body = {"prompt": "abc", "max_tokens": 7, "stream": True}
    headers = {"Idempotency-Key": "k-1"}
    first = await served.client.post("/v1/completions", json=body, headers=headers)
    num_requests = len(served.core.requests)
    again = await served.client.post("/v1/completions", json=body, headers=headers)
    assert again.text == first.text  # same id, same seq numbers, same text
    assert len(served.core.requests) == num_requests
    other_tenant = await served.client.post("/v1/completions", json=body,
                                            headers={**headers, "x-kvfleet-tenant": "t2"})
    assert sse_events(other_tenant.text)[1][0]["id"] != sse_events(first.text)[1][0]["id"]
    conflict = await served.client.post("/v1/completions", json={**body, "max_tokens": 8},
                                        headers=headers)
    assert (conflict.status_code, conflict.json()["error"]["code"]) == (
        409, "idempotency_key_reused")


@pytest.mark.asyncio
async def test_deadline_ends_the_request_and_frees_it() -> None:
    async for s in _serve(FakeCore(step_seconds=0.01)):
        r = await s.client.post("/v1/completions", json={
            "prompt": "abc", "max_tokens": 200, "deadline_seconds": 0.1})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "deadline"
        assert 0 < r.json()["usage"]["completion_tokens"] < 200
        r = await s.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 200},
                                headers={"x-kvfleet-deadline-seconds": "0.05"})
        assert r.json()["choices"][0]["finish_reason"] == "deadline"
        assert s.core.blocks_in_use() == 0


@pytest.mark.asyncio
async def test_models_health_ready_and_openapi(served: Served) -> None:
    models = (await served.client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "fake-model"
    assert models["data"][0]["revision"] == "sha256:fake"
    assert (await served.client.get("/health")).json()["state"] == "READY"
    assert (await served.client.get("/ready")).status_code == 200
    doc = (await served.client.get("/openapi.json")).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= doc["paths"].keys()
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"top_k", "min_tokens", "priority", "deadline_seconds"} <= props.keys()
    operation = doc["paths"]["/v1/completions"]["post"]
    assert {"400", "429", "413"} <= operation["responses"].keys()
    assert "422" not in operation["responses"]  # validation errors are 400, as in OpenAI
    headers = {p["name"] for p in operation["parameters"] if p["in"] == "header"}
    assert headers == {"Idempotency-Key", "x-kvfleet-deadline-seconds"}
    r = await served.client.post("/v1/completions", json={"prompt": "a"},
                                 headers={"x-kvfleet-deadline-seconds": "-1"})
    assert (r.status_code, r.json()["error"]["param"]) == (
        400, "header.x-kvfleet-deadline-seconds")


def test_faults_apply_only_to_the_named_revision() -> None:
    from kvfleet.engine.faults import Faults, faults_for

    spec = "abc:token_delay=0.5,error_rate=0.25;def:error_rate=1"
    assert faults_for(spec, "abc123") == Faults(token_delay=0.5, error_rate=0.25)
    assert faults_for(spec, "def999") == Faults(error_rate=1.0)
    assert not faults_for(spec, "0ff1ce").active and not faults_for("", "abc").active
    with pytest.raises(ValueError, match="unknown fault 'slow'"):
        faults_for("abc:slow=1", "abc")
    with pytest.raises(ValueError, match="rates are 0-1"):
        faults_for("abc:error_rate=2", "abc")
    slow_long = faults_for("abc:long_prompt_delay=0.01,long_prompt_tokens=100", "abc")
    assert slow_long.active and slow_long.prompt_delay(100) == 0.0
    assert slow_long.prompt_delay(300) == pytest.approx(2.0)
    crash = faults_for("abc:exit_after=180", "abc")
    assert crash.active and crash.exit_after == 180.0
    with pytest.raises(ValueError, match=">= 0"):
        faults_for("abc:exit_after=-1", "abc")


@pytest.mark.asyncio
async def test_injected_faults_fail_requests_or_slow_every_step() -> None:
    from kvfleet.engine.faults import Faults

    body = {"prompt": [5, 6], "max_tokens": 3}
    async for s in _serve(settings=ServerSettings(faults=Faults(error_rate=1.0))):
        resp = await s.client.post("/v1/completions", json=body)
        assert resp.status_code == 500 and "injected fault" in resp.json()["error"]["message"]
    async for s in _serve():
        s.engine.step_delay = 0.1  # what the runtime sets after warm-up
        loop = asyncio.get_running_loop()
        started = loop.time()
        resp = await s.client.post("/v1/completions", json=body)
        assert resp.status_code == 200 and loop.time() - started >= 0.3  # three steps
    faults = Faults(stream_error_rate=1.0, long_prompt_delay=0.1, long_prompt_tokens=1)
    async for s in _serve(settings=ServerSettings(faults=faults)):
        loop = asyncio.get_running_loop()
        started = loop.time()
        resp = await s.client.post("/v1/completions", json={**body, "max_tokens": 8,
                                                            "stream": True})
        assert loop.time() - started >= 0.1  # one prompt token over the threshold
        # An error inside the 200, after the first tokens, as a failed engine step ends it.
        frames = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {")]
        assert resp.status_code == 200 and frames[-1]["choices"][0]["finish_reason"] == "error"
        assert any(f["choices"][0]["text"] for f in frames[:-1])
        for _ in range(100):  # the aborted request lets go of its slot
            if s.engine.num_in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert s.engine.num_in_flight == 0


@pytest_asyncio.fixture
async def slow() -> AsyncIterator[Served]:
    """A core that takes 10 ms a step: 200 tokens take 2 s, long enough to tell a request that
    was cancelled from one that ran out."""
    async for s in _serve(FakeCore(step_seconds=0.01)):
        yield s


@pytest.mark.asyncio
@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_a_stream_whose_client_left_before_its_first_byte_is_cancelled(
        slow: Served, spec_version: str) -> None:
    """The client is gone before the response starts: under ASGI 2.4 uvicorn's send raises
    (its ClientDisconnected is an OSError); before 2.4 Starlette cancels the response when it
    reads the disconnect. Either way the body generator may never start, and its `finally`
    never runs: the request must still be cancelled, not generate to max_tokens."""
    body = json.dumps({"prompt": "abc", "max_tokens": 200, "stream": True}).encode()
    inbox: list[dict[str, Any]] = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if spec_version == "2.4":
            raise OSError("the client is gone")  # as uvicorn's send does then

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("kvfleet", 80),
             "headers": [(b"host", b"kvfleet"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    with contextlib.suppress(Exception):  # 2.4: Starlette's ClientDisconnect
        await slow.app(scope, receive, send)
    (request,) = [r for r in slow.core.requests.values() if r.sampling_params.max_tokens == 200]
    for _ in range(100):
        if request.is_finished:
            break
        await asyncio.sleep(0.01)
    assert request.finish_reason is not None and request.finish_reason.value == "cancelled"
    assert request.num_output_tokens < 200 and slow.core.blocks_in_use() == 0


@pytest.mark.asyncio
async def test_a_chat_to_a_model_without_a_chat_template_is_the_revisions_refusal() -> None:
    """It was `invalid_request_error`, which the router counts as the client's: a revision
    that lost its template refused every chat and passed the ErrorRate gate."""
    from kvfleet.router.outcome import Outcome, classify

    engine, _ = make_engine(max_context=256)
    engine.start()
    lifecycle = Lifecycle()
    await warm_up(engine, lifecycle, (1, 2, 3))
    app = create_app(Serving(lifecycle, engine, None))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://kvfleet") as client:
            resp = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["code"] == "chat_template_missing" and error["param"] == "messages"
        assert classify(400, error["code"]) is Outcome.REVISION_REFUSED
    finally:
        await engine.stop()
