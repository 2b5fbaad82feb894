"""A lean Redis client for the quota ledger's scripts: one pipelined connection, hiredis's C
reader and writer, EVALSHA with a fall-back to EVAL.

Why not redis-py's asyncio client: for the ledger's two script calls a request it took ~13 %
of the router's busy samples (a connection checked out of a pool and back, a retry wrapper, a
lock, event dispatch) — more than the rest of the quota path together (bench/README, router
overhead). The ledger needs far less: a handful of commands, no pub/sub, no cluster mode.

How it works: Redis answers the commands of one connection in the order they came, so
concurrent callers share one connection. A call writes its command at once and waits on a
future queued behind those already waiting; the protocol's `data_received` feeds hiredis and
resolves the futures in order. A caller that gives up (cancelled) leaves its future in the
queue: its reply still arrives, in its turn, and is dropped.

Failure rules (the ledger's fall-back decides on them, see `fleet_ledger`):
  - connecting takes at most `connect_timeout` (and callers that queued behind a connect that
    failed fail with it at once); a reply at most `timeout`. A call that runs
    out of time raises TimeoutError and drops the connection (a hung Redis must not hold
    every admission behind it); every call still waiting then raises ConnectionError.
  - a lost connection raises ConnectionError in every waiting call; the next call connects
    again. Nothing is retried here: a command that may have run is never sent twice.
  - an error reply raises `ReplyError`; a script Redis no longer has (`NOSCRIPT`, after a
    restart or `SCRIPT FLUSH`) is sent again whole, once.

URLs: redis://[[user]:password@]host[:port][/db] and rediss:// (TLS, verified against the
system's CAs).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import ssl
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import hiredis

DEFAULT_PORT = 6379
Arg = str | bytes | int | float


class ReplyError(Exception):
    """Redis answered a command with an error."""


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self._reader = hiredis.Reader()
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while True:
            try:
                reply = self._reader.gets()
            except hiredis.ProtocolError as error:
                self.fail(ConnectionError(f"Redis sent something that is not RESP ({error})"))
                return
            if reply is False:
                return
            if not self.waiting:
                self.fail(ConnectionError("Redis sent a reply nobody asked for"))
                return
            future = self.waiting.popleft()
            if future.done():  # its caller gave up; the reply is dropped in its turn
                continue
            if isinstance(reply, hiredis.ReplyError):
                future.set_exception(ReplyError(str(reply)))
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.lost.done():
            self.lost.set_result(None)
        reason = f"connection to Redis lost ({exc})" if exc else "connection to Redis closed"
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(ConnectionError(reason))

    def fail(self, error: Exception) -> None:
        """Fail the first caller with `error`, then drop the connection (and the others)."""
        for future in self.waiting:
            if not future.done():
                future.set_exception(error)
                break
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Redis:
    """One pipelined connection to a Redis server; see the module doc."""

    def __init__(self, host: str, port: int = DEFAULT_PORT, *, db: int = 0,
                 username: str | None = None, password: str | None = None,
                 tls: bool = False, timeout: float = 0.5,
                 connect_timeout: float = 0.5) -> None:
        self.host, self.port, self.db = host, port, db
        self._username, self._password = username, password
        self._ssl = ssl.create_default_context() if tls else None
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Lock | None = None
        self._failed: tuple[float, BaseException] | None = None  # the last connect's failure

    @classmethod
    def from_url(cls, url: str, *, timeout: float = 0.5,
                 connect_timeout: float = 0.5) -> Redis:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"{url.split('@')[-1]!r}: a Redis URL starts with redis:// or "
                             "rediss://")
        path = parts.path.strip("/")
        if path and not path.isdigit():
            raise ValueError(f"{url.split('@')[-1]!r}: the database after the host is a "
                             f"number, not {path!r}")
        return cls(parts.hostname or "localhost", parts.port or DEFAULT_PORT,
                   db=int(path or 0), username=unquote(parts.username) if parts.username else None,
                   password=unquote(parts.password) if parts.password is not None else None,
                   tls=parts.scheme == "rediss", timeout=timeout,
                   connect_timeout=connect_timeout)

    def register_script(self, source: str) -> Script:
        return Script(self, source)

    async def execute(self, *args: Arg) -> Any:
        """Send one command and return its reply (see the module doc for what it raises)."""
        protocol = self._protocol
        if protocol is None or protocol.closed:
            protocol = await self._connect()
        return await self._send(protocol, args)

    async def aclose(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
            await protocol.lost  # the socket is closed once this returns

    # -- internals ------------------------------------------------------------------------

    async def _send(self, protocol: _Protocol, args: Sequence[Arg]) -> Any:
        if protocol.closed or protocol.transport is None:
            raise ConnectionError(f"connection to Redis at {self.host}:{self.port} closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        protocol.waiting.append(future)
        # (hiredis's stub types the argument as a 1-tuple; it takes any length)
        protocol.transport.write(hiredis.pack_command(tuple(args)))  # type: ignore[arg-type]
        timer = loop.call_later(self.timeout, self._expire, protocol, future)
        try:
            return await future
        finally:
            timer.cancel()

    def _expire(self, protocol: _Protocol, future: asyncio.Future[Any]) -> None:
        if not future.done():
            future.set_exception(TimeoutError(
                f"Redis at {self.host}:{self.port} did not answer within {self.timeout} s"))
            protocol.fail(ConnectionError("dropped after a command timed out"))

    async def _connect(self) -> _Protocol:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # concurrent callers share one new connection
            if self._protocol is not None and not self._protocol.closed:
                return self._protocol
            loop = asyncio.get_running_loop()
            # Callers that queued behind a connect that failed fail with it, each not trying
            # again in turn (a blackholed Redis made the k-th wait k connect timeouts).
            if self._failed is not None and loop.time() - self._failed[0] < \
                    self.connect_timeout:
                raise ConnectionError(f"Redis at {self.host}:{self.port}: "
                                      f"{type(self._failed[1]).__name__}") from None
            try:
                _, protocol = await asyncio.wait_for(
                    loop.create_connection(_Protocol, self.host, self.port, ssl=self._ssl),
                    self.connect_timeout)
            except (OSError, TimeoutError) as exc:
                self._failed = (loop.time(), exc)
                raise
            self._failed = None
            try:
                if self._password is not None:
                    await self._send(protocol, ("AUTH", self._password) if self._username is None
                                     else ("AUTH", self._username, self._password))
                if self.db:
                    await self._send(protocol, ("SELECT", self.db))
            except BaseException:
                if protocol.transport is not None:
                    protocol.transport.abort()
                raise
            self._protocol = protocol
            return protocol


class Script:
    """A Lua script run by its SHA1 (EVALSHA), sent whole (EVAL) when Redis lacks it."""

    def __init__(self, client: Redis, source: str) -> None:
        self.client, self.source = client, source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, keys: Sequence[Arg] = (), args: Sequence[Arg] = ()) -> Any:
        try:
            return await self.client.execute("EVALSHA", self.sha, len(keys), *keys, *args)
        except ReplyError as error:
            if not str(error).startswith("NOSCRIPT"):
                raise
        return await self.client.execute("EVAL", self.source, len(keys), *keys, *args)
