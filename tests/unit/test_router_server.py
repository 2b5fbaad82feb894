"""The router's HTTP edge against a fake engine on loopback, and against the real engine's HTTP
app over a fake core (the real model: the integration tests): what reaches the engine, what a
failing engine leaves behind, and what each answer is counted as (its outcome)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from kvfleet.router.outcome import Outcome
from kvfleet.router.picker import EndpointLoad
from kvfleet.router.server import Router, RouterOptions, build_app, build_metrics_app
from kvfleet.router.state import parse_config
from kvfleet.router.tokens import Prompt, texts_of

REVISION = "a" * 64
KEY = "sk-team-a-0123456789abcdef"
NAMESPACE = "llm"
LIVE = {"namespace": NAMESPACE, "pool": "smol", "revision": REVISION[:12], "traffic": "live"}
# What the fake engine streams, by the prompt: a role-only delta at once, then (after ROLE_GAP)
# text, then how the answer ends.
ROLE_GAP = 0.2


def frame(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(text: str | None = None, finish: str | None = None, role: bool = False,
          usage: int | None = None) -> bytes:
    delta: dict[str, str] = {"role": "assistant"} if role else {}
    if text is not None:
        delta["content"] = text
    body: dict[str, Any] = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = {"prompt_tokens": 3, "completion_tokens": usage}
    return frame(body)


STREAMS = {
    "error-frame": [chunk("Hel"), chunk("lo"),
                    frame({"error": {"message": "step failed", "type": "server_error",
                                     "code": "internal_error"}})],
    "finish-error": [chunk("Hel"), chunk("", finish="error", usage=1)],
    "fine": [chunk("Hel"), chunk("lo"), chunk("", finish="stop", usage=2)],
    # A revision that cannot stop: the same phrase until max_tokens cuts it.
    "loop": [*(chunk("I am here. ") for _ in range(40)), chunk("", finish="length", usage=40)],
}
# Refusals as the engine writes them (kvfleet.engine.server.error_response).
REFUSALS = {"too-long": (400, "context_length_exceeded"),
            "bad-params": (400, "invalid_request_error"),
            "queue": (429, "queue_full")}


async def stream(request: web.Request, content: str) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(chunk(role=True))
    await asyncio.sleep(ROLE_GAP)
    for data in STREAMS[content]:
        await resp.write(data)
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def whole(content: str) -> web.Response:
    if content in REFUSALS:
        status, code = REFUSALS[content]
        return web.json_response({"error": {"message": content, "type": "invalid_request_error",
                                            "param": None, "code": code}}, status=status)
    finish = "error" if content == "finish-error" else "stop"
    return web.json_response({"id": "x", "choices": [{"message": {"content": "ok"},
                                                      "finish_reason": finish}],
                              "usage": {"prompt_tokens": 3, "completion_tokens": 1}})


@pytest_asyncio.fixture
async def upstream() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"body": body, "headers": dict(request.headers)})
        if body["messages"][0]["content"] == "die":
            resp = web.StreamResponse(headers={"content-length": "1000"})
            await resp.prepare(request)
            await resp.write(b'{"partial": ')
            assert request.transport is not None
            request.transport.close()  # the replica goes away mid-answer
            return resp
        content = body["messages"][0]["content"]
        if content == "stall":  # an engine whose step thread hangs (the stall_after fault)
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            if body.get("stream"):
                await resp.write(chunk("Hel"))
            await asyncio.sleep(3)  # far past the test's timeouts
            return resp
        if body.get("stream") and content in STREAMS:
            return await stream(request, content)
        return await whole(content)

    async def tokenizer_json(_: web.Request) -> web.Response:
        return web.Response(text=word_tokenizer().to_str(), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/tokenizer.json", tokenizer_json)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"127.0.0.1:{port}", seen
    await runner.cleanup()


def word_tokenizer() -> Tokenizer:
    """A tokenizer that makes one token of each word."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "hi", "there", "die"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def make_router(address: str) -> Router:
    return Router(parse_config({
        "namespace": NAMESPACE,
        "pools": [{"name": "smol", "status": {"servingRevision": REVISION},
                   "endpoints": {REVISION: [address]}, "routerToken": "t" * 32}],
        "tenants": [{"tenant": "team-a", "keys": [KEY], "quota": {
            "limits": {"maxConcurrentRequests": 4}, "priorityClass": "high"}}]}))


def shadowing_router(address: str, shadow: str, options: RouterOptions | None = None
                     ) -> Router:
    """All live traffic on REVISION, every request copied to `shadow`; both at `address`."""
    return Router(parse_config({
        "namespace": NAMESPACE,
        "pools": [{"name": "smol", "status": {"servingRevision": REVISION, "traffic": [
            {"revision": REVISION, "role": "stable", "weight": 100},
            {"revision": shadow, "role": "shadow", "shadowPercent": 100}]},
            "endpoints": {REVISION: [address], shadow: [address]}}],
        "tenants": [{"tenant": "team-a", "keys": [KEY], "quota": {}}]}), options)


async def post(router: Router, content: str, **extra: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(router))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        return await client.post("/v1/chat/completions", headers={
            "authorization": f"Bearer {KEY}", **extra.pop("headers", {})}, json={
            "model": "smol", "messages": [{"role": "user", "content": content}], **extra})


async def post_raw(router: Router, content: Any) -> httpx.Response:
    """`content` (bytes, or an async iterator of them) as the body, the key's bearer."""
    transport = httpx.ASGITransport(app=build_app(router))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        return await client.post("/v1/chat/completions", content=content,
                                 headers={"authorization": f"Bearer {KEY}"})


@pytest.mark.asyncio
async def test_the_engine_gets_the_routers_tenant_token_and_at_most_the_quotas_priority(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    address, seen = upstream
    router = make_router(address)
    try:
        for asked, sent in ((-2, -1), (5, 5), (None, -1)):  # high = -1: never more urgent
            extra = {} if asked is None else {"priority": asked}
            resp = await post(router, "hi", headers={"x-kvfleet-tenant": "team-b"}, **extra)
            assert resp.status_code == 200, resp.text
            assert seen[-1]["body"]["priority"] == sent
            headers = {k.lower(): v for k, v in seen[-1]["headers"].items()}
            assert headers["x-kvfleet-tenant"] == "team-a"
            assert headers["x-kvfleet-router-token"] == "t" * 32
            assert "authorization" not in headers  # the tenant's key stays at the router
            assert "model" not in seen[-1]["body"]
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_a_replica_failing_mid_answer_gives_502_and_frees_the_tenants_slot(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    address, _ = upstream
    router = make_router(address)
    try:
        resp = await post(router, "die")
        assert resp.status_code == 502, resp.text
        message = json.loads(resp.text)["error"]["message"]
        assert message.startswith("a replica failed while answering"), message
        assert router.ledger.usage("team-a") == (1, 0, 0)  # nothing in flight, nothing charged
        await asyncio.sleep(0)
        assert all(e.in_flight == 0 for e in router.state.all_endpoints())
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_prompt_tokens_are_counted_with_the_revisions_own_tokenizer(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    address, _ = upstream
    router = make_router(address)
    try:
        words = "hi there " * 30  # 60 words, 270 bytes
        before = await router.tokens.count(REVISION, Prompt([words], 1),
                                           [EndpointLoad(address)])
        assert before == 270 // 3 + 4  # not fetched yet: the upper bound
        for _ in range(100):
            if router.tokens.known(REVISION):
                break
            await asyncio.sleep(0.02)
        engines = [EndpointLoad(address)]
        assert await router.tokens.count(REVISION, Prompt([words], 1), engines) == 60 + 4
        assert await router.tokens.count(REVISION, Prompt([words, "hi"], 2), engines) == 61 + 8
        # Token ids are counted, not tokenized (as one text of numbers they were).
        ids = texts_of({"prompt": [[1, 2, 3], [4, 5]]})
        assert (ids.texts, ids.ids, ids.text) == ([], 5, "1 2 3")
        assert await router.tokens.count(REVISION, ids, engines) == 5
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_a_shadow_copy_whose_replica_fails_is_counted_and_releases_its_slot(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    address, _ = upstream
    shadow = "b" * 64
    router = shadowing_router(address, shadow)
    try:
        assert (await post(router, "die", temperature=0)).status_code == 502
        await asyncio.gather(*router._tasks)
        assert router._shadow_in_flight == 0
        text = router.metrics.exposition().decode()
        assert 'kvfleet_router_shadow_comparisons_total{namespace="llm",outcome="error",' \
            f'pool="smol",revision="{shadow[:12]}"}} 1.0' in text
        # The shadow's replica went away mid-answer: no engine answered.
        assert sample(router, "kvfleet_router_requests_total", traffic="shadow",
                      revision=shadow[:12], outcome="upstream_error") == 1
    finally:
        await router.close()


REQUESTS = "kvfleet_router_requests_total"
TTFT = "kvfleet_router_time_to_first_token_seconds"
TPOT = "kvfleet_router_time_per_output_token_seconds"
E2E = "kvfleet_router_e2e_request_latency_seconds"


def sample(router: Router, name: str, **labels: str) -> float | None:
    """A sample of the router's registry, by default the live stable series of `llm/smol`,
    summed over the labels not given (e.g. prompt_class); None when no series matches."""
    wanted = {**LIVE, **labels}
    values = [s.value for family in router.metrics.registry.collect() for s in family.samples
              if s.name == name and wanted.items() <= s.labels.items()]
    return sum(values) if values else None


def observed(router: Router, histogram: str, part: str = "_count", **labels: str) -> float:
    """How many times the live stable series of a histogram was observed (`part` "_sum": the
    sum of the observations), over every prompt class unless `prompt_class` is given."""
    want = {**LIVE, **labels}
    return sum(s.value for family in router.metrics.registry.collect() for s in family.samples
               if s.name == histogram + part
               and all(s.labels.get(k) == v for k, v in want.items()))


def outcomes(router: Router, **labels: str) -> dict[str, float]:
    """The outcomes counted so far (the zeros every outcome starts at left out)."""
    counts = {o.value: sample(router, REQUESTS, **labels, outcome=o.value) for o in Outcome}
    return {o: n for o, n in counts.items() if n}


@pytest.mark.asyncio
async def test_an_error_frame_inside_a_200_is_a_stream_error_and_never_the_first_token(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    address, _ = upstream
    router = make_router(address)
    try:
        resp = await post(router, "error-frame", stream=True)
        assert resp.status_code == 200
        assert '"code": "internal_error"' in resp.text  # the client sees the error frame
        assert outcomes(router) == {"stream_error": 1}
        # Timed at the first text, not at the role-only delta sent ROLE_GAP before it.
        assert observed(router, TTFT) == 1
        assert observed(router, TTFT, "_sum") >= ROLE_GAP
        assert observed(router, E2E) == 1
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_finish_reason_error_is_a_stream_error_streamed_or_not(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    address, _ = upstream
    router = make_router(address)
    try:
        for streamed in (True, False):
            assert (await post(router, "finish-error", stream=streamed)).status_code == 200
        assert outcomes(router) == {"stream_error": 2}
        assert observed(router, E2E) == 2  # non-streamed answers are timed too
        assert observed(router, TPOT) == 0  # one token: no time between tokens
        assert (await post(router, "fine", stream=True)).status_code == 200
        assert outcomes(router) == {"stream_error": 2, "completed": 1}
        assert observed(router, TPOT) == 1
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_latency_and_outcomes_are_labelled_with_the_prompts_length_class(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    address, _ = upstream
    router = make_router(address)
    try:
        assert (await post(router, "fine")).status_code == 200
        assert (await post(router, "hi " * 700)).status_code == 200  # ~700 tokens
        assert observed(router, E2E, prompt_class="256") == 1
        assert observed(router, E2E, prompt_class="1024") == 1
        # (the error rate is judged per class too: a revision refusing only long prompts)
        assert sample(router, REQUESTS, prompt_class="1024", outcome="completed") == 1
        assert sample(router, REQUESTS, prompt_class="16384", outcome="stream_error") == 0
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_the_engines_refusals_count_against_the_revision_or_the_client(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    address, _ = upstream
    router = make_router(address)
    try:
        too_long = await post(router, "too-long", stream=True)
        assert too_long.status_code == 400  # passed on as the engine wrote it
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        assert (await post(router, "queue")).status_code == 429
        assert (await post(router, "bad-params")).status_code == 400
        assert outcomes(router) == {"revision_refused": 2, "client_error": 1}
        # The revision's refusals are timed (a revision that refuses its slow prompts must
        # not look fast for it); the client's own bad request is not.
        assert observed(router, E2E) == 2
        assert observed(router, TTFT) == 0
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_a_body_that_is_not_json_is_refused_before_any_revision_is_charged(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    address, seen = upstream
    router = make_router(address)
    try:
        resp = await post_raw(router, b"{not json")
        assert resp.status_code == 400 and not seen
        assert router.metrics.registry.get_sample_value(
            "kvfleet_router_rejections_total",
            {"namespace": "-", "pool": "-", "reason": "invalid_request"}) == 1
        assert outcomes(router) == {}
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_every_outcome_counts_from_zero_for_each_revision_a_table_routes_to() -> None:
    stable, canary, shadow, next_canary = "a" * 64, "b" * 64, "c" * 64, "d" * 64

    def config(canary_revision: str) -> dict[str, Any]:
        return {"namespace": NAMESPACE, "pools": [{"name": "smol", "status": {
            "servingRevision": stable, "traffic": [
                {"revision": stable, "role": "stable", "weight": 90},
                {"revision": canary_revision, "role": "canary", "weight": 10},
                {"revision": shadow, "role": "shadow", "shadowPercent": 10}]}}]}

    router = Router(parse_config(config(canary)))
    try:
        for revision, traffic in ((stable, "live"), (canary, "live"), (shadow, "shadow")):
            for outcome in Outcome:
                assert sample(router, REQUESTS, revision=revision[:12], traffic=traffic,
                              outcome=outcome.value) == 0, (revision, traffic, outcome)
        # Only the traffic a revision can get: no live series for the shadow revision.
        assert sample(router, REQUESTS, revision=shadow[:12], outcome="completed") is None
        router.update(parse_config(config(next_canary)))
        assert sample(router, REQUESTS, revision=next_canary[:12], outcome="stream_error") == 0
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_a_stream_asks_the_engine_for_its_running_usage_on_every_chunk(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    address, seen = upstream
    router = make_router(address)
    try:
        await post(router, "fine", stream=True, stream_options={"include_usage": True})
        assert seen[-1]["body"]["stream_options"] == {"include_usage": True,
                                                      "continuous_usage_stats": True}
        await post(router, "fine")  # not streamed: its usage comes with the answer
        assert "stream_options" not in seen[-1]["body"]
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_a_client_cannot_choose_which_requests_are_mirrored(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    """The shadow draw is the router's own: one x-request-id sent 40 times is mirrored about
    half the time at a 50 % shadow, not always or never."""
    address, seen = upstream
    router = Router(parse_config({
        "namespace": NAMESPACE,
        "pools": [{"name": "smol", "status": {"servingRevision": REVISION, "traffic": [
            {"revision": REVISION, "role": "stable", "weight": 100},
            {"revision": "c" * 64, "role": "shadow", "shadowPercent": 50}]},
            "endpoints": {REVISION: [address], "c" * 64: [address]}}],
        "tenants": [{"tenant": "team-a", "keys": [KEY], "quota": {}}]}))
    try:
        for _ in range(40):
            assert (await post(router, "fine", headers={"x-request-id": "same"})).status_code \
                == 200
        await asyncio.sleep(0.5)  # (the copies finish in the background)
        mirrored = len(seen) - 40
        assert 6 <= mirrored <= 34, mirrored
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_a_stream_flag_that_is_not_a_boolean_is_refused_and_a_whole_answer_billed(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    """`"stream": "false"` is truthy to the router and false to a lenient engine: the answer
    was a JSON body, read for stream frames, billed 0 output tokens. Now a 400 names the field,
    and a whole answer to a streamed request is billed by its usage all the same."""
    address, seen = upstream
    router = make_router(address)
    try:
        for flag in ("false", "true", 0, None):
            resp = await post(router, "fine", stream=flag)
            assert resp.status_code == 400, (flag, resp.text)
            assert resp.json()["error"]["param"] == "stream"
        assert not seen  # refused before any engine saw it
        resp = await post(router, "plain", stream=True)  # the fake engine answers whole
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 1
        assert sample(router, "kvfleet_router_tokens_total", revision=REVISION[:12],
                      traffic="live", kind="generation") == 1
    finally:
        await router.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_canary_whose_replicas_are_gone_leaves_its_clients_to_stable(
    upstream: tuple[str, list[dict[str, Any]]], stream: bool,
) -> None:
    """Seen in the rollout e2e: a rolled-back canary's engine, draining, refused with 503
    while this router still sent it live requests, and a client got "no replica answered"."""
    address, _ = upstream
    canary = "b" * 64
    with socket.socket() as closed:  # a port nobody listens on: the canary pod is gone
        closed.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{closed.getsockname()[1]}"
    router = Router(parse_config({
        "namespace": NAMESPACE,
        "pools": [{"name": "smol", "status": {"servingRevision": REVISION, "traffic": [
            {"revision": REVISION, "role": "stable", "weight": 0},
            {"revision": canary, "role": "canary", "weight": 100}]},
            "endpoints": {REVISION: [address], canary: [gone]}}],
        "tenants": [{"tenant": "team-a", "keys": [KEY], "quota": {
            "limits": {"maxConcurrentRequests": 4}}}]}))
    try:
        resp = await post(router, "fine" if stream else "hi", stream=stream)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvfleet-revision"] == REVISION[:12]
        # The canary's failure is the canary's: counted against it, not lost.
        assert sample(router, REQUESTS, revision=canary[:12], outcome="upstream_error") == 1
        assert sample(router, REQUESTS, outcome="completed") == 1
        assert router.ledger.usage("team-a")[0] == 1  # one request, charged once
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_a_quiet_pool_in_a_judged_step_gets_the_routers_own_requests(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    """With probe prompts in its status (a Rollout's analysis.probePrompts), a pool whose live
    requests arrive slower than the rate gets synthetic ones, routed by the table and counted
    as traffic "synthetic"; live requests count first, and a pool out of its step gets none."""
    address, seen = upstream
    canary = "b" * 64
    status: dict[str, Any] = {
        "servingRevision": REVISION,
        "traffic": [{"revision": REVISION, "role": "stable", "weight": 50},
                    {"revision": canary, "role": "canary", "weight": 50}],
        "syntheticTraffic": {"prompts": ["fine"], "ratePerSecond": 4, "maxTokens": 8}}
    config = {"namespace": NAMESPACE,
              "pools": [{"name": "smol", "status": status,
                         "endpoints": {REVISION: [address], canary: [address]}}],
              "tenants": [{"tenant": "team-a", "keys": [KEY], "quota": {}}]}
    config["pools"].append({"name": "other", "status": {"servingRevision": REVISION},
                            "endpoints": {REVISION: [address]}})  # (no rollout: none)
    router = Router(parse_config(config))
    try:
        for _ in range(6):  # three seconds at 4 a second, nothing live: 12 of its own
            router.synthesize(0.5)
            await asyncio.sleep(ROLE_GAP + 0.2)  # (each answered before the next tick)
        mine = [r for r in seen if r["headers"].get("x-kvfleet-tenant") == "kvfleet-synthetic"]
        assert len(mine) == 12 and all(r["body"]["stream"] and r["body"]["max_tokens"] == 8
                                       for r in mine)
        counted = {rev: sample(router, REQUESTS, revision=rev[:12], traffic="synthetic",
                               outcome="completed") for rev in (REVISION, canary)}
        assert sum(counted.values()) == 12 and all(counted.values()), counted  # both got some
        assert sample(router, REQUESTS, traffic="live") == 0
        # Live requests at the rate or over it leave nothing to make up.
        for _ in range(4):
            assert (await post(router, "hi")).status_code == 200
        router.synthesize(0.5)
        await asyncio.sleep(0.1)
        assert len([r for r in seen if r["headers"].get("x-kvfleet-tenant") ==
                    "kvfleet-synthetic"]) == 12
    finally:
        await router.close()
    del status["syntheticTraffic"]
    idle = Router(parse_config(config))
    try:
        idle.synthesize(5.0)
        await asyncio.sleep(0.1)
        assert len([r for r in seen if r["headers"].get("x-kvfleet-tenant") ==
                    "kvfleet-synthetic"]) == 12
    finally:
        await idle.close()


@pytest.mark.asyncio
async def test_metrics_are_served_on_their_own_port_never_to_clients(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    """The series name pools, revisions and a salted prompt id: Prometheus's, on the metrics
    port (`--metrics-port`); the clients' app answers 404."""
    address, _ = upstream
    router = Router(parse_config({
        "namespace": NAMESPACE,
        "pools": [{"name": "smol", "status": {"servingRevision": REVISION},
                   "endpoints": {REVISION: [address]}}],
        "tenants": [{"tenant": "team-a", "keys": [KEY], "quota": {}}]}))
    try:
        assert (await post(router, "hi")).status_code == 200
        for app, expected in ((build_app(router), 404), (build_metrics_app(router), 200)):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
                resp = await client.get("/metrics")
            assert resp.status_code == expected
        assert "kvfleet_router_requests_total{" in resp.text
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_answers_are_checked_for_broken_signs_only_while_a_canary_has_traffic(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    """Both revisions' completed answers, streamed or whole, are checked while the pool is in
    a canary step (kvfleet.router.answers); outside one nothing is parsed for it."""
    address, _ = upstream
    canary = "b" * 64

    def router_with(traffic: list[dict[str, Any]]) -> Router:
        return Router(parse_config({
            "namespace": NAMESPACE,
            "pools": [{"name": "smol", "status": {"servingRevision": REVISION,
                                                  "traffic": traffic},
                       "endpoints": {REVISION: [address], canary: [address]}}],
            "tenants": [{"tenant": "team-a", "keys": [KEY], "quota": {
                "limits": {"maxConcurrentRequests": 4}}}]}))

    router = router_with([{"revision": REVISION, "role": "stable", "weight": 0},
                          {"revision": canary, "role": "canary", "weight": 100}])
    checked, flags = "kvfleet_router_answers_checked_total", "kvfleet_router_answer_flags_total"
    try:
        for content, streamed in (("loop", True), ("fine", True), ("hi", False),
                                  ("error-frame", True)):
            resp = await post(router, content, stream=streamed)
            assert resp.status_code == 200, resp.text
        # The client's own shaping (a stop sequence) says nothing of the revision: unchecked.
        assert (await post(router, "loop", stream=True, stop=["x"])).status_code == 200
        on = {"revision": canary[:12]}
        assert sample(router, checked, **on) == 3  # (the stream that failed is no answer)
        assert sample(router, flags, **on, flag="looping") == 1
        assert sample(router, flags, **on, flag="unfinished") == 1
        assert sample(router, flags, **on, flag="empty") == 0
        assert sample(router, checked) == 0  # stable: declared at 0, no answer of its own
    finally:
        await router.close()
    quiet = router_with([])
    try:
        assert (await post(quiet, "loop", stream=True)).status_code == 200
        assert not sample(quiet, checked)
    finally:
        await quiet.close()


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[tuple[str, Any]]:
    """The real engine's HTTP app on loopback, over a fake core with a 64-token context."""
    import uvicorn
    from server_fakes import chat_template, make_engine

    from kvfleet.engine.lifecycle import Lifecycle, warm_up
    from kvfleet.engine.router_token import RouterTokens
    from kvfleet.engine.server import ServerSettings, Serving, create_app

    core_engine, core = make_engine(max_context=64)
    core_engine.start()
    lifecycle = Lifecycle()
    await warm_up(core_engine, lifecycle, (1, 2, 3))
    app = create_app(Serving(lifecycle, core_engine, chat_template()),
                     ServerSettings(router_token=RouterTokens("t" * 32)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"127.0.0.1:{port}", core
    finally:
        server.should_exit = True
        await task
        await core_engine.stop()


async def idle(core: Any) -> None:
    """Until the fake core has stopped stepping."""
    while True:
        steps = core.num_steps
        await asyncio.sleep(0.05)
        if core.num_steps == steps:
            return


@pytest.mark.asyncio
async def test_the_real_engines_answers_get_their_outcomes(engine: tuple[str, Any]) -> None:
    address, core = engine
    router = make_router(address)
    try:
        ok = await post(router, "hi", stream=True, max_tokens=3)
        assert ok.status_code == 200 and "[DONE]" in ok.text
        assert outcomes(router) == {"completed": 1}
        assert observed(router, TTFT) == 1
        too_long = await post(router, "hi " * 40, max_tokens=8)  # 120 tokens > 64
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        unsupported = await post(router, "hi", n=2)
        assert unsupported.json()["error"]["code"] == "unsupported_parameter"
        assert outcomes(router) == {"completed": 1, "revision_refused": 1, "client_error": 1}
        for streamed in (True, False):
            await idle(core)  # (after a failed step the engine steps once more, idle)
            core.fail_next_step = True  # the engine ends the answer with finish_reason error
            failed = await post(router, "hi", stream=streamed, max_tokens=3)
            assert failed.status_code == 200 and '"error"' in failed.text
        assert outcomes(router)["stream_error"] == 2
        assert observed(router, TTFT) == 1  # the error frames carried no text
    finally:
        await router.close()
    wrong_token = Router(parse_config({
        "namespace": NAMESPACE,
        "pools": [{"name": "smol", "status": {"servingRevision": REVISION},
                   "endpoints": {REVISION: [address]}, "routerToken": "x" * 32}],
        "tenants": [{"tenant": "team-a", "keys": [KEY], "quota": {}}]}))
    try:
        # The engine refused the router's token: the replica's fault, not the client's key
        # (a 401 told the client its key was wrong); the replica is shunned for a while.
        refused = await post(wrong_token, "hi")
        assert refused.status_code == 503 and "refused the router's token" in refused.text
        assert outcomes(wrong_token) == {"upstream_error": 1}
        (endpoint,) = wrong_token.state.all_endpoints()
        assert endpoint.score(endpoint.refused_at or 0.0, 1e9) == float("inf")
    finally:
        await wrong_token.close()


@pytest.mark.asyncio
async def test_a_body_over_the_limit_is_413_whether_declared_or_chunked() -> None:
    from kvfleet.router.server import MAX_BODY_BYTES

    router = make_router("127.0.0.1:9")
    try:
        transport = httpx.ASGITransport(app=build_app(router))
        headers = {"authorization": f"Bearer {KEY}"}
        big = b'{"model": "smol", "prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'

        async def chunked() -> AsyncIterator[bytes]:
            for start in range(0, len(big), 65536):
                yield big[start:start + 65536]

        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            for content in (big, chunked()):
                resp = await client.post("/v1/completions", content=content, headers=headers)
                assert resp.status_code == 413, resp.text
                assert resp.json()["error"]["code"] == "request_too_large"
        assert router.ledger.usage("team-a") == (0, 0, 0)  # nothing admitted
    finally:
        await router.close()


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                     allow_infinity=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) |
                     st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", 3]),
                                             "content": _JSON}), max_size=3) | _JSON
_BODIES = st.fixed_dictionaries({"model": st.sampled_from(["smol", "smol", 3, None])}, optional={
    "messages": _MESSAGES, "prompt": _JSON, "max_tokens": st.integers(-2, 10) | _JSON,
    "max_completion_tokens": _JSON, "stream": st.booleans() | _JSON, "stream_options": _JSON,
    "user": _JSON, "temperature": _JSON, "priority": st.integers(-5, 5) | _JSON}) | _JSON


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_BODIES, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
@example(body={"model": "smol", "messages": 5}, path="/v1/chat/completions")
@example(body={"model": "smol", "messages": ["hi"]}, path="/v1/chat/completions")
def test_no_body_a_client_can_send_makes_the_router_fail_with_a_5xx(
        body: object, path: str) -> None:
    """Every malformed body is the client's 4xx (a non-list `messages` was a 500). What is
    well formed gets a 503 here: its pool's one replica is a closed port."""
    async def send() -> int:
        router = make_router("127.0.0.1:9")
        try:
            transport = httpx.ASGITransport(app=build_app(router))
            async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
                resp = await client.post(path, json=body,
                                         headers={"authorization": f"Bearer {KEY}"})
            assert router.ledger.usage("team-a")[2] == 0  # nothing left in flight
            return resp.status_code
        finally:
            await router.close()

    status = asyncio.run(send())
    assert status in (400, 404, 413, 429, 503), (status, body)


@pytest.mark.asyncio
async def test_a_spent_key_is_refused_before_its_body_is_read(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    """A key at its request limit sends a body that never ends: the 429 comes at once (the
    router neither buffers nor parses what the quota would refuse anyway)."""
    address, seen = upstream
    router = Router(parse_config({
        "namespace": NAMESPACE,
        "pools": [{"name": "smol", "status": {"servingRevision": REVISION},
                   "endpoints": {REVISION: [address]}}],
        "tenants": [{"tenant": "team-a", "keys": [KEY],
                     "quota": {"limits": {"requestsPerMinute": 1}}}]}))

    async def endless() -> AsyncIterator[bytes]:
        yield b'{"model": "smol", "messages": [' + b"{}, " * 100_000
        await asyncio.sleep(3600)  # the rest never comes
        yield b"]}"

    try:
        assert (await post(router, "fine")).status_code == 200
        resp = await asyncio.wait_for(post_raw(router, endless()), 10)
        assert resp.status_code == 429 and "requestsPerMinute" in resp.text, resp.text
        assert len(seen) == 1 and router.ledger.usage("team-a")[2] == 0
    finally:
        await router.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(("raw", "says"), [
    (b'{"model": "smol", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "deeply"),
    (b'{"model": "smol", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
     "messages: the text holds a lone surrogate"),
    (b'{"model": "smol", "prompt": "\\udfff"}', "prompt: the text holds a lone surrogate"),
    # Structure that parses into far more memory than its bytes: refused before parsing.
    (b'{"model": "smol", "messages": [' + b",".join([b"{}"] * 100_001) + b"]}",
     "more than 100000 JSON objects and arrays"),
    (b'{"model": "smol", "prompt": [' + b",".join([b"[]"] * 100_001) + b"]}",
     "more than 100000 JSON objects and arrays"),
    (b'{"model": "smol", "prompt": [[], []]}', "non-empty lists of token ids"),
])
async def test_bodies_that_broke_the_parser_or_the_tokenizer_are_the_clients_400(
    upstream: tuple[str, list[dict[str, Any]]], raw: bytes, says: str,
) -> None:
    address, seen = upstream
    router = make_router(address)
    try:
        resp = await post_raw(router, raw)
        assert resp.status_code == 400 and says in resp.json()["error"]["message"], resp.text
        assert not seen and router.ledger.usage("team-a")[2] == 0
    finally:
        await router.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [True, False])
async def test_a_stalled_engine_fails_the_request_in_time_and_frees_the_tenants_slot(
    upstream: tuple[str, list[dict[str, Any]]], stream: bool,
) -> None:
    """There was no upstream read timeout: a hung engine held the client, the replica's
    in-flight count and the tenant's concurrency slot for ever."""
    address, _ = upstream
    router = make_router(address)
    router.options = RouterOptions(stream_idle_timeout=0.5, answer_timeout=0.5, max_attempts=1)
    try:
        started = asyncio.get_running_loop().time()
        resp = await asyncio.wait_for(post(router, "stall", stream=stream), 10)
        took = asyncio.get_running_loop().time() - started
        assert took < 3, took
        if stream:
            assert resp.status_code == 200
            assert '"code": "upstream_failed"' in resp.text and "Timeout" in resp.text
        else:  # its status line came, its body never
            assert resp.status_code == 502 and "Timeout" in resp.json()["error"]["message"]
        assert router.ledger.usage("team-a")[2] == 0  # the slot is free again
        assert all(e.in_flight == 0 for e in router.state.all_endpoints())
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_a_replica_whose_metrics_page_errs_is_not_read_as_idle() -> None:
    broken = {"now": False}

    async def metrics(_: web.Request) -> web.Response:
        if broken["now"]:
            return web.Response(status=500, text="kvfleet_engine_requests_waiting 0\n")
        return web.Response(text="kvfleet_engine_requests_waiting 3\n"
                                 "kvfleet_engine_requests_running 2\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    router = make_router(f"127.0.0.1:{port}")
    try:
        (endpoint,) = router.state.all_endpoints()
        await router._scrape(endpoint)
        assert (endpoint.waiting, endpoint.running, endpoint.failures) == (3, 2, 0)
        broken["now"] = True
        await router._scrape(endpoint)
        assert endpoint.failures == 1 and endpoint.score(0, 1.0) == float("inf")
    finally:
        await router.close()
        await runner.cleanup()


@pytest.mark.asyncio
async def test_a_stalled_shadow_copy_frees_its_slot(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    """A shadow revision that hangs held every shadow slot for ever: no more shadow traffic,
    and the replica's in-flight count never came down."""
    address, _ = upstream
    shadow = "c" * 64
    # The live copy stalls too here (one fake engine): only the shadow's slot is watched.
    router = shadowing_router(address, shadow,
                              RouterOptions(shadow_timeout=0.5, answer_timeout=5))
    try:
        task = asyncio.ensure_future(post(router, "stall"))
        await asyncio.sleep(0.2)
        assert router._shadow_in_flight == 1
        await asyncio.sleep(1.0)
        assert router._shadow_in_flight == 0
        assert sample(router, REQUESTS, revision=shadow[:12], traffic="shadow",
                      outcome="upstream_error") == 1
        await task
        assert all(e.in_flight == 0 for e in router.state.all_endpoints())
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_a_stream_whose_client_hangs_up_lets_go_of_the_replica_at_once(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    """The router's own ASGI relay (not Starlette's): a client gone after the first chunk
    ends the relay at once, while the engine is still mid-answer (it stalls for 3 s), and
    frees the replica's in-flight count and the tenant's slot."""
    address, _ = upstream
    router = make_router(address)
    body = json.dumps({"model": "smol", "stream": True,
                       "messages": [{"role": "user", "content": "stall"}]}).encode()
    requests = [{"type": "http.request", "body": body, "more_body": False}]
    relayed = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if requests:
            return requests.pop()
        await relayed.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message.get("body"):
            relayed.set()

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "query_string": b"", "headers": [(b"authorization", f"Bearer {KEY}".encode())]}
    try:
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(build_app(router)(scope, receive, send), 10)
        assert asyncio.get_running_loop().time() - started < 1.5
        assert sent[0]["status"] == 200 and b"Hel" in sent[1]["body"]
        assert router.ledger.usage("team-a")[2] == 0
        assert all(e.in_flight == 0 for e in router.state.all_endpoints())
        # The other methods on a completion path still get a 405.
        transport = httpx.ASGITransport(app=build_app(router))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            assert (await client.get("/v1/chat/completions")).status_code == 405
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_a_client_is_told_no_replica_answered_but_not_where_the_replicas_are() -> None:
    router = make_router("127.0.0.1:9")  # a closed port
    try:
        resp = await post(router, "fine")
        assert resp.status_code == 503 and "no replica answered" in resp.text
        assert "127.0.0.1" not in resp.text, resp.text
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_a_body_that_never_arrives_is_a_408_and_gives_its_budget_back(
    upstream: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Announced and never sent, it held its tenant's intake budget for ever: four keys'
    worth of them refused every tenant."""
    from kvfleet.router import server

    monkeypatch.setattr(server, "BODY_SECONDS", 0.3)
    address, seen = upstream
    router = make_router(address)

    async def trickle() -> AsyncIterator[bytes]:
        yield b'{"model": "smol", '
        await asyncio.sleep(5)
        yield b"}"

    try:
        resp = await post_raw(router, trickle())
        assert resp.status_code == 408 and resp.json()["error"]["code"] == "body_timeout"
        assert router.intake.held == {} and router.intake.held_total == 0 and not seen
    finally:
        await router.close()
