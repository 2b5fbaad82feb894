"""The router's HTTP edge against a fake engine on loopback (the real engine: the integration
tests): what reaches the engine, and what a failing engine leaves behind."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from aiohttp import web
from tokenizers import Tokenizer, models, pre_tokenizers

from kvfleet.router.server import Router, build_app
from kvfleet.router.state import parse_config

REVISION = "a" * 64
KEY = "sk-team-a-0123456789abcdef"


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
        return web.json_response({"id": "x", "choices": [{"message": {"content": "ok"}}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1}})

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
        "pools": [{"name": "smol", "status": {"servingRevision": REVISION},
                   "endpoints": {REVISION: [address]}, "routerToken": "t" * 32}],
        "tenants": [{"tenant": "team-a", "keys": [KEY], "quota": {
            "limits": {"maxConcurrentRequests": 4}, "priorityClass": "high"}}]}))


async def post(router: Router, content: str, **extra: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(router))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        return await client.post("/v1/chat/completions", headers={
            "authorization": f"Bearer {KEY}", **extra.pop("headers", {})}, json={
            "model": "smol", "messages": [{"role": "user", "content": content}], **extra})


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
        assert json.loads(resp.text)["error"]["message"].startswith("the replica")
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
        before = router.tokens.count(REVISION, [words], 1, [address])
        assert before == 270 // 3 + 4  # not fetched yet: the upper bound
        for _ in range(100):
            if router.tokens.known(REVISION):
                break
            await asyncio.sleep(0.02)
        assert router.tokens.count(REVISION, [words], 1, [address]) == 60 + 4
        assert router.tokens.count(REVISION, [words, "hi"], 2, [address]) == 61 + 8
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_a_shadow_copy_whose_replica_fails_is_counted_and_releases_its_slot(
    upstream: tuple[str, list[dict[str, Any]]],
) -> None:
    address, _ = upstream
    shadow = "b" * 64
    router = Router(parse_config({
        "pools": [{"name": "smol", "status": {"servingRevision": REVISION, "traffic": [
            {"revision": REVISION, "role": "stable", "weight": 100},
            {"revision": shadow, "role": "shadow", "shadowPercent": 100}]},
            "endpoints": {REVISION: [address], shadow: [address]}}],
        "tenants": [{"tenant": "team-a", "keys": [KEY]}]}))
    try:
        assert (await post(router, "die", temperature=0)).status_code == 502
        await asyncio.gather(*router._tasks)
        assert router._shadow_in_flight == 0
        text = router.metrics.exposition().decode()
        assert 'kvfleet_router_shadow_comparisons_total{outcome="error",pool="smol",' \
            f'revision="{shadow[:12]}"}} 1.0' in text
    finally:
        await router.close()
