"""The router's greedy probes against two fake engines on loopback (stable, and a canary that
answers the same or not): what each engine is asked, what is counted, what is never billed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp_fakes import serving

from kvfleet.router.probes import PROBE_TENANT, probe_id
from kvfleet.router.server import Router, build_app
from kvfleet.router.state import parse_config

STABLE, CANARY = "a" * 64, "b" * 64
KEY = "sk-team-a-0123456789abcdef"
PROBED = {"namespace": "llm", "pool": "smol", "revision": CANARY[:12]}


def _engine(ids: list[int], seen: list[dict[str, Any]], revision: str) -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append({"body": body, "headers": dict(request.headers)})
        return web.json_response({"system_fingerprint": revision, "choices": [{
            "message": {"content": "x"}, "finish_reason": "length",
            "token_ids": ids if body.get("return_token_ids") else None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(ids)}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest_asyncio.fixture
async def engines() -> AsyncIterator[dict[str, Any]]:
    seen: dict[str, list[dict[str, Any]]] = {"stable": [], "same": [], "wrong": [],
                                             "impostor": []}
    answers = {"stable": [1, 2, 3, 4], "same": [1, 2, 3, 4], "wrong": [1, 9, 9, 9],
               "impostor": [1, 2, 3, 4]}
    # What each engine says it serves: the impostor is stable's model at a canary address.
    says = {"stable": STABLE, "same": CANARY, "wrong": CANARY[:12], "impostor": STABLE[:12]}
    async with contextlib.AsyncExitStack() as stack:
        ports = {name: await stack.enter_async_context(serving(
                 _engine(ids, seen[name], says[name]))) for name, ids in answers.items()}
        yield {"seen": seen, **{name: f"127.0.0.1:{port}" for name, port in ports.items()}}


def _router(stable: str, canary: str, probe_percent: int = 100) -> Router:
    return Router(parse_config({
        "namespace": "llm",
        "pools": [{"name": "smol", "status": {"servingRevision": STABLE, "traffic": [
            {"revision": STABLE, "role": "stable", "weight": 50},
            {"revision": CANARY, "role": "canary", "weight": 50,
             "probePercent": probe_percent}]},
            "endpoints": {STABLE: [stable], CANARY: [canary]}}],
        "tenants": [{"tenant": "team-a", "keys": [KEY],
                     "quota": {"limits": {"outputTokensPerMinute": 100000}}}]}))


async def _send(router: Router, n: int) -> None:
    transport = httpx.ASGITransport(app=build_app(router))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        for i in range(n):
            r = await client.post("/v1/chat/completions", headers={
                "authorization": f"Bearer {KEY}"}, json={
                "model": "smol", "messages": [{"role": "user", "content": f"q{i}"}],
                "temperature": 0.9, "max_tokens": 300, "stream": False, "user": f"c{i}"})
            assert r.status_code == 200
    await asyncio.gather(*router._tasks)


def _count(router: Router, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, {**PROBED, **labels}) or 0.0


@pytest.mark.asyncio
async def test_identical_answers_agree_on_every_token(engines: dict[str, Any]) -> None:
    router = _router(engines["stable"], engines["same"])
    try:
        # Counters exist at 0 before any probe, so the first window's increase() sees them.
        assert router.metrics.registry.get_sample_value(
            "kvfleet_router_probes_total", {**PROBED, "outcome": "compared"}) == 0.0
        await _send(router, 6)
        assert _count(router, "kvfleet_router_probes_total", outcome="compared") == 6
        agreed = _count(router, "kvfleet_router_probe_tokens_total", kind="agreed")
        assert agreed == _count(router, "kvfleet_router_probe_tokens_total",
                                kind="compared") == 24
        assert _count(router, "kvfleet_router_probes_agreed_total") == 6  # each in full
        assert "probe_first_divergence{" not in router.metrics.exposition().decode()
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_a_wrong_canary_scores_low_and_names_its_first_diverging_prompt(
        engines: dict[str, Any]) -> None:
    router = _router(engines["stable"], engines["wrong"])
    try:
        await _send(router, 5)
        assert _count(router, "kvfleet_router_probe_tokens_total", kind="agreed") == 5
        assert _count(router, "kvfleet_router_probe_tokens_total", kind="compared") == 20
        assert _count(router, "kvfleet_router_probes_agreed_total") == 0
        diverged = [s for m in router.metrics.registry.collect() for s in m.samples
                    if s.name == "kvfleet_router_probe_first_divergence"]
        assert len(diverged) == 1 and diverged[0].value == 1  # one series, not one per probe
        assert diverged[0].labels["probe"] in {probe_id("team-a", f"q{i}") for i in range(5)}
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_probes_are_greedy_capped_never_billed_and_go_to_both_revisions(
        engines: dict[str, Any]) -> None:
    router = _router(engines["stable"], engines["same"])
    try:
        await _send(router, 4)
        seen = engines["seen"]
        probes = [r for name in ("stable", "same") for r in seen[name]
                  if r["headers"].get("x-kvfleet-traffic") == "probe"]
        assert len([p for p in seen["stable"] if p in probes]) == 4
        assert len([p for p in seen["same"] if p in probes]) == 4
        for probe in probes:
            assert probe["headers"]["x-kvfleet-tenant"] == PROBE_TENANT
            assert probe["body"]["temperature"] == 0.0 and probe["body"]["max_tokens"] == 32
            assert probe["body"]["return_token_ids"] is True and probe["body"]["priority"] == 1000
        # Billed: the 4 live requests (3 prompt + 4 output tokens each), none of the 8 probes.
        assert router.ledger.usage("team-a") == (4, 28, 0)
        assert router.ledger.usage(PROBE_TENANT) is None
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_probes_are_shed_beyond_their_in_flight_cap(engines: dict[str, Any]) -> None:
    router = _router(engines["stable"], engines["same"])
    router._probes_in_flight = router.options.probe_max_in_flight  # the cap is taken
    try:
        await _send(router, 3)
        assert _count(router, "kvfleet_router_probes_total", outcome="shed") == 3
        assert _count(router, "kvfleet_router_probes_total", outcome="compared") == 0
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_a_probe_answered_by_another_revision_is_not_compared(
        engines: dict[str, Any]) -> None:
    """An engine of stable's revision at the canary's address (an address reused by another
    pod, a pod labelled what it is not) would make every probe pair agree, and pass a wrong
    canary: each answer's system_fingerprint must name the revision asked."""
    router = _router(engines["stable"], engines["impostor"])
    try:
        await _send(router, 4)
        assert _count(router, "kvfleet_router_probes_total", outcome="misrouted") == 4
        assert _count(router, "kvfleet_router_probes_total", outcome="compared") == 0
        assert _count(router, "kvfleet_router_probe_tokens_total", kind="compared") == 0
    finally:
        await router.close()
