"""The router's connections have a deadline for their headers (real uvicorn, a real socket):
half a header line is closed after it, while a whole request is served as before."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kvfleet.router.connections import HeaderDeadlineProtocol


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
