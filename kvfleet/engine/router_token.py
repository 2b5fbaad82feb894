"""The router tokens an engine accepts, kept in step with a mounted Secret file.

A pool's router token lives in a Secret the engines mount (the kubelet rewrites the file when
the Secret changes, within its sync period) and the routers watch (they see a change at once).
So a re-minted token reaches the routers a minute or so before the engines. To make that safe
both ways:

- the engine re-reads its file when it changes (checked at most every CHECK_SECONDS, on the
  requests themselves: no thread), and keeps accepting the token it replaced for
  GRACE_SECONDS, for a router that has not seen the change yet;
- the router keeps the pool's previous token for as long, and sends it to an engine that
  refused the current one (`kvfleet.router.server`), for an engine whose file is not rewritten
  yet.

A file that cannot be read, or holds fewer than MIN_LENGTH characters, changes nothing: the
engine keeps the tokens it has, and says so in its log once per change.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("kvfleet.serve")

CHECK_SECONDS = 1.0
GRACE_SECONDS = 600.0
MIN_LENGTH = 16


class RouterTokens:
    """`accepts(proof)`: the current token, or the previous one within its grace period."""

    def __init__(self, token: str, path: Path | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.current = token
        self.path, self._clock = path, clock
        self._previous: tuple[str, float] | None = None  # (token, accepted until)
        self._checked = clock()
        self._seen = self._stamp()

    @classmethod
    def from_file(cls, path: Path, clock: Callable[[], float] = time.monotonic
                  ) -> RouterTokens:
        """OSError when it cannot be read, ValueError when it holds no usable token."""
        return cls(_valid(path.read_text().strip(), path), path, clock)

    def _stamp(self) -> tuple[int, int, int] | None:
        """What changes when the file is rewritten (a Secret volume swaps a symlink: the
        inode changes, the mtime may not)."""
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _reload(self) -> None:
        now = self._clock()
        if self.path is None or now - self._checked < CHECK_SECONDS:
            return
        self._checked = now
        stamp = self._stamp()
        if stamp == self._seen or stamp is None:
            return
        self._seen = stamp
        try:
            token = _valid(self.path.read_text().strip(), self.path)
        except (OSError, ValueError) as exc:
            log.error("router token file %s not reloaded, the current token stays (%s)",
                      self.path, exc)
            return
        if token != self.current:
            self._previous = (self.current, now + GRACE_SECONDS)
            self.current = token
            log.warning("router token reloaded from %s; the previous one is accepted for "
                        "%.0f s more", self.path, GRACE_SECONDS)

    def accepts(self, proof: str) -> bool:
        self._reload()
        ok = hmac.compare_digest(proof.encode(), self.current.encode())
        if self._previous is not None:
            token, until = self._previous
            # Compared whether or not the current one matched: no timing tells which.
            old = hmac.compare_digest(proof.encode(), token.encode())
            if self._clock() < until:
                ok = ok or old
            else:
                self._previous = None
        return ok


def _valid(token: str, where: Path) -> str:
    if len(token) < MIN_LENGTH:
        raise ValueError(f"{where}: the router token needs at least {MIN_LENGTH} characters")
    return token
