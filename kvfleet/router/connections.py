"""A bound uvicorn lacks: how long a client may take to send a request's headers.

uvicorn times out a connection only while it is idle between requests (keep-alive); one that
opens and sends half a header line, or one header byte a minute, is kept for ever (400 such
sockets were all still open 65 s later, holding 410 descriptors of the router, until the fd
limit refuses every tenant). Here every request must have sent its whole header block within
`header_seconds` of its first byte, and a new connection its first request within as long;
the connection is closed otherwise. Bodies are bounded elsewhere (the router reads at most
MAX_BODY_BYTES, and only for a tenant whose quota has room).
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

HEADER_SECONDS = 10.0


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request's headers."""

    header_seconds = HEADER_SECONDS
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
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
