"""TenantQuota enforcement before the engine: rates by token bucket, concurrency by count,
output tokens by reservation.

Each per-minute limit is a bucket holding up to one minute's allowance and refilling at
limit / 60 a second, so a tenant may burst its whole minute at once and then runs at the rate.
A request needs, at admission: 1 from the requests bucket, its prompt tokens from the input
bucket, its `max_tokens` from the output bucket (a reservation), and a free concurrency slot.
When it ends (finished, failed or the client gone) the output reservation is settled to the
tokens really generated and the slot is freed. A refused request takes nothing.

Fail closed: a tenant with no TenantQuota is refused (`NoTenantQuota`, 403), unless the
router runs with a default quota (`--default-quota`, or `defaultQuota:` in its config file):
then each such tenant gets its own buckets of that spec. A tenant whose TenantQuota cannot be
read is refused by the router before it reaches the ledger (`kvfleet.router.cluster`).

Borrowing: for a limit listed in the quota's `borrowing.resources`, a tenant short of its own
allowance takes the rest from other tenants' idle allowance: from their buckets (the most
idle first) or, for maxConcurrentRequests, by holding one of their free slots. What it may
borrow is itself a budget of `maxPercent` of its limit per minute (`Bucket.debt`). Lenders are
the tenants with their own TenantQuota; what a request borrowed and did not use (an output
reservation settled lower) goes back to its lenders first.

Where the limits are kept: with a shared ledger (`--redis`, `kvfleet.router.fleet_ledger`)
every router replica enforces the fleet-wide limits on the same buckets, atomically. Without
one, or while it is unreachable, this module's ledger is the one each replica keeps for
itself, and then each enforces its share of every limit, `replicas` being the Ready routers
(in a cluster: the router pods, by name; from a config file: `--replicas`). The shares sum to
the limit, never more: each router gets `limit // replicas`, and the remainder one unit each on
`limit % replicas` of them, chosen by the router's rank (its pod name's place among the
routers', or `--replica-index`) turned by a stable hash of the tenant, so that the units of
small limits fall on different routers for different tenants. So with 2 routers
`maxConcurrentRequests: 1` is 1 on one router and 0 on the other, which refuses the tenant and
says that the other router holds it (Retry-After 1 s). The fleet-wide limit then holds as long as
clients' requests spread over the replicas (the Service balances connections); a client pinned
to one replica gets that replica's share. Routers that see a different set of replicas for a
moment (one just became Ready) may overrun or underrun by a unit for that moment; a config-file
router without `--replica-index` rounds its share up, and then the fleet may admit up to
`replicas - 1` more than a limit.

Restarts (without a shared ledger): each router reports what its buckets have left into the
TenantQuota's status every `STATUS_INTERVAL_SECONDS` (see `kvfleet.router.cluster`), and a
router that starts takes its buckets from its own last report, or from that of a router pod
that is gone (the lowest), plus the refill since (`seed`). What a restart can lose is the
admissions of the last interval before it: at most 10 s of a tenant's traffic on that replica
is admitted twice, never a whole minute's allowance.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

from kvfleet.api.tenantquota import BorrowableResource, TenantQuotaSpec
from kvfleet.router.errors import NoTenantQuota, QuotaExceeded

RPM = BorrowableResource.REQUESTS_PER_MINUTE
INPUT_TPM = BorrowableResource.INPUT_TOKENS_PER_MINUTE
OUTPUT_TPM = BorrowableResource.OUTPUT_TOKENS_PER_MINUTE
CONCURRENCY = BorrowableResource.MAX_CONCURRENT_REQUESTS


@dataclass(slots=True)
class Bucket:
    """A per-minute limit: `level` left of `capacity`, refilling at capacity / 60 a second.
    `debt` is what the tenant has borrowed from others (at most `borrow_cap`, repaid by time
    at borrow_cap / 60 a second): borrowing is itself a budget per minute."""

    capacity: float
    level: float
    updated: float
    borrow_cap: float = 0.0
    debt: float = 0.0

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        if now > self.updated:
            elapsed = now - self.updated
            self.level = min(self.capacity, self.level + elapsed * self.rate)
            self.debt = max(0.0, self.debt - elapsed * self.borrow_cap / 60.0)
            self.updated = now

    def wait_for(self, amount: float, ceiling: float) -> float:
        """Seconds until `amount` is available (infinite if it exceeds `ceiling`)."""
        if amount > ceiling:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate) if self.rate > 0 else math.inf


@dataclass(slots=True)
class TenantState:
    tenant: str
    quota_name: str  # namespace/name of the TenantQuota, for messages
    spec: TenantQuotaSpec
    buckets: dict[BorrowableResource, Bucket] = field(default_factory=dict)
    in_flight: int = 0  # this tenant's requests in flight (in its own slots or borrowed ones)
    slots_borrowed: int = 0  # of those, the ones holding another tenant's slot
    slots_lent: int = 0  # this tenant's slots held by other tenants' requests
    requests_total: int = 0
    tokens_total: int = 0

    @property
    def slots_used(self) -> int:
        return self.in_flight - self.slots_borrowed + self.slots_lent


@dataclass(slots=True)
class Reservation:
    """What an admitted request holds until it is settled: its allowance, the concurrency
    slot (its tenant's own, or `slot_lender`'s) and what it borrowed from each lender
    ((resource, lender) -> amount), which a refund pays back first."""

    tenant: str
    input_tokens: int
    output_reserved: int
    settled: bool = False
    slot_lender: str | None = None
    borrowed: dict[tuple[BorrowableResource, str], float] = field(default_factory=dict)
    id: str = ""  # the shared ledger's lease name
    shared: bool = False  # admitted by the shared (Redis) ledger, settled there


def share(limit: int, replicas: int, rank: int | None, tenant: str) -> int:
    """Router `rank`'s (0-based) share of `tenant`'s fleet-wide `limit` among `replicas`; the
    shares of ranks 0..replicas-1 sum to `limit`. With no rank, the share rounded up."""
    if rank is None:
        return max(1, math.ceil(limit / replicas)) if limit > 0 else 0
    turned = (rank + zlib.crc32(tenant.encode())) % replicas
    return limit // replicas + (1 if turned < limit % replicas else 0)


DEFAULT_QUOTA_NAME = "the router's default quota"


def no_quota(tenant: str) -> NoTenantQuota:
    return NoTenantQuota(
        f"tenant {tenant!r} has no TenantQuota, and this router admits no tenant without one: "
        f"create a TenantQuota with spec.tenant: {tenant} (in the namespace of the tenant's "
        "key Secret), or run the router with a default quota (--default-quota, or "
        "defaultQuota: in its config file)")


def rate_limits(spec: TenantQuotaSpec) -> dict[BorrowableResource, int | None]:
    """The per-minute limits of a spec, fleet-wide (None: unlimited)."""
    limits = spec.limits
    return {RPM: limits.requests_per_minute, INPUT_TPM: limits.input_tokens_per_minute,
            OUTPUT_TPM: limits.output_tokens_per_minute}


def borrow_cap(spec: TenantQuotaSpec, resource: BorrowableResource, limit: float) -> float:
    """How much of `resource` the tenant may borrow a minute (slots, for concurrency)."""
    borrowing = spec.borrowing
    if borrowing is None or resource not in borrowing.resources:
        return 0.0
    return limit * borrowing.max_percent / 100.0


def settle_refunds(reservation: Reservation, output_tokens: int, prompt_tokens: int
                   ) -> dict[BorrowableResource, float]:
    """What a settled request gives back (a negative amount is charged): the unused output
    reservation and the prompt estimate's error."""
    return {OUTPUT_TPM: float(reservation.output_reserved - output_tokens),
            INPUT_TPM: float(reservation.input_tokens - prompt_tokens)}


def refusal(tenant: str, quota_name: str, resource: BorrowableResource, limit: float,
            wait: float, detail: str, share: str = "") -> QuotaExceeded:
    retry = "; it can never fit: lower it" if math.isinf(wait) else (
        f"; retry after {max(1, math.ceil(wait))} s")
    return QuotaExceeded(
        f"tenant {tenant!r} is over {resource.value} = {limit:g}{share} of TenantQuota "
        f"{quota_name}: {detail}{retry}",
        retry_after=wait if not math.isinf(wait) else 60.0, limit=resource.value)


class QuotaLedger:
    """The limits of every tenant with a TenantQuota (or, with a default quota, of every
    tenant that has been admitted under it), on this router replica."""

    def __init__(self, replicas: int = 1, rank: int | None = None) -> None:
        self.replicas = max(1, replicas)
        self.rank = rank  # this router's place among them (None: unknown, shares rounded up)
        self._tenants: dict[str, TenantState] = {}
        self.default: TenantQuotaSpec | None = None
        self._explicit: set[str] = set()  # tenants with their own TenantQuota

    def set_quotas(self, quotas: dict[str, tuple[str, TenantQuotaSpec]], now: float,
                   default: TenantQuotaSpec | None = None) -> None:
        """tenant -> (TenantQuota namespace/name, spec); `default` for any other tenant (None:
        they are refused). Usage of kept tenants carries over; a changed limit resizes its
        bucket (never above the new capacity)."""
        self.default = default
        self._explicit = set(quotas)
        wanted = dict(quotas)
        if default is not None:  # tenants running on the default keep their buckets
            wanted.update({t: (DEFAULT_QUOTA_NAME, default) for t, s in self._tenants.items()
                           if t not in quotas})
        tenants: dict[str, TenantState] = {}
        for tenant, (name, spec) in wanted.items():
            state = self._tenants.get(tenant) or TenantState(tenant, name, spec)
            state.quota_name, state.spec = name, spec
            self._size_buckets(state, now)
            tenants[tenant] = state
        self._tenants = tenants

    def set_replicas(self, replicas: int, now: float, rank: int | None = None) -> None:
        """`replicas` routers enforce the limits, this one at place `rank` among them."""
        replicas = max(1, replicas)
        rank = None if rank is None else min(max(0, rank), replicas - 1)
        if (replicas, rank) != (self.replicas, self.rank):
            self.replicas, self.rank = replicas, rank
            self.set_quotas({t: (s.quota_name, s.spec) for t, s in self._tenants.items()
                             if t in self._explicit}, now, self.default)

    def _share(self, limit: int | None, tenant: str) -> int | None:
        return None if limit is None else share(limit, self.replicas, self.rank, tenant)

    def _limits(self, state: TenantState) -> dict[BorrowableResource, int | None]:
        return {r: self._share(v, state.tenant) for r, v in rate_limits(state.spec).items()}

    def _size_buckets(self, state: TenantState, now: float) -> None:
        """Creates, resizes (never above the new capacity) or drops the tenant's buckets to
        its spec's limits."""
        for resource, limit in self._limits(state).items():
            bucket = state.buckets.get(resource)
            if limit is None:
                state.buckets.pop(resource, None)
                continue
            if bucket is None:
                bucket = state.buckets[resource] = Bucket(limit, limit, now)
            else:
                bucket.refill(now)
                bucket.capacity, bucket.level = limit, min(bucket.level, limit)
            bucket.borrow_cap = borrow_cap(state.spec, resource, limit)

    def quota(self, tenant: str) -> TenantQuotaSpec | None:
        """The spec `tenant` is held to: its TenantQuota's, else the default, else None (it is
        refused)."""
        state = self._tenants.get(tenant)
        return state.spec if state is not None else self.default

    def state(self, tenant: str, now: float) -> TenantState:
        """The tenant's state, created for a default-quota tenant; raises NoTenantQuota
        when it has none."""
        state = self._tenants.get(tenant)
        if state is not None:
            return state
        if self.default is None:
            raise no_quota(tenant)
        state = TenantState(tenant, DEFAULT_QUOTA_NAME, self.default)
        self._size_buckets(state, now)
        self._tenants[tenant] = state
        return state

    def _concurrency_limit(self, state: TenantState) -> int | None:
        return self._share(state.spec.limits.max_concurrent_requests, state.tenant)

    def lenders(self, tenant: str) -> list[TenantState]:
        """Who `tenant` may borrow from: the other tenants with their own TenantQuota, in a
        fixed order (by name) that the shared ledger also uses."""
        return [self._tenants[t] for t in sorted(self._explicit)
                if t != tenant and t in self._tenants]

    def _refuse(self, state: TenantState, resource: BorrowableResource, limit: float,
                wait: float, detail: str) -> QuotaExceeded:
        part = f" (this router's 1/{self.replicas} share)" if self.replicas > 1 else ""
        fleet_limit = state.spec.limits.max_concurrent_requests if resource is CONCURRENCY \
            else rate_limits(state.spec)[resource]
        if limit == 0 and fleet_limit:
            # The limit's units are all on other routers: one of those may admit it now (a
            # limit of 0 itself refuses everywhere, and says so).
            wait, detail = 1.0, (f"{detail}; this router's share of the limit is 0, another "
                                 "router holds it")
        return refusal(state.tenant, state.quota_name, resource, limit, wait, detail, part)

    def _take_slot(self, state: TenantState) -> str | None:
        """A concurrency slot for a request of `state`'s tenant: its own (None) or a lender's
        (its name); raises QuotaExceeded when there is none."""
        limit = self._concurrency_limit(state)
        if limit is None or state.slots_used < limit:
            return None
        if state.slots_borrowed + 1 <= borrow_cap(state.spec, CONCURRENCY, limit):
            idle = [(lim - other.slots_used, other) for other in self.lenders(state.tenant)
                    if (lim := self._concurrency_limit(other)) is not None]
            most, lender = max(idle, key=lambda pair: pair[0], default=(0, None))
            if lender is not None and most > 0:
                return lender.tenant
        raise self._refuse(state, CONCURRENCY, limit, 1.0,
                           f"{state.in_flight} requests in flight")

    def _plan_tokens(self, state: TenantState, needs: dict[BorrowableResource, float],
                     now: float) -> dict[tuple[BorrowableResource, str], float]:
        """What the request borrows from whom ((resource, lender) -> amount), or raises
        QuotaExceeded: a bucket short of the need takes the rest from the lenders' levels,
        the most idle first, within its borrowing budget."""
        what = {RPM: "1 request", INPUT_TPM: f"{needs[INPUT_TPM]:.0f} prompt tokens",
                OUTPUT_TPM: f"max_tokens {needs[OUTPUT_TPM]:.0f}"}
        borrowed: dict[tuple[BorrowableResource, str], float] = {}
        for resource, need in needs.items():
            bucket = state.buckets.get(resource)
            if bucket is None:
                continue
            bucket.refill(now)
            if bucket.level >= need:
                continue
            short = need - max(0.0, bucket.level)
            lenders = []
            for other in self.lenders(state.tenant):
                if (theirs := other.buckets.get(resource)) is not None:
                    theirs.refill(now)
                    lenders.append((max(0.0, theirs.level), other.tenant))
            budget = max(0.0, bucket.borrow_cap - bucket.debt)
            extra = min(budget, sum(level for level, _ in lenders))
            if short > extra:
                wait = bucket.wait_for(need - extra, bucket.capacity + extra)
                raise self._refuse(state, resource, bucket.capacity, wait,
                                   f"needs {what[resource]}, {max(0.0, bucket.level):.0f} left")
            for level, lender in sorted(lenders, key=lambda pair: -pair[0]):
                if short <= 0:
                    break
                take = min(level, short)
                if take > 0:
                    borrowed[(resource, lender)], short = take, short - take
        return borrowed

    def precheck(self, tenant: str, now: float) -> None:
        """Raises what `admit` would raise for the smallest request (a slot, one request, one
        token each way), taking nothing: a key whose quota is spent is refused before its body
        is read or parsed (ten 4 MiB bodies of a spent key held 1 GB of parsed JSON)."""
        state = self.state(tenant, now)
        self._take_slot(state)
        self._plan_tokens(state, {RPM: 1.0, INPUT_TPM: 1.0, OUTPUT_TPM: 1.0}, now)

    def admit(self, tenant: str, input_tokens: int, max_output_tokens: int, now: float
              ) -> Reservation:
        """Takes the request's allowance, or raises QuotaExceeded taking nothing; a tenant
        without a TenantQuota (and no default) raises NoTenantQuota."""
        state = self.state(tenant, now)
        lender = self._take_slot(state)
        needs = {RPM: 1.0, INPUT_TPM: float(input_tokens), OUTPUT_TPM: float(max_output_tokens)}
        borrowed = self._plan_tokens(state, needs, now)
        for resource, need in needs.items():
            if (bucket := state.buckets.get(resource)) is None:
                continue
            lent = sum(v for (r, _), v in borrowed.items() if r is resource)
            bucket.level -= need - lent
            bucket.debt += lent
        for (resource, other), amount in borrowed.items():
            self._tenants[other].buckets[resource].level -= amount
        if lender is not None:
            self._tenants[lender].slots_lent += 1
            state.slots_borrowed += 1
        state.in_flight += 1
        state.requests_total += 1
        return Reservation(tenant, input_tokens, max_output_tokens, slot_lender=lender,
                           borrowed=borrowed)

    def settle(self, reservation: Reservation, output_tokens: int, now: float,
               prompt_tokens: int | None = None) -> None:
        """The request ended having generated `output_tokens`: unused reserved output goes
        back (to its lenders first), the concurrency slot is freed, and the prompt's estimate
        admission charged is corrected to the engine's own count when known. Idempotent."""
        if reservation.settled:
            return
        reservation.settled = True
        state = self._tenants.get(reservation.tenant)
        prompt = reservation.input_tokens if prompt_tokens is None else prompt_tokens
        if state is not None:
            state.in_flight = max(0, state.in_flight - 1)
            state.tokens_total += prompt + output_tokens
        if reservation.shared:
            return  # (the shared ledger settles its buckets; this only counts the usage)
        # What is owed to lenders is paid even if the borrower's TenantQuota is gone since.
        if reservation.slot_lender is not None:
            if state is not None:
                state.slots_borrowed = max(0, state.slots_borrowed - 1)
            if (lender := self._tenants.get(reservation.slot_lender)) is not None:
                lender.slots_lent = max(0, lender.slots_lent - 1)
        for resource, refund in settle_refunds(reservation, output_tokens, prompt).items():
            bucket = state.buckets.get(resource) if state is not None else None
            if bucket is not None:
                bucket.refill(now)
            for (r, other), amount in reservation.borrowed.items():
                theirs = self._tenants[other].buckets.get(r) if other in self._tenants else None
                if r is not resource or refund <= 0 or theirs is None:
                    continue
                back = min(amount, refund)
                theirs.refill(now)
                theirs.level = min(theirs.capacity, theirs.level + back)
                refund -= back
                if bucket is not None:
                    bucket.debt = max(0.0, bucket.debt - back)
            if bucket is not None:
                # An underestimate is charged now: the level may go below zero for a while.
                bucket.level = min(bucket.capacity, bucket.level + refund)

    def known(self, tenant: str) -> bool:
        """Whether the tenant has state here (a TenantQuota, or admitted on the default)."""
        return tenant in self._tenants

    def count_shared(self, state: TenantState, reservation: Reservation) -> Reservation:
        """A request the shared ledger admitted, counted in this router's usage report."""
        reservation.shared = True
        state.in_flight += 1
        state.requests_total += 1
        return reservation

    def remaining(self, tenant: str, now: float) -> dict[str, float]:
        """What each per-minute bucket of `tenant` has left now (resource name -> level)."""
        state = self._tenants.get(tenant)
        if state is None:
            return {}
        for bucket in state.buckets.values():
            bucket.refill(now)
        return {resource.value: round(bucket.level, 3)
                for resource, bucket in state.buckets.items()}

    def seed(self, tenant: str, remaining: dict[str, float], age: float, now: float) -> None:
        """A starting router's buckets from a report `age` seconds old: what was left then plus
        the refill since, never above what the bucket holds now."""
        state = self._tenants.get(tenant)
        if state is None:
            return
        for resource, bucket in state.buckets.items():
            if (left := remaining.get(resource.value)) is not None:
                bucket.refill(now)
                bucket.level = min(bucket.level, left + max(0.0, age) * bucket.rate)

    def usage(self, tenant: str) -> tuple[int, int, int] | None:
        """(requests admitted, tokens used, in flight) since this router started."""
        state = self._tenants.get(tenant)
        if state is None:
            return None
        return state.requests_total, state.tokens_total, state.in_flight
