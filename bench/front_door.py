"""What hostile bodies cost the router before any engine sees them: memory and time.

    .venv/bin/python bench/front_door.py [--bodies 10]

A real `kvfleet router --config` process in front of the fast fake engine of
`router_overhead.py`. For each case, `--bodies` requests of 4 MiB each at once, then the
router's peak RSS (VmHWM, from /proc: what a pod's memory limit sees) and each answer's
status and time:

- spent: `{"messages":[{},{},...]}` from a key whose requestsPerMinute is used up;
- objects: the same from a key with room (JSON that parses into 1.4 million objects each);
- numbers: a completion whose prompt is 4 MiB of token ids (`[1,2,...]`);
- prose: a chat of one 4 MiB message of words (a legitimate large prompt, for scale).

Each case runs in a fresh router, so each peak is its own.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import router_overhead as ro
import yaml

ROOT = Path(__file__).resolve().parents[1]
SPENT_KEY, ROOM_KEY = "sk-spent-0123456789abcdef", "sk-room-0123456789abcdef"
MIB = 1 << 20


def bodies() -> dict[str, tuple[str, str, bytes]]:
    """case -> (key, path, body) of about 4 MiB each (just under the 4 MiB limit)."""
    limit = 4 * MIB - 64
    n = (limit - 40) // 3
    objects = b'{"model":"pool","messages":[' + b",".join([b"{}"] * n) + b"]}"
    ids = (limit - 60) // 2
    numbers = b'{"model":"pool","max_tokens":1,"prompt":[' + b",".join([b"1"] * ids) + b"]}"
    words = ("the router counts every prompt token before admission " * 80_000)[:limit - 100]
    prose = ('{"model":"pool","max_tokens":1,"messages":[{"role":"user","content":"'
             + words + '"}]}').encode()
    return {"spent": (SPENT_KEY, "/v1/chat/completions", objects),
            "objects": (ROOM_KEY, "/v1/chat/completions", objects),
            "numbers": (ROOM_KEY, "/v1/completions", numbers),
            "prose": (ROOM_KEY, "/v1/chat/completions", prose)}


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def send(url: str, key: str, body: bytes, n: int) -> list[tuple[int, float]]:
    async def one(session: aiohttp.ClientSession) -> tuple[int, float]:
        started = time.perf_counter()
        async with session.post(url, data=body, headers={
                "authorization": f"Bearer {key}", "content-type": "application/json"}) as resp:
            await resp.read()
            return resp.status, time.perf_counter() - started

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return list(await asyncio.gather(*(one(session) for _ in range(n))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bodies", type=int, default=10)
    args = parser.parse_args()
    up_port = ro.free_port()
    upstream = subprocess.Popen([sys.executable, str(ROOT / "bench/router_overhead.py"),
                                 "--upstream", str(up_port)])
    cases = bodies()
    try:
        ro.wait_http(f"http://127.0.0.1:{up_port}/metrics")
        with tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as tmp:
            config = Path(tmp) / "router.yaml"
            config.write_text(yaml.safe_dump({
                "pools": [{"name": "pool", "status": {"servingRevision": ro.REVISION},
                           "endpoints": {ro.REVISION: [f"127.0.0.1:{up_port}"]}}],
                "tenants": [
                    {"tenant": "spent", "keys": [SPENT_KEY],
                     "quota": {"limits": {"requestsPerMinute": 1}}},
                    {"tenant": "room", "keys": [ROOM_KEY], "quota": {}}]}))
            for case, (key, path, body) in cases.items():
                port = ro.free_port()
                router = subprocess.Popen(
                    [sys.executable, "-m", "kvfleet", "router", "--config", str(config),
                     "--port", str(port), "--metrics-port", str(ro.free_port()),
                     "--log-level", "error"], cwd=ROOT)
                try:
                    ro.wait_http(f"http://127.0.0.1:{port}/health")
                    url = f"http://127.0.0.1:{port}{path}"
                    asyncio.run(send(f"http://127.0.0.1:{port}/v1/chat/completions", key,
                                     b'{"model":"pool","max_tokens":1,"messages":[{"role":'
                                     b'"user","content":"hi"}]}', 1))  # (spends "spent")
                    before = peak_rss_mib(router.pid)
                    answers = asyncio.run(send(url, key, body, args.bodies))
                    codes = sorted({status for status, _ in answers})
                    slowest = max(seconds for _, seconds in answers)
                    print(f"{case:>8}: {args.bodies} x {len(body) / MIB:.1f} MiB -> HTTP "
                          f"{codes}, slowest {slowest * 1e3:7.1f} ms | router peak RSS "
                          f"{before:6.1f} -> {peak_rss_mib(router.pid):6.1f} MiB", flush=True)
                finally:
                    router.terminate()
                    router.wait(10)
    finally:
        upstream.terminate()
        upstream.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
