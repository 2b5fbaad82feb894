"""The router in front of real `kvfleet serve` engines (two revisions), as separate processes:
keys, quotas, the engines' router proof, revision weights with sticky sessions, streaming,
shadow copies and a config change applied while serving."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from engine_server import EngineServer, free_port, running_kvfleet, running_server

pytestmark = pytest.mark.slow

STABLE, CANARY = "a" * 64, "b" * 64
KEY_A, KEY_B = "sk-team-a-0123456789abcdef", "sk-team-b-0123456789abcdef"
KEY_C = "sk-team-c-0123456789abcdef"
KEY_E = "sk-team-e-0123456789abcdef"
KEY_F = "sk-team-f-0123456789abcdef"
TOKEN = "router-proof-0123456789abcdef0123"


def config(engines: dict[str, EngineServer], canary: int, shadow: int, token_file: Path
           ) -> dict[str, Any]:
    traffic: list[dict[str, Any]] = [{"revision": STABLE, "role": "stable",
                                      "weight": 100 - canary}]
    if canary:
        traffic.append({"revision": CANARY, "role": "canary", "weight": canary})
    if shadow:
        traffic.append({"revision": CANARY, "role": "shadow", "shadowPercent": shadow})
    return {
        "pools": [{"name": "smol", "status": {"servingRevision": STABLE, "traffic": traffic},
                   "endpoints": {rev: [server.base_url.removeprefix("http://")]
                                 for rev, server in engines.items()},
                   "routerTokenFile": str(token_file)}],
        "tenants": [
            {"tenant": "team-a", "keys": [KEY_A],
             "quota": {"limits": {"requestsPerMinute": 1000, "maxConcurrentRequests": 8}}},
            {"tenant": "team-b", "keys": [KEY_B],
             "quota": {"limits": {"requestsPerMinute": 3}, "allowedPools": ["smol"]}},
            {"tenant": "team-c", "keys": [KEY_C],
             "quota": {"limits": {"inputTokensPerMinute": 40}}},
            {"tenant": "team-e", "keys": [KEY_E],
             "quota": {"limits": {"outputTokensPerMinute": 300}}},
            {"tenant": "team-f", "keys": [KEY_F],
             "quota": {"limits": {"outputTokensPerMinute": 3000}}},
        ],
    }


@pytest.fixture(scope="module")
def token_file() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvfleet-router-") as tmp:
        path = Path(tmp) / "token"
        path.write_text(TOKEN)
        yield path


@pytest.fixture(scope="module")
def engines(token_file: Path) -> Iterator[dict[str, EngineServer]]:
    flags = ("--kv-cache-memory-mib", "64", "--router-token-file", str(token_file))
    with running_server(*flags, "--revision", STABLE[:12], torch_threads=1) as stable, \
            running_server(*flags, "--revision", CANARY[:12], torch_threads=1) as canary:
        yield {STABLE: stable, CANARY: canary}


class RouterProcess:
    def __init__(self, config_path: Path, port: int, process: subprocess.Popen[bytes],
                 metrics_port: int) -> None:
        self.config_path, self.process = config_path, process
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def reconfigure(self, data: dict[str, Any]) -> None:
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(data))
        tmp.replace(self.config_path)
        time.sleep(1.6)  # the router checks the file every second

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(self.metrics_url).text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line
                                                   for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture(scope="module")
def router(engines: dict[str, EngineServer], token_file: Path) -> Iterator[RouterProcess]:
    port, metrics_port = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="kvfleet-router-") as tmp:
        path = Path(tmp) / "router.yaml"
        path.write_text(yaml.safe_dump(config(engines, 50, 0, token_file)))
        with running_kvfleet("router", "--config", str(path), "--port", str(port),
                             "--metrics-port", str(metrics_port), port=port,
                             ready_timeout=60) as (process, _):
            time.sleep(0.5)  # a first scrape of the engines' load
            yield RouterProcess(path, port, process, metrics_port)


def chat(router: RouterProcess, key: str | None, **extra: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    headers.update(extra.pop("headers", {}))
    body = {"model": "smol", "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(router.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=60)


def served(engines: dict[str, EngineServer]) -> float:
    return sum(e.metrics().get("kvfleet_engine_requests_total", 0.0) for e in engines.values())


def test_unknown_keys_get_401_and_engines_refuse_requests_without_the_router_proof(
    router: RouterProcess, engines: dict[str, EngineServer],
) -> None:
    for key in (None, "sk-not-a-key-0123456789abcdef"):
        resp = chat(router, key)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["code"] == "invalid_api_key"
    direct = httpx.post(engines[STABLE].base_url + "/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                        headers={"x-kvfleet-tenant": "team-a"}, timeout=30)
    assert direct.status_code == 401 and "kvfleet router" in direct.text
    resp = httpx.get(router.url + "/v1/models", headers={"authorization": f"Bearer {KEY_B}"})
    assert [m["id"] for m in resp.json()["data"]] == ["smol"]


def test_a_spoofed_tenant_header_does_not_change_the_tenant(
    router: RouterProcess, engines: dict[str, EngineServer],
) -> None:
    ids = []
    for i in range(4):  # team-b allows 3 a minute: these would be refused if charged to it
        resp = chat(router, KEY_A, user=f"spoof-{i}", headers={"x-kvfleet-tenant": "team-b"})
        assert resp.status_code == 200, resp.text
        ids.append(resp.json()["id"])
    logged = [json.loads(line) for e in engines.values() for line in e.log_lines()
              if line.startswith("{") and '"request_id"' in line]
    tenants = {r["request_id"]: r.get("tenant") for r in logged if r["request_id"] in ids}
    assert tenants and set(tenants.values()) == {"team-a"}, tenants


def test_over_quota_gets_429_with_retry_after_and_never_reaches_an_engine(
    router: RouterProcess, engines: dict[str, EngineServer],
) -> None:
    for _ in range(3):
        assert chat(router, KEY_B).status_code == 200
    before = served(engines)
    resp = chat(router, KEY_B)
    assert resp.status_code == 429, resp.text
    assert int(resp.headers["retry-after"]) >= 1
    message = resp.json()["error"]["message"]
    assert "requestsPerMinute = 3 of TenantQuota config/team-b" in message
    time.sleep(0.3)
    assert served(engines) == before
    assert router.metric("kvfleet_router_rejections_total", reason="requestsPerMinute") >= 1


def test_weights_split_conversations_and_a_conversation_stays_on_its_revision(
    router: RouterProcess,
) -> None:
    revisions = Counter()
    first: dict[str, str] = {}
    for i in range(24):
        user = f"user-{i % 12}"
        resp = chat(router, KEY_A, user=user, max_tokens=1)
        assert resp.status_code == 200, resp.text
        revision = resp.headers["x-kvfleet-revision"]
        assert first.setdefault(user, revision) == revision  # sticky
        revisions[revision] += 1
    assert set(revisions) == {STABLE[:12], CANARY[:12]}  # 50/50 over 12 conversations


def test_streams_are_relayed_and_measured_per_revision(router: RouterProcess) -> None:
    with httpx.stream("POST", router.url + "/v1/chat/completions",
                      headers={"authorization": f"Bearer {KEY_A}"},
                      json={"model": "smol", "stream": True, "max_tokens": 8,
                            "messages": [{"role": "user", "content": "Count to five."}]},
                      timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]"
    last = json.loads(frames[-2][6:])
    assert last["usage"]["completion_tokens"] >= 1
    assert router.metric("kvfleet_router_time_to_first_token_seconds_count",
                         traffic="live") >= 1
    assert router.metric("kvfleet_router_tokens_total", kind="generation") >= 1


def test_shadow_copies_are_served_discarded_and_not_charged(
    router: RouterProcess, engines: dict[str, EngineServer], token_file: Path,
) -> None:
    router.reconfigure(config(engines, 0, 100, token_file))
    canary_before = engines[CANARY].metrics()["kvfleet_engine_requests_total"]
    for i in range(3):
        resp = chat(router, KEY_A, user=f"shadowed-{i}")
        assert resp.status_code == 200
        assert resp.headers["x-kvfleet-revision"] == STABLE[:12]  # live: stable only
    with httpx.stream("POST", router.url + "/v1/chat/completions",  # a streamed one too
                      headers={"authorization": f"Bearer {KEY_A}"},
                      json={"model": "smol", "stream": True, "max_tokens": 6, "temperature": 0,
                            "messages": [{"role": "user", "content": "Name a color."}]},
                      timeout=60) as streamed:
        assert streamed.status_code == 200
        assert list(streamed.iter_lines())
    deadline = time.monotonic() + 30
    while router.metric("kvfleet_router_requests_total", traffic="shadow") < 4:
        assert time.monotonic() < deadline, "the shadow copies were not served"
        time.sleep(0.2)
    assert engines[CANARY].metrics()["kvfleet_engine_requests_total"] >= canary_before + 4
    # Both revisions run the same weights here: every greedy answer is the same text.
    time.sleep(0.3)
    assert router.metric("kvfleet_router_shadow_comparisons_total", outcome="identical") == 4
    router.reconfigure(config(engines, 50, 0, token_file))


TOPICS = ["Kubernetes", "volcanoes", "jazz", "coffee", "chess", "the moon", "bread", "TCP"]


def probing(engines: dict[str, EngineServer], token_file: Path) -> dict[str, Any]:
    """Half the conversations to the canary, and every request probed on both revisions."""
    data = config(engines, 50, 0, token_file)
    for entry in data["pools"][0]["status"]["traffic"]:
        if entry["role"] == "canary":
            entry["probePercent"] = 100
    return data


def probe_score(router: RouterProcess, revision: str) -> tuple[float, float]:
    """(agreed, compared) probe tokens after a chat per topic, once every probe settled."""
    before = router.metric("kvfleet_router_probes_total", revision=revision[:12])
    for i, topic in enumerate(TOPICS):
        resp = chat(router, KEY_A, user=f"probe-{revision[:4]}-{i}", temperature=0.8,
                    max_tokens=16,
                    messages=[{"role": "user", "content": f"Explain {topic} in a sentence."}])
        assert resp.status_code == 200, resp.text
    deadline = time.monotonic() + 120
    while router.metric("kvfleet_router_probes_total", revision=revision[:12]) < \
            before + len(TOPICS):
        assert time.monotonic() < deadline, "the probes did not settle"
        time.sleep(0.2)
    return (router.metric("kvfleet_router_probe_tokens_total", revision=revision[:12],
                          kind="agreed"),
            router.metric("kvfleet_router_probe_tokens_total", revision=revision[:12],
                          kind="compared"))


def test_greedy_probes_agree_on_the_same_weights_and_not_on_perturbed_ones(
    router: RouterProcess, engines: dict[str, EngineServer], token_file: Path,
) -> None:
    """The OutputAgreement gate's evidence from real engines: two replicas of the same model
    (each batched as its load has it) agree on every probe token; the same model with one norm
    tensor scaled (same shapes, same speed) agrees on few."""
    from kvfleet.api.gguf_artifact import embedded_gguf_path
    from kvfleet.devcluster.perturb import scale_norm

    router.reconfigure(probing(engines, token_file))
    agreed, compared = probe_score(router, CANARY)
    assert compared >= len(TOPICS) and agreed == compared
    probes = router.metric("kvfleet_router_probes_total", revision=CANARY[:12],
                           outcome="compared")
    # ... and each probe in full, ids and text (the ProbeAgreement gate's evidence)
    assert router.metric("kvfleet_router_probes_agreed_total", revision=CANARY[:12]) == probes
    assert router.metric("kvfleet_router_probes_total", outcome="error") == 0
    with tempfile.TemporaryDirectory(prefix="kvfleet-perturbed-") as tmp:
        wrong = scale_norm(embedded_gguf_path(), Path(tmp) / "wrong.gguf")
        with running_server("--model", str(wrong), "--kv-cache-memory-mib", "64",
                            "--router-token-file", str(token_file), "--revision", CANARY[:12],
                            torch_threads=1) as perturbed:  # (it serves the canary revision)
            swapped = {STABLE: engines[STABLE], CANARY: perturbed}
            router.reconfigure(probing(swapped, token_file))
            before = router.metric("kvfleet_router_probe_tokens_total", revision=CANARY[:12],
                                   kind="agreed"), compared
            agreed, compared = probe_score(router, CANARY)
            score = (agreed - before[0]) / (compared - before[1])
            assert score < 0.5, score  # the default gate wants 0.9
            in_full = router.metric("kvfleet_router_probes_agreed_total",
                                    revision=CANARY[:12]) - probes
            share = in_full / (router.metric("kvfleet_router_probes_total",
                                             revision=CANARY[:12], outcome="compared") - probes)
            assert share < 0.9, share  # the probe gate's default
            first = router.metric("kvfleet_router_probe_first_divergence",
                                  revision=CANARY[:12])
            assert first < 16
    router.reconfigure(config(engines, 50, 0, token_file))


def test_prompt_tokens_are_counted_with_the_pools_tokenizer(
    router: RouterProcess, engines: dict[str, EngineServer],
) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(httpx.get(engines[STABLE].base_url + "/tokenizer.json").text)
    content = "Kubernetes operators reconcile desired state. " * 12
    exact = len(tokenizer.encode(content, add_special_tokens=False).ids) + 4  # + ChatML markup
    chat(router, KEY_C, user="tok", max_tokens=1)  # the first one fetches the tokenizer
    deadline = time.monotonic() + 10
    while True:
        resp = chat(router, KEY_C, user="tok", max_tokens=1,
                    messages=[{"role": "user", "content": content}])
        assert resp.status_code == 429, resp.text  # over 40 prompt tokens either way
        if f"needs {exact} prompt tokens" in resp.json()["error"]["message"]:
            break
        assert time.monotonic() < deadline, resp.json()["error"]["message"]
        time.sleep(0.2)
    assert exact < len(content.encode()) // 3  # the estimate would have charged more


def test_two_router_replicas_hold_the_fleet_wide_limit(
    engines: dict[str, EngineServer], token_file: Path,
) -> None:
    """Each of two routers enforces its half of a limit, so the two together never admit more
    than the TenantQuota allows, however a client spreads its requests."""
    data = config(engines, 0, 0, token_file)
    data["tenants"] = [{"tenant": "team-d", "keys": [KEY_C],
                        "quota": {"limits": {"requestsPerMinute": 4}}}]
    with tempfile.TemporaryDirectory(prefix="kvfleet-router-") as tmp:
        path = Path(tmp) / "router.yaml"
        path.write_text(yaml.safe_dump(data))
        ports, metrics = [free_port(), free_port()], [free_port(), free_port()]
        with running_kvfleet("router", "--config", str(path), "--port", str(ports[0]),
                             "--metrics-port", str(metrics[0]), "--replicas", "2",
                             port=ports[0], ready_timeout=60) as (p0, _), \
                running_kvfleet("router", "--config", str(path), "--port", str(ports[1]),
                                "--metrics-port", str(metrics[1]), "--replicas", "2",
                                port=ports[1], ready_timeout=60) as (p1, _):
            routers = [RouterProcess(path, port, proc, metrics_port) for port, proc, metrics_port
                       in zip(ports, (p0, p1), metrics, strict=True)]
            codes = [chat(routers[i % 2], KEY_C, max_tokens=1).status_code for i in range(6)]
            assert sorted(codes) == [200, 200, 200, 200, 429, 429], codes
            assert chat(routers[0], KEY_C, max_tokens=1).status_code == 429
            assert chat(routers[1], KEY_C, max_tokens=1).status_code == 429


def test_a_stream_cut_short_by_its_client_is_billed_what_was_relayed(
    router: RouterProcess, engines: dict[str, EngineServer],
) -> None:
    """Usage came only with a stream's last chunk, so a client that read 100 tokens and hung
    up was billed 0 and its output-token limit never bit. The router asks the engine for the
    running usage on every chunk and settles from the last one relayed."""
    started = time.monotonic()
    body = {"model": "smol", "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 250, "ignore_eos": True, "stream": True}
    relayed = 0
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEY_E}"}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                relayed = json.loads(line[6:])["usage"]["completion_tokens"]
            if relayed >= 100:
                break  # hang up
    assert relayed >= 100
    for engine in engines.values():
        engine.wait_idle()  # the engine stopped generating for nobody
    # The output bucket (300 a minute) was charged what was relayed, not refunded to 300.
    refused = chat(router, KEY_E, max_tokens=250)
    assert refused.status_code == 429, refused.text
    left = int(re.search(r"max_tokens 250, (\d+) left", refused.json()["error"]["message"])[1])
    refill = 300 / 60 * (time.monotonic() - started)
    assert left <= 300 - relayed + refill + 1, (left, relayed, refill)  # (+1: shown rounded)


def test_a_client_that_hangs_up_on_a_whole_answer_stops_the_engine_and_is_charged(
    router: RouterProcess, engines: dict[str, EngineServer],
) -> None:
    """A non-streamed request kept generating after its client left, free: the router now
    cancels it upstream (the engine aborts) and charges the whole output reservation."""
    body = {"model": "smol", "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 1400, "ignore_eos": True}  # (what the engines' KV cache holds)
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1.5 s
        httpx.post(router.url + "/v1/chat/completions", json=body,
                   headers={"authorization": f"Bearer {KEY_F}"},
                   timeout=httpx.Timeout(60, read=1.5))
    for engine in engines.values():
        metrics = engine.wait_idle(timeout=10)
        assert metrics["kvfleet_engine_requests_running"] == 0
    assert time.monotonic() - started < 10  # 1400 tokens take far longer on 2 cores
    finished = [json.loads(line) for engine in engines.values() for line in engine.log_lines()
                if '"request_finished"' in line and '"tenant":"team-f"' in line]
    assert len(finished) == 1 and finished[0]["completion_tokens"] < 1400, finished
    # The output bucket (3000 a minute) was charged the whole 1400, not the 0 relayed.
    refused = chat(router, KEY_F, max_tokens=2999)
    assert refused.status_code == 429, refused.text
    left = int(re.search(r"max_tokens 2999, (\d+) left", refused.json()["error"]["message"])[1])
    assert left <= 3000 - 1400 + 3000 / 60 * (time.monotonic() - started) + 1, left
    assert router.metric("kvfleet_router_requests_total", outcome="client_gone") >= 1


def test_a_huge_prompt_is_tokenized_without_stalling_other_requests(
    router: RouterProcess,
) -> None:
    """Tokenizing a 4 MiB prompt takes seconds; on the event loop it stalled every request
    of every tenant that long. The router now tokenizes large prompts on a worker thread."""
    assert chat(router, KEY_A).status_code == 200  # the revision's tokenizer is here
    text = ("The quick brown fox jumps over the lazy dog. " * 100_000)[: (4 << 20) - 4096]
    big: dict[str, httpx.Response] = {}

    def send() -> None:  # team-c's 40 prompt tokens a minute: refused once counted
        big["answer"] = chat(router, KEY_C, messages=[{"role": "user", "content": text}])

    thread = threading.Thread(target=send)
    thread.start()
    time.sleep(0.5)  # (the body is sent, its tokens being counted)
    slowest = 0.0
    while thread.is_alive():
        start = time.monotonic()
        httpx.get(router.url + "/v1/models", headers={"authorization": f"Bearer {KEY_A}"},
                  timeout=30).raise_for_status()
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.05)
    thread.join()
    assert big["answer"].status_code == 429, big["answer"].text[:200]
    assert "inputTokensPerMinute" in big["answer"].text
    assert slowest < 0.5, f"a small request waited {slowest:.2f} s behind the tokenizing"


def test_a_64_mib_body_is_refused_at_once_and_never_buffered(router: RouterProcess) -> None:
    """413 by Content-Length before a byte is read, and for a chunked body (no length) as soon
    as it passes the 4 MiB limit; the router's memory does not grow by the body."""
    import psutil

    process = psutil.Process(router.process.pid)
    before = process.memory_info().rss
    chunk = b"x" * (1 << 20)
    headers = {"authorization": f"Bearer {KEY_A}", "content-type": "application/json"}

    def chunked() -> Iterator[bytes]:
        for _ in range(64):
            yield chunk

    for body in (chunk * 64, chunked()):
        start = time.monotonic()
        try:
            answer = httpx.post(router.url + "/v1/chat/completions", content=body,
                                headers=headers, timeout=30)
            status = answer.status_code
        except httpx.WriteError:  # the router answered and closed while this still sent
            assert router.process.poll() is None  # (and did not die of it)
            status = 413
        took = time.monotonic() - start
        assert status == 413 and took < 1.0, (status, took)
    grown = (process.memory_info().rss - before) / (1 << 20)
    print(f"\n64 MiB bodies refused; router RSS grew {grown:.1f} MiB")
    assert grown < 16


def test_a_pool_at_zero_is_listed_holds_requests_and_serves_them_once_a_replica_is_ready(
    router: RouterProcess, engines: dict[str, EngineServer], token_file: Path,
) -> None:
    """Scale to zero as a client sees it: the pool stays in /v1/models; a request waits
    (counted in kvfleet_router_held_requests, the autoscaler's demand signal) until a replica
    shows, then is answered; one that may not wait that long gets 503 with Retry-After, and
    is not charged; one whose client hangs up leaves the hold and frees its slot."""
    asleep = config(engines, 0, 0, token_file)
    asleep["pools"][0].update(scalesToZero=True, endpoints={})
    try:
        router.reconfigure(asleep)
        models = httpx.get(router.url + "/v1/models",
                           headers={"authorization": f"Bearer {KEY_A}"}).json()
        assert [m["id"] for m in models["data"]] == ["smol"]
        started = time.monotonic()
        impatient = chat(router, KEY_A, headers={"x-kvfleet-max-wait-seconds": "1"})
        assert impatient.status_code == 503, impatient.text
        assert impatient.json()["error"]["code"] == "pool_waking"
        assert impatient.headers["retry-after"] == "10" and time.monotonic() - started < 5

        # Clients that hang up while held give their hold place and concurrency slot back:
        # team-a may run 8 at once, and 8 gone would otherwise leave it nothing.
        def hang_up() -> None:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(router.url + "/v1/chat/completions", timeout=1,
                           headers={"authorization": f"Bearer {KEY_A}"},
                           json={"model": "smol", "max_tokens": 4,
                                 "messages": [{"role": "user", "content": "Say hi."}]})

        gone = [threading.Thread(target=hang_up) for _ in range(8)]
        for thread in gone:
            thread.start()
        for thread in gone:
            thread.join(10)
        deadline = time.monotonic() + 10
        while router.metric("kvfleet_router_held_requests", pool="smol") != 0:
            assert time.monotonic() < deadline, "hung-up requests stayed held"
            time.sleep(0.1)

        answers: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: answers.append(chat(router, KEY_A)))
        waiting.start()
        deadline = time.monotonic() + 10
        while router.metric("kvfleet_router_held_requests", pool="smol") != 1:
            assert time.monotonic() < deadline, "the request was not held"
            time.sleep(0.1)
        time.sleep(2)
        assert not answers  # still held: no replica yet
        woke = time.monotonic()
        router.reconfigure(config(engines, 0, 0, token_file))  # a replica is Ready
        waiting.join(30)
        assert answers and answers[0].status_code == 200, answers
        assert time.monotonic() - woke < 5
        assert router.metric("kvfleet_router_held_requests", pool="smol") == 0
    finally:
        router.reconfigure(config(engines, 50, 0, token_file))
