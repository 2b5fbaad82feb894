"""The router's connections (real uvicorn, real sockets): a deadline for their headers (half a
header line is closed after it, a whole request served as before), caps on open connections
in all and per client address, and a send timeout for a streaming client that stops reading."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kvfleet.router.connections import (
    MAX_CONNECTIONS,
    MAX_PER_CLIENT,
    HeaderDeadlineProtocol,
    bounded,
)


class Quick(HeaderDeadlineProtocol):
    header_seconds = 0.5


async def hello(_: object) -> PlainTextResponse:
    return PlainTextResponse("hi")


@pytest.mark.asyncio
async def test_a_connection_that_never_finishes_its_headers_is_closed() -> None:
    app = Starlette(routes=[Route("/", hello)])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, http=Quick,
                                           timeout_keep_alive=75))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the router
        assert 0.4 <= time.monotonic() - started < 3
        writer.close()
        # A whole request, then a keep-alive pause longer than the deadline: still served.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(2):
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200")
            assert await reader.readexactly(2) == b"hi"
            await asyncio.sleep(0.8)
        writer.close()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def _serving(app: Starlette, protocol: type[HeaderDeadlineProtocol]
                   ) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, http=protocol,
                                           timeout_keep_alive=75))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]


async def _served(port: int, source: str) -> bool:
    """A request on a new connection from `source`: answered, or closed unanswered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.read(12), 5)
    writer.close()
    return head.startswith(b"HTTP/1.1 200")


@pytest.mark.asyncio
async def test_connections_are_capped_in_all_and_per_client_address() -> None:
    """One address opening sockets by the thousand took the router to its fd limit."""
    protocol = bounded(max_connections=3, max_per_client=2)
    server, task, port = await _serving(Starlette(routes=[Route("/", hello)]), protocol)
    try:
        held = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
                for _ in range(2)]
        await asyncio.sleep(0.1)
        assert protocol.open.by_client == {"127.0.0.2": 2}
        assert not await _served(port, "127.0.0.2")  # a third from that address
        assert await _served(port, "127.0.0.3")  # another address: served (3 in all)
        await asyncio.sleep(0.1)  # (its close reaches the router)
        third = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.4", 0))
        await asyncio.sleep(0.1)
        assert protocol.open.total == 3, protocol.open
        assert not await _served(port, "127.0.0.5")  # 3 in all: refused whoever asks
        for _, writer in [*held, third]:
            writer.close()
        await asyncio.sleep(0.2)
        assert protocol.open.total == 0 and protocol.open.by_client == {}
        assert await _served(port, "127.0.0.2")
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
    # The CLI says the defaults it leaves to this module.
    from kvfleet.cli import build_parser

    router = build_parser()._subparsers._group_actions[0].choices["router"]  # type: ignore[union-attr]
    helps = {a.dest: a.help for a in router._actions}
    assert f"default {MAX_CONNECTIONS}" in str(helps["max_connections"])
    assert f"default {MAX_PER_CLIENT}" in str(helps["max_connections_per_client"])


@pytest.mark.asyncio
async def test_a_streaming_client_that_stops_reading_is_dropped() -> None:
    """It held the engine's stream, the replica's in-flight count and the tenant's slot."""
    from kvfleet.router.server import _RelayResponse

    closed: list[float] = []

    async def endless() -> AsyncIterator[bytes]:
        while True:
            yield b"x" * (1 << 20)

    async def relay(_: object) -> _RelayResponse:
        return _RelayResponse(endless(), lambda: closed.append(time.monotonic()), {}, 0.5)

    protocol = bounded(send_seconds=0.5)
    server, task, port = await _serving(Starlette(routes=[Route("/", relay)]), protocol)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        started = time.monotonic()
        for _ in range(200):  # (the socket buffers fill, then the send waits)
            if closed:
                break
            await asyncio.sleep(0.05)
        assert closed and closed[0] - started < 8, closed
        # ... and its connection aborted, not left to flush a buffer it never takes.
        for _ in range(100):
            if protocol.open.total == 0:
                break
            await asyncio.sleep(0.05)
        assert protocol.open.total == 0, protocol.open
        writer.close()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
