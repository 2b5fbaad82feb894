"""Two router processes sharing their quota ledger in a real redis-server, in front of a real
engine: fleet-wide limits hold whichever router a client reaches, a router killed mid-request
frees its slot within a lease, and with Redis stopped each router enforces its declared share
and says so."""

from __future__ import annotations

import contextlib
import itertools
import json
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from engine_server import EngineServer, free_port, running_kvfleet, running_server
from redis_server import RedisServer, running_redis

from kvfleet.router.fleet_ledger import LEASE_SECONDS

pytestmark = pytest.mark.slow

REVISION = "c" * 64
TOKEN = "router-proof-fleet-0123456789abcdef"
ONE_KEY, TPM_KEY = "sk-team-one-0123456789abcdef", "sk-team-tpm-0123456789abcdef"
ANY_KEY = "sk-team-any-0123456789abcdef"
TPM = 600  # output tokens a minute, fleet-wide
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tokens() -> Iterator[tuple[Path, Path]]:
    """The engine's token file and the routers' (the same Secret, seen by each side at its
    own time in a cluster)."""
    with tempfile.TemporaryDirectory(prefix="kvfleet-fleet-") as tmp:
        engine, routers = Path(tmp) / "engine-token", Path(tmp) / "router-token"
        for path in (engine, routers):
            path.write_text(TOKEN)
        yield engine, routers


@pytest.fixture(scope="module")
def engine(tokens: tuple[Path, Path]) -> Iterator[EngineServer]:
    with running_server("--kv-cache-memory-mib", "64", "--router-token-file", str(tokens[0]),
                        "--revision", REVISION[:12], torch_threads=1) as server:
        yield server


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


def _config(engine: EngineServer, token_file: Path) -> dict[str, Any]:
    return {
        "pools": [{"name": "smol", "status": {"servingRevision": REVISION, "traffic": [
            {"revision": REVISION, "role": "stable", "weight": 100}]},
            "endpoints": {REVISION: [engine.base_url.removeprefix("http://")]},
            "routerTokenFile": str(token_file)}],
        "tenants": [
            {"tenant": "team-one", "keys": [ONE_KEY],
             "quota": {"limits": {"maxConcurrentRequests": 1}}},
            {"tenant": "team-tpm", "keys": [TPM_KEY],
             "quota": {"limits": {"outputTokensPerMinute": TPM}}},
            {"tenant": "team-any", "keys": [ANY_KEY], "quota": {}},
        ],
    }


class Routers:
    """Two `kvfleet router` processes on one config, --replicas 2, one Redis."""

    def __init__(self, engine: EngineServer, token_file: Path, redis: RedisServer,
                 tmp: Path) -> None:
        self.config = tmp / "router.yaml"
        self.config.write_text(yaml.safe_dump(_config(engine, token_file)))
        # (A reply deadline for a loaded 2-core host: these tests are about the leases and
        # the shares, and a reply later than the default 0.1 s, and once even than 1 s beside
        # the rest of the suite, opened the breaker, so that a request was admitted on a
        # router's share and held no slot in Redis.)
        self.redis, self.prefix = redis, uuid.uuid4().hex
        self.args = ["--config", str(self.config), "--replicas", "2", "--redis", redis.url,
                     "--redis-prefix", self.prefix, "--redis-timeout", "5"]
        self.urls: list[str] = []
        self.metrics_urls: list[str] = []
        self.processes: list[Any] = []
        self.logs: list[Path] = []

    def start(self, stack: Any) -> None:
        for index in range(2):
            port, metrics_port = free_port(), free_port()
            process, log = stack.enter_context(running_kvfleet(
                "router", *self.args, "--replica-index", str(index), "--port", str(port),
                "--metrics-port", str(metrics_port), port=port, ready_timeout=60))
            self.urls.append(f"http://127.0.0.1:{port}")
            self.metrics_urls.append(f"http://127.0.0.1:{metrics_port}")
            self.processes.append(process)
            self.logs.append(log)
        time.sleep(0.5)  # a first scrape of the engine's load


@pytest.fixture()
def routers(engine: EngineServer, tokens: tuple[Path, Path], redis_server: RedisServer
            ) -> Iterator[Routers]:
    with tempfile.TemporaryDirectory(prefix="kvfleet-fleet-") as tmp, \
            contextlib.ExitStack() as stack:
        fleet = Routers(engine, tokens[1], redis_server, Path(tmp))
        fleet.start(stack)
        yield fleet


def chat(url: str, key: str, max_tokens: int = MAX_TOKENS, **extra: Any) -> httpx.Response:
    body = {"model": "smol", "messages": [{"role": "user", "content": "Count to fifty."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {key}"})


def hammer(urls: list[str], key: str, clients: int, seconds: float, max_tokens: int = MAX_TOKENS
           ) -> list[httpx.Response]:
    """`clients` threads sending requests for `seconds`, client i to router i mod 2."""
    answers: list[httpx.Response] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def client(i: int) -> None:
        while time.monotonic() < end:
            answer = chat(urls[i % len(urls)], key, max_tokens=max_tokens)
            with lock:
                answers.append(answer)
            if answer.status_code == 429:
                time.sleep(0.2)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def engine_intervals(engine: EngineServer, tenant: str, since: float) -> list[tuple[float, float]]:
    """(arrival, finish) of each request of `tenant` in the engine's request log."""
    spans = []
    for line in engine.log_lines():
        if '"request_finished"' in line and f'"tenant":"{tenant}"' in line:
            record = json.loads(line)
            if record["ts"] >= since:
                spans.append((record["arrival_time"], record["arrival_time"] + record["e2e_s"]))
    return sorted(spans)


def overlapping(spans: list[tuple[float, float]]) -> int:
    return sum(1 for (_, end), (start, _) in itertools.pairwise(spans) if start < end)


def redis_slots(routers: Routers, tenant: str) -> int:
    """The concurrency slots `tenant` holds in the shared ledger (kvfleet.router.fleet_ledger:
    <prefix>:s:<tenant>, leases by expiry)."""
    done = subprocess.run(["redis-cli", "-p", str(routers.redis.port), "ZCARD",
                           f"{routers.prefix}:s:{tenant}"], capture_output=True, check=True)
    return int(done.stdout.strip() or 0)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported by {url}")


def test_max_concurrent_one_is_never_two_across_two_routers_nor_after_one_dies(
    routers: Routers, engine: EngineServer,
) -> None:
    since = time.time()
    answers = hammer(routers.urls, ONE_KEY, clients=8, seconds=12)
    codes = [a.status_code for a in answers]
    assert set(codes) <= {200, 429}, codes
    spans = engine_intervals(engine, "team-one", since)
    print(f"\n8 clients, 2 routers, maxConcurrentRequests 1: {codes.count(200)} served, "
          f"{codes.count(429)} refused, {overlapping(spans)} overlaps in the engine's log")
    assert codes.count(200) >= 4 and len(spans) == codes.count(200)
    assert overlapping(spans) == 0
    # Router 0 dies (SIGKILL) while its request streams: its slot is a lease nobody renews, so
    # router 1 keeps refusing until it runs out, then serves. The kill waits for the first
    # token (a fixed sleep let a fast host finish the whole answer first, freeing the slot).
    # (Both on the shared ledger: a request admitted on a router's share holds no Redis slot.)
    deadline = time.monotonic() + 10
    while not all(metric(url, "kvfleet_router_shared_ledger_up") == 1
                  for url in routers.metrics_urls):
        assert time.monotonic() < deadline, "a router stayed off the shared ledger"
        time.sleep(0.2)
    body = {"model": "smol", "messages": [{"role": "user", "content": "Count to fifty."}],
            "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client:
        # (Router 0 may still refuse for up to a second: it saw the slot taken last, and the
        # hammer's last request ended on router 1.) The kill comes as soon as the stream's
        # slot is seen in Redis, at its headers: this host's engine streams 1,000 tokens in
        # about a second, and a kill after the first token, from a test process slowed by the
        # whole suite, came after the stream had ended and freed its slot (seen: Redis held
        # none right after the kill).
        for _ in range(10):
            stream = client.send(client.build_request(
                "POST", routers.urls[0] + "/v1/chat/completions", json=body,
                headers={"authorization": f"Bearer {ONE_KEY}"}), stream=True)
            if stream.status_code == 200 and redis_slots(routers, "team-one") == 1:
                break
            stream.close()
            time.sleep(1)
        assert stream.status_code == 200, "router 0 kept refusing"
        try:
            routers.processes[0].send_signal(signal.SIGKILL)
            routers.processes[0].wait()
        finally:
            with contextlib.suppress(httpx.HTTPError):  # (its router died under it)
                stream.close()
    killed = time.monotonic()
    held = redis_slots(routers, "team-one")  # (the dead router's stream's, until its lease ends)
    first = chat(routers.urls[1], ONE_KEY)
    assert first.status_code == 429, (
        f"router 1 served while the dead router's slot was held (slots in Redis after the kill:"
        f" {held}, now: {redis_slots(routers, 'team-one')}; router 1 on the shared ledger: "
        f"{metric(routers.metrics_urls[1], 'kvfleet_router_shared_ledger_up')}); the logs:\n"
        + "\n".join(log.read_text(errors="replace")[-2000:] for log in routers.logs))
    while (answer := chat(routers.urls[1], ONE_KEY)).status_code == 429:
        assert time.monotonic() - killed < LEASE_SECONDS + 10, "the dead router's slot stays"
        time.sleep(1)
    print(f"the dead router's slot freed {time.monotonic() - killed:.0f} s after its death")
    assert answer.status_code == 200


def test_a_token_rate_holds_across_two_routers_within_one_request(
    routers: Routers, engine: EngineServer,
) -> None:
    since, start = time.time(), time.monotonic()
    # One router admits a reservation of the whole fleet-wide minute (its 1/2 share could
    # never hold it); the short answer gives back what it did not use.
    first = chat(routers.urls[0], TPM_KEY, max_tokens=TPM, ignore_eos=False,
                 messages=[{"role": "user", "content": "Say hi."}])
    assert first.status_code == 200, first.text
    answers = [first, *hammer(routers.urls, TPM_KEY, clients=4, seconds=30)]
    elapsed = time.monotonic() - start
    served = [a for a in answers if a.status_code == 200]
    billed = sum(a.json()["usage"]["completion_tokens"] for a in served)
    # A full minute's bucket at the start, then the refill; over by at most one request.
    bound = TPM + TPM * elapsed / 60 + MAX_TOKENS
    logged = sum(1 for _ in engine_intervals(engine, "team-tpm", since))
    print(f"\n{TPM} output tokens/min over 2 routers for {elapsed:.0f} s: {billed} generated "
          f"in {len(served)} requests (bound {bound:.0f}), "
          f"{sum(a.status_code == 429 for a in answers)} refused")
    assert logged == len(served)
    assert billed <= bound
    assert billed >= 0.8 * (bound - MAX_TOKENS)  # the limit, not a router's share of it


def test_with_redis_stopped_each_router_enforces_its_share_and_says_so(
    routers: Routers, redis_server: RedisServer, engine: EngineServer,
) -> None:
    assert all(metric(url, "kvfleet_router_shared_ledger_up") == 1
                  for url in routers.metrics_urls)
    redis_server.stop()
    try:
        answers = [chat(url, TPM_KEY, max_tokens=TPM) for url in routers.urls]
        # Each router's 1/2 share of 600 (300) cannot hold a 600-token reservation.
        for answer in answers:
            assert answer.status_code == 429, answer.text
            assert "1/2 share" in answer.json()["error"]["message"]
        assert all(metric(url, "kvfleet_router_shared_ledger_up") == 0
                   for url in routers.metrics_urls)
        # The shares sum to the limit: maxConcurrentRequests 1 is 1 on one router and 0 on
        # the other (rounded up, it was 1 on each: 2 at the engine at once).
        since = time.time()
        answers = hammer(routers.urls, ONE_KEY, clients=8, seconds=8)
        codes = [a.status_code for a in answers]
        spans = engine_intervals(engine, "team-one", since)
        zero = [a for a in answers if a.status_code == 429
                and "share of the limit is 0" in a.json()["error"]["message"]]
        print(f"\nRedis stopped, 8 clients, maxConcurrentRequests 1: {codes.count(200)} served, "
              f"{codes.count(429)} refused ({len(zero)} by the router whose share is 0), "
              f"{overlapping(spans)} overlaps in the engine's log")
        assert set(codes) <= {200, 429}, codes
        assert codes.count(200) >= 2 and len(spans) == codes.count(200)
        assert overlapping(spans) == 0
        assert zero and all(a.headers["retry-after"] == "1" for a in zero)
    finally:
        redis_server.start()


def test_a_rotated_router_token_fails_no_request(
    routers: Routers, engine: EngineServer, tokens: tuple[Path, Path],
) -> None:
    """The token is re-minted under load. The routers see it first (a watch), the engines a
    kubelet sync later (their mounted file): meanwhile the routers send the replaced token
    to engines that refuse the new one, and then the engines accept both for a while."""
    engine_file, router_file = tokens
    new = "router-proof-rotated-0123456789abcdef"

    def rotate() -> None:
        time.sleep(2)
        router_file.write_text(new)  # the routers' watch: at once
        time.sleep(4)
        engine_file.write_text(new)  # the engines' file: a sync later

    rotation = threading.Thread(target=rotate)
    rotation.start()
    answers = hammer(routers.urls, ANY_KEY, clients=4, seconds=10, max_tokens=4)
    rotation.join()
    codes = [a.status_code for a in answers]
    assert codes and set(codes) == {200}, [a.text for a in answers if a.status_code != 200][:3]
    assert any("router token reloaded" in line for line in engine.log_lines())
    # After the grace, only the new token is good: the routers send it and it is accepted.
    assert chat(routers.urls[0], ANY_KEY, max_tokens=2).status_code == 200
    print(f"\n{len(codes)} requests across the rotation, all answered")
