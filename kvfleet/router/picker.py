"""Which replica of a revision serves a request: load first, then prefix affinity.

Each Ready endpoint has a load score from what the router knows: the engine's waiting and
running requests and KV-cache usage (scraped from its /metrics every ~200 ms) plus the
requests this router has in flight to it (counted since the last scrape answered). Metrics
older than `stale_after` make an endpoint count as saturated; when every endpoint is stale the
router falls back to least-in-flight.

Among the endpoints whose load is within `slack` of the least loaded, the request goes to the
one with the highest rendezvous hash of (tenant, prompt prefix, endpoint): the same tenant's
requests with the same opening share a replica, and with it its prefix cache, and every router
picks the same replica for the same prefix without talking to the others. A replica joining or
leaving moves only the prefixes that hash to it.
"""

from __future__ import annotations

import hashlib
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet.api.saturation import load_score

# Characters of the prompt that key affinity: about the first two KV blocks of tokens.
PREFIX_CHARS = 128
REFUSED_BACKOFF_S = 10.0


@dataclass(frozen=True, slots=True)
class EngineTLS:
    """How the router reaches a pool's engines over HTTPS: the context trusting the pool's
    certificate(s), and the name they are issued for (engines are reached by pod IP)."""

    context: ssl.SSLContext
    server_name: str


@dataclass(slots=True)
class EndpointLoad:
    """What the router knows of one engine replica's load."""

    address: str  # host:port
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0  # 0..1
    scraped_at: float | None = None
    in_flight: int = 0  # requests this router has open to it
    failures: int = field(default=0)  # consecutive failed scrapes or connections
    # When it last refused this router's token (401): an engine that answers every request
    # so at once looks idle and would draw the traffic; it counts as saturated for a while.
    refused_at: float | None = None
    tls: EngineTLS | None = None  # None: plain HTTP

    def url(self, path: str) -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}{path}"

    def connection(self) -> dict[str, Any]:
        """aiohttp request arguments for this endpoint's TLS (none for plain HTTP)."""
        if self.tls is None:
            return {}
        return {"ssl": self.tls.context, "server_hostname": self.tls.server_name}

    def score(self, now: float, stale_after: float) -> float:
        if self.scraped_at is None or now - self.scraped_at > stale_after or self.failures or (
                self.refused_at is not None and now - self.refused_at < REFUSED_BACKOFF_S):
            return float("inf")
        # The engine's own load (shared with the operator's autoscaler), plus what this router
        # sent since that was read.
        return load_score(self.waiting, self.running, self.kv_usage) + self.in_flight


def affinity(tenant: str, prefix: str, address: str) -> int:
    text = f"{tenant}\x1f{prefix}\x1f{address}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big")


def pick(endpoints: Sequence[EndpointLoad], tenant: str, prompt: str, now: float, *,
         stale_after: float = 1.0, slack: float = 2.0, exclude: frozenset[str] = frozenset()
         ) -> EndpointLoad | None:
    """The endpoint for this request, or None if there is none (after `exclude`)."""
    candidates = [e for e in endpoints if e.address not in exclude]
    if not candidates:
        return None
    scores = {e.address: e.score(now, stale_after) for e in candidates}
    best = min(scores.values())
    if best == float("inf"):  # every endpoint stale: least in flight, then affinity
        least = min(e.in_flight for e in candidates)
        near = [e for e in candidates if e.in_flight == least]
    else:
        near = [e for e in candidates if scores[e.address] <= best + slack]
    prefix = prompt[:PREFIX_CHARS]
    return max(near, key=lambda e: affinity(tenant, prefix, e.address))
