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

Borrowing: for a limit listed in the quota's `borrowing.resources`, a tenant may go over by up
to `maxPercent` of the limit, as far as the other tenants leave that resource idle (the sum of
their unused allowance on this router).

Several router replicas: each enforces `1 / replicas` of every limit (rounded up, at least 1),
`replicas` being the Ready routers in its own Endpoints. The fleet-wide limit then holds as long
as clients' requests spread over the replicas (the Service balances connections); a client
pinned to one replica gets that replica's share.

Restarts: each router reports what its buckets have left into the TenantQuota's status every
`STATUS_INTERVAL_SECONDS` (see `kvfleet.router.cluster`), and a router that starts takes its
buckets from its own last report, or from that of a router pod that is gone (the lowest), plus
the refill since (`seed`). What a restart can lose is the admissions of the last interval
before it: at most 10 s of a tenant's traffic on that replica is admitted twice, never a whole
minute's allowance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvfleet.api.tenantquota import BorrowableResource, TenantQuotaSpec
from kvfleet.router.errors import NoTenantQuota, QuotaExceeded

RPM = BorrowableResource.REQUESTS_PER_MINUTE
INPUT_TPM = BorrowableResource.INPUT_TOKENS_PER_MINUTE
OUTPUT_TPM = BorrowableResource.OUTPUT_TOKENS_PER_MINUTE
CONCURRENCY = BorrowableResource.MAX_CONCURRENT_REQUESTS


@dataclass(slots=True)
class Bucket:
    capacity: float
    level: float
    updated: float

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
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
    in_flight: int = 0
    requests_total: int = 0
    tokens_total: int = 0


@dataclass(slots=True)
class Reservation:
    """What an admitted request holds until `QuotaLedger.settle`."""

    tenant: str
    input_tokens: int
    output_reserved: int
    settled: bool = False


def _share(limit: int, replicas: int) -> int:
    return max(1, math.ceil(limit / replicas)) if limit > 0 else 0


DEFAULT_QUOTA_NAME = "the router's default quota"


def no_quota(tenant: str) -> NoTenantQuota:
    return NoTenantQuota(
        f"tenant {tenant!r} has no TenantQuota, and this router admits no tenant without one: "
        f"create a TenantQuota with spec.tenant: {tenant} (in the namespace of the tenant's "
        "key Secret), or run the router with a default quota (--default-quota, or "
        "defaultQuota: in its config file)")


class QuotaLedger:
    """The limits of every tenant with a TenantQuota (or, with a default quota, of every
    tenant that has been admitted under it), on this router replica."""

    def __init__(self, replicas: int = 1) -> None:
        self.replicas = max(1, replicas)
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
            for resource, limit in self._limits(spec).items():
                bucket = state.buckets.get(resource)
                if limit is None:
                    state.buckets.pop(resource, None)
                elif bucket is None:
                    state.buckets[resource] = Bucket(limit, limit, now)
                else:
                    bucket.refill(now)
                    bucket.capacity, bucket.level = limit, min(bucket.level, limit)
            tenants[tenant] = state
        self._tenants = tenants

    def set_replicas(self, replicas: int, now: float) -> None:
        if max(1, replicas) != self.replicas:
            self.replicas = max(1, replicas)
            self.set_quotas({t: (s.quota_name, s.spec) for t, s in self._tenants.items()
                             if t in self._explicit}, now, self.default)

    def _limits(self, spec: TenantQuotaSpec) -> dict[BorrowableResource, int | None]:
        limits = spec.limits
        raw = {RPM: limits.requests_per_minute, INPUT_TPM: limits.input_tokens_per_minute,
               OUTPUT_TPM: limits.output_tokens_per_minute}
        return {r: None if v is None else _share(v, self.replicas) for r, v in raw.items()}

    def quota(self, tenant: str) -> TenantQuotaSpec | None:
        """The spec `tenant` is held to: its TenantQuota's, else the default, else None (it is
        refused)."""
        state = self._tenants.get(tenant)
        return state.spec if state is not None else self.default

    def _state(self, tenant: str, now: float) -> TenantState:
        state = self._tenants.get(tenant)
        if state is not None:
            return state
        if self.default is None:
            raise no_quota(tenant)
        state = TenantState(tenant, DEFAULT_QUOTA_NAME, self.default)
        for resource, limit in self._limits(self.default).items():
            if limit is not None:
                state.buckets[resource] = Bucket(limit, limit, now)
        self._tenants[tenant] = state
        return state

    def _concurrency_limit(self, state: TenantState) -> int | None:
        limit = state.spec.limits.max_concurrent_requests
        return None if limit is None else _share(limit, self.replicas)

    def _idle(self, resource: BorrowableResource, tenant: str, now: float) -> float:
        """Unused allowance of `resource` over every other tenant on this replica."""
        idle = 0.0
        for other in self._tenants.values():
            if other.tenant == tenant:
                continue
            if resource is CONCURRENCY:
                limit = self._concurrency_limit(other)
                idle += 0 if limit is None else max(0, limit - other.in_flight)
            elif (bucket := other.buckets.get(resource)) is not None:
                bucket.refill(now)
                idle += bucket.level
        return idle

    def _borrowable(self, state: TenantState, resource: BorrowableResource, limit: float,
                    now: float) -> float:
        borrowing = state.spec.borrowing
        if borrowing is None or resource not in borrowing.resources:
            return 0.0
        return min(limit * borrowing.max_percent / 100.0, self._idle(resource, state.tenant, now))

    def _refuse(self, state: TenantState, resource: BorrowableResource, limit: float,
                wait: float, detail: str) -> QuotaExceeded:
        share = f" (this router's 1/{self.replicas} share)" if self.replicas > 1 else ""
        retry = "; it can never fit: lower it" if math.isinf(wait) else (
            f"; retry after {max(1, math.ceil(wait))} s")
        return QuotaExceeded(
            f"tenant {state.tenant!r} is over {resource.value} = {limit:g}{share} of "
            f"TenantQuota {state.quota_name}: {detail}{retry}",
            retry_after=wait if not math.isinf(wait) else 60.0, limit=resource.value)

    def admit(self, tenant: str, input_tokens: int, max_output_tokens: int, now: float
              ) -> Reservation:
        """Takes the request's allowance, or raises QuotaExceeded taking nothing; a tenant
        without a TenantQuota (and no default) raises NoTenantQuota."""
        state = self._state(tenant, now)
        concurrency = self._concurrency_limit(state)
        if concurrency is not None:
            ceiling = concurrency + self._borrowable(state, CONCURRENCY, concurrency, now)
            if state.in_flight + 1 > ceiling:
                raise self._refuse(state, CONCURRENCY, concurrency, 1.0,
                                   f"{state.in_flight} requests in flight")
        needs = {RPM: 1.0, INPUT_TPM: float(input_tokens), OUTPUT_TPM: float(max_output_tokens)}
        what = {RPM: "1 request", INPUT_TPM: f"{input_tokens} prompt tokens",
                OUTPUT_TPM: f"max_tokens {max_output_tokens}"}
        for resource, need in needs.items():
            bucket = state.buckets.get(resource)
            if bucket is None:
                continue
            bucket.refill(now)
            extra = self._borrowable(state, resource, bucket.capacity, now)
            # Borrowed allowance lets the level go below zero, by at most `extra`.
            if bucket.level + extra < need:
                wait = bucket.wait_for(need - extra, bucket.capacity + extra)
                raise self._refuse(state, resource, bucket.capacity, wait,
                                   f"needs {what[resource]}, {max(0.0, bucket.level):.0f} left")
        for resource, need in needs.items():
            if (bucket := state.buckets.get(resource)) is not None:
                bucket.level -= need
        state.in_flight += 1
        state.requests_total += 1
        return Reservation(tenant, input_tokens, max_output_tokens)

    def settle(self, reservation: Reservation, output_tokens: int, now: float,
               prompt_tokens: int | None = None) -> None:
        """The request ended having generated `output_tokens`: unused reserved output goes
        back, the concurrency slot is freed, and the prompt's estimate admission charged is
        corrected to the engine's own count when known. Idempotent."""
        if reservation.settled:
            return
        reservation.settled = True
        state = self._tenants.get(reservation.tenant)
        if state is None:
            return
        state.in_flight = max(0, state.in_flight - 1)
        prompt = reservation.input_tokens if prompt_tokens is None else prompt_tokens
        state.tokens_total += prompt + output_tokens
        for resource, refund in ((OUTPUT_TPM, reservation.output_reserved - output_tokens),
                                 (INPUT_TPM, reservation.input_tokens - prompt)):
            bucket = state.buckets.get(resource)
            if bucket is not None and refund:
                bucket.refill(now)
                # An underestimate is charged now: the level may go below zero for a while.
                bucket.level = min(bucket.capacity, bucket.level + refund)

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
