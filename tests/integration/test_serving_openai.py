"""A real `kvfleet serve` process with SmolLM2: the official `openai` client in both modes,
stream framing, disconnects, idempotency, deadlines and admission errors.

Budget: ~90 s on 2 CPU cores (one server for the module; every generation is short).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from engine_server import EngineServer, running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

@pytest.fixture(scope="module")
def server() -> Iterator[EngineServer]:
    with running_server("--num-kv-blocks", "256", "--max-in-flight-per-tenant", "3",
                        "--shared-prefix-tenants", "team-a,team-b") as s:
        yield s


@pytest.fixture
def client(server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def data_events(response: httpx.Response, limit: int | None = None) -> list[dict[str, Any]]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: {"):
            events.append(json.loads(line[len("data: "):]))
            if limit is not None and len(events) >= limit:
                break
    return events


def test_openai_client_completions_stream_and_not(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": client.models.list().data[0].id,
                              "prompt": "The capital of France is", "max_tokens": 8,
                              "temperature": 0}
    full = client.completions.create(**kwargs)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage is not None and full.usage.completion_tokens <= 8
    assert full.system_fingerprint and full.system_fingerprint.startswith("sha256:")
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_openai_client_chat_stream_and_not(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1",
                                          messages=messages, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    assert text and "Paris" in text
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1",
                                            messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].system_fingerprint == full.system_fingerprint


def test_every_stream_event_has_the_request_id_and_next_seq(server: EngineServer) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 6, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        events = data_events(r)
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("cmpl-")
    assert events[-1]["usage"]["completion_tokens"] == 6
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_client_disconnect_cancels_and_frees_every_block(server: EngineServer) -> None:
    before = server.metrics()
    body = {"prompt": "Write a long story about a dragon.", "max_tokens": 1000,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        assert len(data_events(r, limit=3)) == 3
    # Leaving the block closed the connection mid-stream.
    after = server.wait_idle(timeout=10)
    assert after["kvfleet_engine_requests_running"] == 0
    assert after["kvfleet_engine_kv_cache_usage_ratio"] == 0
    generated = (after["kvfleet_engine_generation_tokens_total"]
                 - before["kvfleet_engine_generation_tokens_total"])
    assert generated < 100  # cancelled long before max_tokens
    log = [json.loads(line) for line in server.log_lines() if '"request_finished"' in line]
    assert log[-1]["finish_reason"] == "cancelled"
    assert "prompt" not in log[-1] and "output" not in log[-1]  # no text without --log-text


def test_idempotency_key_returns_the_original_result_and_stream(server: EngineServer) -> None:
    url = server.base_url + "/v1/completions"
    body = {"prompt": "List three colors:", "max_tokens": 12, "temperature": 0.9, "seed": 1}
    headers = {"Idempotency-Key": "order-42"}
    first = httpx.post(url, json=body, headers=headers, timeout=60).json()
    tokens = server.metrics()["kvfleet_engine_generation_tokens_total"]
    second = httpx.post(url, json=body, headers=headers, timeout=60).json()
    assert second == first
    assert server.metrics()["kvfleet_engine_generation_tokens_total"] == tokens
    # A stream interrupted by a network failure is resumed by retrying with the same key:
    # the retry replays the same events (same seq numbers) and follows the live request.
    stream_body = {**body, "stream": True, "max_tokens": 24}
    headers = {"Idempotency-Key": "order-43"}
    with httpx.stream("POST", url, json=stream_body, headers=headers, timeout=60) as r:
        head = data_events(r, limit=2)
    with httpx.stream("POST", url, json=stream_body, headers=headers, timeout=60) as r:
        replay = data_events(r)
    assert replay[:2] == head
    assert [e["seq"] for e in replay] == list(range(len(replay)))
    assert replay[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    conflict = httpx.post(url, json={**body, "max_tokens": 3},
                          headers={"Idempotency-Key": "order-42"}, timeout=60)
    assert conflict.status_code == 409


def test_deadline_ends_the_request_with_finish_reason_deadline(server: EngineServer) -> None:
    started = time.monotonic()
    r = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
        "prompt": "Count to a thousand:", "max_tokens": 2000, "ignore_eos": True,
        "deadline_seconds": 1.0})
    assert time.monotonic() - started < 10
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "deadline"
    assert 0 < body["usage"]["completion_tokens"] < 2000
    assert server.wait_idle()["kvfleet_engine_kv_cache_usage_ratio"] == 0


def test_admission_errors(server: EngineServer) -> None:
    url = server.base_url + "/v1/completions"
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 8200}, timeout=30)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "max_tokens")
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 5000}, timeout=30)  # 256 blocks
    assert (r.status_code, r.json()["error"]["code"]) == (400, "kv_capacity_exceeded")
    r = httpx.post(url, content=b'{"prompt": "' + b"a" * (5 << 20) + b'"}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")

    # Three slow requests fill tenant "busy"'s limit; the fourth is told to come back later.
    stop = threading.Event()

    def hold() -> None:
        body = {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url, json=body, headers={"x-kvfleet-tenant": "busy"},
                          timeout=60) as resp:
            for _ in resp.iter_lines():
                if stop.is_set():
                    return

    holders = [threading.Thread(target=hold) for _ in range(3)]
    for t in holders:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while server.metrics()["kvfleet_engine_requests_running"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(url, json={"prompt": "hi"}, headers={"x-kvfleet-tenant": "busy"},
                       timeout=30)
        assert (r.status_code, r.json()["error"]["code"]) == (429, "tenant_concurrency_exceeded")
        assert int(r.headers["retry-after"]) >= 1
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2},
                       headers={"x-kvfleet-tenant": "other"}, timeout=60)
        assert r.status_code == 200
    finally:
        stop.set()
        for t in holders:
            t.join(30)
    assert server.wait_idle()["kvfleet_engine_kv_cache_usage_ratio"] == 0


def test_prefix_cache_is_scoped_per_tenant_unless_shared(server: EngineServer) -> None:
    prompt = "You are a support bot for ACME. " * 12 + "Question: how do I reset it?"

    def cached(tenant: str) -> int:
        r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       headers={"x-kvfleet-tenant": tenant},
                       json={"prompt": prompt, "max_tokens": 1})
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("acme") == 0
    assert cached("acme") > 0  # same tenant: the prefix is reused
    assert cached("globex") == 0  # another tenant never hits acme's blocks
    assert cached("team-a") == 0
    assert cached("team-b") > 0  # named tenants share one scope (--shared-prefix-tenants)


def test_the_models_sampling_defaults_fill_what_a_request_leaves_unset(
        server: EngineServer) -> None:
    """Two revisions that differ only in the artifact's samplingDefaults answer differently:
    one whose defaults are greedy and 6 tokens answers a bare request as an explicit greedy
    6-token request does; the shared server (OpenAI defaults: temperature 1) does not."""
    chat = {"messages": [{"role": "user", "content": "Name three colours."}], "seed": 7}

    def ask(base_url: str, **fields: Any) -> tuple[str, int]:
        body = httpx.post(base_url + "/v1/chat/completions", json={**chat, **fields},
                          timeout=120).json()
        return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]

    defaults = json.dumps({"temperature": 0.0, "topK": 0, "maxTokens": 6})
    with running_server("--num-kv-blocks", "64", "--sampling-defaults", defaults) as greedy:
        bare = ask(greedy.base_url)
        assert bare == ask(greedy.base_url, temperature=0, max_tokens=6)
        assert bare[1] == 6
        # What the request sets wins over the model's defaults.
        assert ask(greedy.base_url, max_tokens=3)[1] == 3
        assert ask(greedy.base_url, temperature=2.0) != bare
    assert ask(server.base_url, max_tokens=6) != bare  # temperature 1 by default, seeded
