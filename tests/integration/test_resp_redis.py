"""The ledger's Redis client on a real redis-server: scripts that Redis forgot, a password and
a database, a restart."""

from __future__ import annotations

import asyncio

import pytest
from redis_server import running_redis

from kvfleet.router.resp import Redis, ReplyError

SCRIPT = "return {KEYS[1], ARGV[1], redis.call('INCRBY', KEYS[1], ARGV[2])}"


def test_a_script_redis_forgot_is_sent_whole_once() -> None:
    async def run(url: str) -> None:
        client = Redis.from_url(url)
        script = client.register_script(SCRIPT)
        assert await script(keys=["k"], args=["a", 2]) == [b"k", b"a", 2]  # loaded by EVAL
        assert await script(keys=["k"], args=["b", 3]) == [b"k", b"b", 5]  # by its SHA
        await client.execute("SCRIPT", "FLUSH")  # as after a restart
        assert await script(keys=["k"], args=["c", 1]) == [b"k", b"c", 6]
        broken = client.register_script("return redis.call('NOSUCHCOMMAND')")
        with pytest.raises(ReplyError, match=r"(?i)unknown"):
            await broken()
        await client.aclose()

    with running_redis() as server:
        asyncio.run(run(server.url))


def test_a_password_and_a_database_from_the_url() -> None:
    async def run(port: int) -> None:
        refused = Redis.from_url(f"redis://127.0.0.1:{port}/0")
        with pytest.raises(ReplyError, match="NOAUTH"):
            await refused.execute("SET", "k", "v")
        await refused.aclose()
        with pytest.raises(ReplyError, match=r"WRONGPASS|invalid password"):
            await Redis.from_url(f"redis://:wrong@127.0.0.1:{port}/0").execute("PING")
        three = Redis.from_url(f"redis://:s%40cret@127.0.0.1:{port}/3")
        zero = Redis.from_url(f"redis://default:s%40cret@127.0.0.1:{port}")
        await three.execute("SET", "where", "three")
        assert await zero.execute("GET", "where") is None  # another database
        assert await three.execute("GET", "where") == b"three"
        await three.aclose()
        await zero.aclose()

    with running_redis("--requirepass", "s@cret") as server:
        asyncio.run(run(server.port))


def test_after_a_restart_one_call_fails_and_the_next_connects_again() -> None:
    async def run() -> None:
        with running_redis() as server:
            client = Redis.from_url(server.url)
            assert await client.execute("PING") == b"PONG"
            server.stop()
            with pytest.raises(OSError):  # the connection lost, then refused
                await client.execute("PING")
            server.start()
            assert await client.execute("PING") == b"PONG"
            await client.aclose()

    asyncio.run(run())
