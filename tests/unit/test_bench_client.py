"""The serving benchmark's HTTP client (`bench/serve_bench.py`): keep-alive reuse, a server
that closed an idle connection, errors. Against a small asyncio HTTP/1.1 server.

Budget: well under a second.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from bench_modules import load_bench

bench = load_bench("serve_bench")


@dataclass
class Server:
    url: str = ""
    connections: int = 0
    requests: list[dict[str, object]] = field(default_factory=list)
    close_after_response: bool = False
    status: int = 200


async def _handle(server: Server, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
    server.connections += 1
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            server.requests.append(json.loads(await reader.readexactly(length)))
            if server.status != 200:
                body = b'{"error": "no"}'
                writer.write(b"HTTP/1.1 %d Bad\r\nContent-Length: %d\r\n\r\n%s"
                             % (server.status, len(body), body))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for line in (b"data: one\n\n", b"data: two\n\ndata: [DONE]\n\n"):
                    writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                writer.write(b"0\r\n\r\n")
            await writer.drain()
            if server.close_after_response:  # like a keep-alive timeout, but at once
                break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@asynccontextmanager
async def serving() -> AsyncIterator[Server]:
    server = Server()
    listener = await asyncio.start_server(lambda r, w: _handle(server, r, w), "127.0.0.1", 0)
    server.url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    async with listener:
        try:
            yield server
        finally:
            await bench.close_idle_connections()


async def lines(url: str, n: int) -> list[bytes]:
    return [line async for line in bench.stream_lines(url, "/v1/completions", {"n": n})]


@pytest.mark.asyncio
async def test_requests_reuse_one_kept_alive_connection() -> None:
    async with serving() as server:
        for n in range(3):
            assert [x for x in await lines(server.url, n) if x] == [
                b"data: one", b"data: two", b"data: [DONE]"]
        assert server.connections == 1
        assert [r["n"] for r in server.requests] == [0, 1, 2]


@pytest.mark.asyncio
async def test_a_connection_the_server_closed_is_replaced() -> None:
    async with serving() as server:
        server.close_after_response = True
        await lines(server.url, 0)
        await asyncio.sleep(0.05)  # the close reaches the client while the connection idles
        assert [x for x in await lines(server.url, 1) if x][-1] == b"data: [DONE]"
        assert server.connections == 2
        assert [r["n"] for r in server.requests] == [0, 1]


@pytest.mark.asyncio
async def test_an_error_status_raises_and_its_connection_is_not_reused() -> None:
    async with serving() as server:
        server.status = 429
        with pytest.raises(bench.HTTPStatusError):
            await lines(server.url, 0)
        server.status = 200
        assert [x for x in await lines(server.url, 1) if x][-1] == b"data: [DONE]"
        assert server.connections == 2
