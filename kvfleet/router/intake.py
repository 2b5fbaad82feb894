"""What a request may hold before its quota admits it: its body's bytes, against a budget per
tenant and one for the router.

A body is read, parsed and its prompt tokenized before the quota can weigh it (the prompt's
tokens are what it charges), and all of that costs memory some multiple of the body's bytes
(a parsed list of token ids, a tokenizer's encodings). Without a bound, ten 4 MiB bodies from
one key at once took the router past 1 GB, and its pod's memory limit, for every tenant. Here a
request holds its body's size (its Content-Length, else the most a body may be) from before
its first byte is read until it is admitted or refused; a tenant past `per_tenant` bytes in
flight, or the router past `total`, gets 429 with Retry-After at once, reading nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvfleet.router.errors import IntakeFull

MIB = 1 << 20
PER_TENANT_BYTES = 16 * MIB  # four bodies of the largest size
TOTAL_BYTES = 64 * MIB


@dataclass
class Intake:
    per_tenant: int = PER_TENANT_BYTES
    total: int = TOTAL_BYTES
    held: dict[str, int] = field(default_factory=dict)
    held_total: int = 0

    @contextmanager
    def hold(self, tenant: str, size: int) -> Iterator[None]:
        mine = self.held.get(tenant, 0)
        if mine and mine + size > self.per_tenant:
            raise IntakeFull(f"tenant {tenant!r} has {mine >> 10} KiB of request bodies being "
                             f"read and counted (at most {self.per_tenant >> 20} MiB at once); "
                             "send fewer large requests at a time")
        if self.held_total and self.held_total + size > self.total:
            raise IntakeFull(f"the router is reading {self.held_total >> 20} MiB of request "
                             "bodies (its limit); retry shortly")
        self.held[tenant] = mine + size
        self.held_total += size
        try:
            yield
        finally:
            self.held_total -= size
            left = self.held[tenant] - size
            if left:
                self.held[tenant] = left
            else:
                del self.held[tenant]
