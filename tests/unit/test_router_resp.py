"""The ledger's Redis client against in-process stand-ins for a server that misbehaves: one that
never answers, one that hangs up, one that answers what nobody asked. (The real redis-server:
tests/integration/test_resp_redis.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import hiredis
import pytest

from kvfleet.router.resp import Redis, ReplyError

Handler = Callable[[bytes, asyncio.StreamWriter], None]


@asynccontextmanager
async def fake_server(handle: Handler) -> AsyncIterator[tuple[int, list[object]]]:
    """A server on a loopback port that passes each command it reads to `handle`; yields the
    port and what it saw: the commands read, and "connected" for each connection."""
    seen: list[object] = []
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        seen.append("connected")
        parser = hiredis.Reader()
        hung = False
        while data := await reader.read(65536):
            parser.feed(data)
            while (command := parser.gets()) is not False:
                seen.append(command)
                # A server that hangs answers nothing from then on (Redis answers in order).
                hung = hung or command[0] == b"HANG"
                if not hung:
                    handle(command, writer)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], seen
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


def echo(command: bytes, writer: asyncio.StreamWriter) -> None:
    """Answers ECHO x with x; hangs up on QUIT (and on HANG, `fake_server` stops answering)."""
    name = command[0]
    if name == b"ECHO":
        writer.write(b"$%d\r\n%s\r\n" % (len(command[1]), command[1]))
    elif name == b"QUIT":
        writer.close()
    else:
        writer.write(b"-ERR unknown command\r\n")


@pytest.mark.asyncio
async def test_concurrent_calls_share_one_connection_and_each_gets_its_own_reply() -> None:
    async with fake_server(echo) as (port, seen):
        client = Redis("127.0.0.1", port)
        replies = await asyncio.gather(*(client.execute("ECHO", str(i)) for i in range(200)))
        assert replies == [str(i).encode() for i in range(200)]
        assert seen.count("connected") == 1
        with pytest.raises(ReplyError, match="unknown command"):
            await client.execute("NOPE")
        assert await client.execute("ECHO", "after an error") == b"after an error"
        await client.aclose()


@pytest.mark.asyncio
async def test_a_silent_server_times_out_and_the_next_call_connects_again() -> None:
    async with fake_server(echo) as (port, _):
        client = Redis("127.0.0.1", port, timeout=0.2)
        started = asyncio.get_running_loop().time()
        assert await client.execute("ECHO", "connected") == b"connected"
        behind = asyncio.create_task(client.execute("ECHO", "behind it"))
        with pytest.raises(TimeoutError, match=r"did not answer within 0\.2 s"):
            await client.execute("HANG")
        assert asyncio.get_running_loop().time() - started < 1.0
        with pytest.raises(ConnectionError, match="dropped after a command timed out"):
            await behind  # the connection went with the command before it
        assert await client.execute("ECHO", "again") == b"again"
        await client.aclose()


@pytest.mark.asyncio
async def test_a_caller_that_gives_up_leaves_the_replies_in_order() -> None:
    async with fake_server(echo) as (port, _):
        client = Redis("127.0.0.1", port)
        first = asyncio.create_task(client.execute("ECHO", "first"))
        second = asyncio.create_task(client.execute("ECHO", "second"))
        await asyncio.sleep(0)  # both written
        first.cancel()
        assert await second == b"second"
        assert await client.execute("ECHO", "third") == b"third"
        await client.aclose()


@pytest.mark.asyncio
async def test_a_hang_up_fails_the_calls_waiting_and_the_next_one_reconnects() -> None:
    async with fake_server(echo) as (port, _):
        client = Redis("127.0.0.1", port)
        with pytest.raises(ConnectionError, match=r"lost|closed"):
            await client.execute("QUIT")
        assert await client.execute("ECHO", "back") == b"back"
        await client.aclose()


@pytest.mark.asyncio
async def test_a_reply_nobody_asked_for_drops_the_connection() -> None:
    def chatty(command: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"+OK\r\n+OK\r\n")  # two replies to every command

    async with fake_server(chatty) as (port, _):
        client = Redis("127.0.0.1", port)
        assert await client.execute("PING") == b"OK"
        await asyncio.sleep(0.05)  # the extra reply arrives: the connection is dropped
        assert await client.execute("PING") == b"OK"  # on a new one
        await client.aclose()


@pytest.mark.asyncio
async def test_a_server_that_does_not_speak_resp_fails_the_call_and_is_dropped() -> None:
    def http(command: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    async with fake_server(http) as (port, seen):
        client = Redis("127.0.0.1", port)
        with pytest.raises(ConnectionError, match="not RESP"):
            await client.execute("PING")
        with pytest.raises(ConnectionError, match="not RESP"):
            await client.execute("PING")  # on a new connection
        assert seen.count("connected") == 2
        await client.aclose()


@pytest.mark.asyncio
async def test_nobody_listening_is_an_os_error_at_once() -> None:
    async with fake_server(echo) as (port, _):
        pass  # closed: the port is free again
    with pytest.raises(OSError):
        await Redis("127.0.0.1", port).execute("PING")


def test_urls_name_host_port_database_and_credentials() -> None:
    client = Redis.from_url("redis://app:p%40ss@cache.example:6380/2")
    assert (client.host, client.port, client.db) == ("cache.example", 6380, 2)
    assert (client._username, client._password) == ("app", "p@ss")
    bare = Redis.from_url("redis://cache")
    assert (bare.port, bare.db, bare._password, bare._ssl) == (6379, 0, None, None)
    assert Redis.from_url("rediss://:secret@cache/0")._ssl is not None
    with pytest.raises(ValueError, match="starts with redis://"):
        Redis.from_url("http://:secret@cache:6379")
    with pytest.raises(ValueError, match="is a number, not 'cache'") as failed:
        Redis.from_url("redis://:secret@host/cache")
    assert "secret" not in str(failed.value)  # never a password in an error
