"""Bounds uvicorn lacks: how long a client may take to send a request's headers, and how many
connections the router holds, in all and per client address.

uvicorn times out a connection only while it is idle between requests (keep-alive); one that
opens and sends half a header line, or one header byte a minute, is kept for ever (400 such
sockets were all still open 65 s later, holding 410 descriptors of the router, until the fd
limit refuses every tenant). Here every request must have sent its whole header block within
`header_seconds` of its first byte, and a new connection its first request within as long;
the connection is closed otherwise. Bodies are bounded elsewhere (the router reads at most
MAX_BODY_BYTES, and only for a tenant whose quota has room).

A connection whose client takes no data for `send_seconds` while the router has some to
send (its socket buffers full, the transport paused) is aborted: closing it would wait for
the buffer to flush, which a client that keeps its window at zero never lets happen, and its
descriptor would be held for ever.

A connection past `max_connections` in all, or past `max_per_client` from one address, is
closed as it opens (before any byte is read): one client opening sockets by the thousand
takes the router to its fd limit, refusing every tenant. The router's own limits are per
tenant and come later; this one is per address, so set it above what a NAT or a load
balancer in front sends from one address (the chart's router sits behind a Service, which
keeps client addresses).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

HEADER_SECONDS = 10.0
SEND_SECONDS = 60.0
MAX_CONNECTIONS = 8192
MAX_PER_CLIENT = 512


@dataclass
class OpenConnections:
    """The connections a server holds, in all and per client address."""

    total: int = 0
    by_client: dict[str, int] = field(default_factory=dict)

    def admit(self, address: str, max_total: int, max_per_client: int) -> bool:
        if self.total >= max_total or self.by_client.get(address, 0) >= max_per_client:
            return False
        self.total += 1
        self.by_client[address] = self.by_client.get(address, 0) + 1
        return True

    def release(self, address: str) -> None:
        self.total -= 1
        if self.by_client[address] <= 1:
            del self.by_client[address]
        else:
            self.by_client[address] -= 1


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request's headers, and caps on
    open connections. uvicorn makes one per connection from the class: `bounded` makes a
    class with its own numbers and count."""

    header_seconds = HEADER_SECONDS
    send_seconds = SEND_SECONDS
    max_connections = MAX_CONNECTIONS
    max_per_client = MAX_PER_CLIENT
    open: ClassVar[OpenConnections] = OpenConnections()
    _deadline: asyncio.TimerHandle | None = None
    _stalled: asyncio.TimerHandle | None = None
    _counted: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = str(self.client[0]) if self.client else "-"
        if not self.open.admit(address, self.max_connections, self.max_per_client):
            log.debug("refused a connection from %s: %d open in all, %d from it", address,
                      self.open.total, self.open.by_client.get(address, 0))
            transport.close()
            return
        self._counted = address
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.send_seconds, self._stuck)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _stuck(self) -> None:
        self._stalled = None
        log.debug("aborted a connection from %s: it took no data for %.0f s", self.client,
                  self.send_seconds)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        if self._counted is not None:
            self.open.release(self._counted)
            self._counted = None
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_seconds, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        log.debug("closed a connection from %s: no complete request headers in %.0f s",
                  self.client, self.header_seconds)
        self.transport.close()


def bounded(header_seconds: float = HEADER_SECONDS, max_connections: int = MAX_CONNECTIONS,
            max_per_client: int = MAX_PER_CLIENT, send_seconds: float = SEND_SECONDS
            ) -> type[HeaderDeadlineProtocol]:
    """A protocol class with these bounds and a count of its own."""
    return type("BoundedProtocol", (HeaderDeadlineProtocol,), {
        "header_seconds": header_seconds, "max_connections": max_connections,
        "max_per_client": max_per_client, "send_seconds": send_seconds,
        "open": OpenConnections()})
