"""The fleet's quota ledger in Redis: every router replica admits against the same buckets,
concurrency slots and borrowing, each decision one atomic script.

The rules are those of `kvfleet.router.quota.QuotaLedger` (token buckets refilling at limit/60
a second, output reserved then settled, borrowing from the most idle lenders within a per-minute
budget, refunds to lenders first), here enforced on the fleet-wide limits instead of a
replica's share. A test drives both with the same operations and checks they decide alike
(tests/integration/test_fleet_ledger.py).

Keys, under a prefix (`--redis-prefix`, default "kvfleet"), per tenant:
  <prefix>:q:<tenant>      hash: per resource its level and when (`rpm`, `rpm:t`) and its debt
                           (`rpm:d`, `rpm:dt`); gone after 2 idle minutes (it is full by then)
  <prefix>:s:<tenant>      sorted set: the tenant's concurrency slots in use, request id ->
                           lease expiry (its own requests, and borrowers' holding its slots)
  <prefix>:o:<tenant>      sorted set: the slots this tenant's requests hold of other tenants'
Time is the Redis server's (`TIME`), one clock for every router. A slot is a lease of
LEASE_SECONDS that its router renews while the request runs: a router that dies frees its
slots within a lease, and a settle that never arrives (Redis away at that moment) costs at
most a lease.

When Redis cannot be reached (or answers an error) the router falls back to its own ledger,
where it enforces its share of each limit (the routers' shares sum to the limit, see
`kvfleet.router.quota`): the declared degraded mode. It says so in its
log (once per outage), in `kvfleet_router_shared_ledger_up` and in each TenantQuota's
`FleetWide` condition. The fallback is a breaker: once open, no client request waits on Redis
again; a background PING every RETRY_SECONDS closes it when Redis answers (before, every
request due for a retry waited out its own timeout, and reconnects queued behind one lock, so
at tens of requests a second a hung Redis stalled admission). A command answers within
`timeout` (0.1 s by default, `--redis-timeout`) or the connection is dropped and every call on
it falls back at once: a hung Redis (a stopped process, a blackholed port) adds at most that
to the requests in flight when it hung. A fallback's buckets start full: an outage can admit
up to one extra minute's allowance per replica. A Redis that answers too late may still have
run the script: the request is then charged twice (once there, once here) and its slot there
held a lease — more than it used, never less.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvfleet.api.tenantquota import BorrowableResource
from kvfleet.router.errors import QuotaExceeded
from kvfleet.router.quota import (
    CONCURRENCY,
    INPUT_TPM,
    OUTPUT_TPM,
    RPM,
    Bucket,
    QuotaLedger,
    Reservation,
    borrow_cap,
    rate_limits,
    refusal,
    settle_refunds,
)
from kvfleet.router.resp import Redis, ReplyError

log = logging.getLogger("kvfleet.router")

LEASE_SECONDS = 30.0
RENEW_SECONDS = 10.0
RETRY_SECONDS = 2.0
COMMAND_SECONDS = 0.1  # a reply's deadline (--redis-timeout)
# A connection refused or reset, a timeout, an error reply: Redis cannot decide, the fallback
# does.
# ConnectionError and TimeoutError are OSErrors; an error reply (a script's bug, a Redis out
# of memory) is treated the same: the ledger falls back rather than refuse every request.
UNREACHABLE = (ReplyError, OSError)
RESOURCES = (RPM, INPUT_TPM, OUTPUT_TPM)  # the scripts' order: index 1, 2, 3

# Shared by the scripts: the clock, and a bucket's level and debt refilled to now.
_COMMON = """
local RES = {'rpm', 'itpm', 'otpm'}
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function num(i) return tonumber(ARGV[i]) end
local function level(key, r, cap)
  local v = redis.call('HMGET', key, r, r .. ':t')
  local l, t = tonumber(v[1]), tonumber(v[2])
  if not l then return cap end
  return math.min(cap, l + math.max(0, now - t) * cap / 60)
end
local function debt(key, r, bcap)
  local v = redis.call('HMGET', key, r .. ':d', r .. ':dt')
  local d, t = tonumber(v[1]), tonumber(v[2])
  if not d then return 0 end
  return math.max(0, d - math.max(0, now - t) * bcap / 60)
end
local function put(key, r, value)
  redis.call('HSET', key, r, string.format('%.17g', value), r .. ':t', string.format('%.17g', now))
  redis.call('EXPIRE', key, 120)
end
local function put_debt(key, r, value)
  redis.call('HSET', key, r .. ':d', string.format('%.17g', value),
             r .. ':dt', string.format('%.17g', now))
  redis.call('EXPIRE', key, 120)
end
local function used(key)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  return redis.call('ZCARD', key)
end
"""

# KEYS: own q, s, o; then per lender its q and s. ARGV: now, id, lease, lenders, own caps (3,
# -1: none), own borrowing budgets (3), needs (3), concurrency limit (-1: none), slots it may
# borrow; then per lender its caps (3) and concurrency limit. Returns {1, lender index or 0,
# borrowed entries (resource index, lender index, amount)...} or {0, resource, level, extra}.
_ADMIT = _COMMON + """
local id, lease, n = ARGV[2], num(3), num(4)
local own, slots, out = KEYS[1], KEYS[2], KEYS[3]
local function lender_arg(i, k) return num(16 + 4 * (i - 1) + k) end
local conc, slot_key, lender = num(14), slots, 0
if conc >= 0 and used(slots) >= conc then
  local best = 0
  if used(out) + 1 <= num(15) then
    for i = 1, n do
      local lc = lender_arg(i, 3)
      if lc >= 0 then
        local idle = lc - used(KEYS[3 + 2 * i])
        if idle > best then best, lender = idle, i end
      end
    end
  end
  if lender == 0 then return {0, 'maxConcurrentRequests', tostring(used(slots)), '0'} end
  slot_key = KEYS[3 + 2 * lender]
end
local borrowed, levels = {}, {}
for ri, r in ipairs(RES) do
  local cap, need = num(4 + ri), num(10 + ri)
  if cap >= 0 then
    local l = level(own, r, cap)
    levels[ri] = l
    if l < need then
      local short, lenders, idle = need - math.max(0, l), {}, 0
      for i = 1, n do
        local lcap = lender_arg(i, ri - 1)
        if lcap >= 0 then
          local ll = math.max(0, level(KEYS[2 + 2 * i], r, lcap))
          table.insert(lenders, {ll, i})
          idle = idle + ll
        end
      end
      local extra = math.min(math.max(0, num(7 + ri) - debt(own, r, num(7 + ri))), idle)
      if short > extra then
        return {0, r, string.format('%.17g', l), string.format('%.17g', extra)}
      end
      table.sort(lenders, function(a, b)
        if a[1] ~= b[1] then return a[1] > b[1] end
        return a[2] < b[2]
      end)
      for _, e in ipairs(lenders) do
        if short <= 0 then break end
        local take = math.min(e[1], short)
        if take > 0 then
          table.insert(borrowed, {ri, e[2], take})
          short = short - take
        end
      end
    end
  end
end
local reply = {1, lender}
for ri, r in ipairs(RES) do
  if levels[ri] then
    local lent = 0
    for _, b in ipairs(borrowed) do
      if b[1] == ri then lent = lent + b[3] end
    end
    put(own, r, levels[ri] - (num(10 + ri) - lent))
    if lent > 0 then put_debt(own, r, debt(own, r, num(7 + ri)) + lent) end
  end
end
for _, b in ipairs(borrowed) do
  local key, r = KEYS[2 + 2 * b[2]], RES[b[1]]
  put(key, r, level(key, r, lender_arg(b[2], b[1] - 1)) - b[3])
  table.insert(reply, b[1])
  table.insert(reply, b[2])
  table.insert(reply, string.format('%.17g', b[3]))
end
if conc >= 0 then
  redis.call('ZADD', slot_key, now + lease, id)
  redis.call('EXPIRE', slot_key, math.ceil(lease * 2))
  if lender > 0 then
    redis.call('ZADD', out, now + lease, id)
    redis.call('EXPIRE', out, math.ceil(lease * 2))
  end
end
return reply
"""

# KEYS: own q, the slot's set, own o, then the q of each borrowed entry's lender. ARGV: now, id,
# own caps (3), own borrowing budgets (3), refunds (3), entries, then per entry: resource
# index, amount, the lender's cap of it.
_SETTLE = _COMMON + """
local id, m = ARGV[2], num(12)
redis.call('ZREM', KEYS[2], id)
redis.call('ZREM', KEYS[3], id)
for ri, r in ipairs(RES) do
  local cap, bcap, refund = num(2 + ri), num(5 + ri), num(8 + ri)
  local l = cap >= 0 and level(KEYS[1], r, cap) or nil
  for j = 1, m do
    local base = 13 + 3 * (j - 1)
    if num(base) == ri and refund > 0 then
      local back, key, lcap = math.min(num(base + 1), refund), KEYS[3 + j], num(base + 2)
      put(key, r, math.min(lcap, level(key, r, lcap) + back))
      if l then put_debt(KEYS[1], r, math.max(0, debt(KEYS[1], r, bcap) - back)) end
      refund = refund - back
    end
  end
  if l and refund ~= 0 then put(KEYS[1], r, math.min(cap, l + refund)) end
end
return 1
"""

# KEYS: slot sets; ARGV: now, lease, then the id held in each. Renews the leases of requests
# still running, and the sets' own expiry; re-adds a lease that ran out while Redis was away
# (a request settled just before costs at most one lease).
_RENEW = _COMMON + """
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, now + num(2), ARGV[2 + i])
  redis.call('EXPIRE', key, math.ceil(num(2) * 2))
end
return 1
"""

# KEYS: own q; ARGV: now, caps (3). The levels now (for status reports and tests).
_LEVELS = _COMMON + """
local reply = {}
for ri, r in ipairs(RES) do
  local cap = num(1 + ri)
  table.insert(reply, cap >= 0 and string.format('%.17g', level(KEYS[1], r, cap)) or '')
end
return reply
"""


def _cap(value: float | None) -> float:
    return -1.0 if value is None else float(value)


# The longest a Redis refusal is trusted without asking Redis again: a spent tenant's bodies
# go unread meanwhile, and a hostile client's flood costs one read a second per router.
SPENT_SECONDS = 1.0


class SharedLedger:
    """Admission against the fleet-wide limits in Redis, with the router's own `QuotaLedger`
    (`local`) as the specs' source, the usage counter, and the fallback while Redis is away.

    `client` is a `resp.Redis` (or anything with the same `register_script`)."""

    def __init__(self, local: QuotaLedger, client: Any, prefix: str = "kvfleet",
                 where: str = "redis", on_change: Callable[[bool], None] | None = None,
                 clock: Callable[[], float | None] = lambda: None) -> None:
        self.local, self.client, self.prefix, self.where = local, client, prefix, where
        self.up = True
        self.down_since: float | None = None
        self.down_reason = ""
        self._on_change = on_change or (lambda _: None)
        self._clock = clock  # tests pin the scripts' time; None: the Redis server's TIME
        self._admit = client.register_script(_ADMIT)
        self._settle = client.register_script(_SETTLE)
        self._renew = client.register_script(_RENEW)
        self._levels = client.register_script(_LEVELS)
        # id -> the slot sets its lease is in (its slot's, and its tenant's `o` when the
        # slot is borrowed), while the request runs
        self._held: dict[str, list[str]] = {}
        self._pending: set[asyncio.Task[None]] = set()
        # tenant -> (until, the refusal then): Redis refused it with nothing left for even the
        # smallest request, so until then (at most SPENT_SECONDS: other routers' requests end
        # and refund unseen here) its requests are refused before their bodies are read
        # (`precheck`), as the router's own ledger does without Redis.
        self._spent: dict[str, tuple[float, Callable[[float], QuotaExceeded]]] = {}

    # ---- keys

    def _key(self, kind: str, tenant: str) -> str:
        return f"{self.prefix}:{kind}:{tenant}"

    def _now(self) -> str:
        now = self._clock()
        return "" if now is None else repr(now)

    # ---- admission

    def precheck(self, tenant: str, now: float) -> None:
        """`QuotaLedger.precheck` without a Redis round trip: refuses a tenant whose last
        refusal left nothing for the smallest request (still so until it refills), or, while
        Redis is away, what this replica's share would refuse. Takes nothing."""
        self.local.state(tenant, now)  # raises NoTenantQuota
        if not self.up:
            self.local.precheck(tenant, now)
            return
        spent = self._spent.get(tenant)
        if spent is None:
            return
        until, refused = spent
        if now >= until:
            del self._spent[tenant]
            return
        raise refused(until - now)

    async def admit(self, tenant: str, input_tokens: int, max_output_tokens: int,
                    now: float) -> Reservation:
        """Like `QuotaLedger.admit`, on the fleet-wide buckets; on this replica's share while
        Redis is away."""
        state = self.local.state(tenant, now)  # raises NoTenantQuota
        if not self.up:  # (the breaker is open: `keep_leases` closes it)
            return self.local.admit(tenant, input_tokens, max_output_tokens, now)
        spec, lenders = state.spec, self.local.lenders(tenant)
        limits = rate_limits(spec)
        concurrency = spec.limits.max_concurrent_requests
        keys = [self._key("q", tenant), self._key("s", tenant), self._key("o", tenant)]
        args: list[Any] = [self._now(), rid := uuid.uuid4().hex, LEASE_SECONDS, len(lenders)]
        args += [_cap(limits[r]) for r in RESOURCES]
        args += [borrow_cap(spec, r, limits[r] or 0) for r in RESOURCES]
        args += [1, input_tokens, max_output_tokens]
        args += [_cap(concurrency), borrow_cap(spec, CONCURRENCY, concurrency or 0)]
        for lender in lenders:
            keys += [self._key("q", lender.tenant), self._key("s", lender.tenant)]
            theirs = rate_limits(lender.spec)
            args += [_cap(theirs[r]) for r in RESOURCES]
            args.append(_cap(lender.spec.limits.max_concurrent_requests))
        try:
            reply = await self._admit(keys=keys, args=args)
        except UNREACHABLE as exc:
            self._lost(exc)
            return self.local.admit(tenant, input_tokens, max_output_tokens, now)
        self._back()
        if int(reply[0]) == 0:
            raise self._refused(state.tenant, state.quota_name, reply, concurrency, limits,
                                input_tokens, max_output_tokens, now)
        lender_name = lenders[int(reply[1]) - 1].tenant if int(reply[1]) else None
        borrowed: dict[tuple[BorrowableResource, str], float] = {}
        for i in range(2, len(reply), 3):
            resource, who = RESOURCES[int(reply[i]) - 1], lenders[int(reply[i + 1]) - 1].tenant
            borrowed[(resource, who)] = float(reply[i + 2])
        reservation = Reservation(tenant, input_tokens, max_output_tokens, id=rid,
                                  slot_lender=lender_name, borrowed=borrowed)
        if concurrency is not None:
            held = [self._key("s", lender_name or tenant)]
            if lender_name is not None:
                held.append(self._key("o", tenant))
            self._held[rid] = held
        return self.local.count_shared(state, reservation)

    def _refused(self, tenant: str, quota_name: str, reply: list[Any], concurrency: int | None,
                 limits: dict[BorrowableResource, int | None], input_tokens: int,
                 max_output_tokens: int, now: float) -> Exception:
        name = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
        if name == "maxConcurrentRequests":
            detail = f"{int(float(reply[2]))} requests in flight"
            self._spent[tenant] = (now + SPENT_SECONDS, lambda wait: refusal(
                tenant, quota_name, CONCURRENCY, float(concurrency or 0), wait, detail))
            return refusal(tenant, quota_name, CONCURRENCY, float(concurrency or 0), 1.0, detail)
        resource = RESOURCES[["rpm", "itpm", "otpm"].index(name)]
        need = {RPM: 1, INPUT_TPM: input_tokens, OUTPUT_TPM: max_output_tokens}[resource]
        what = {RPM: "1 request", INPUT_TPM: f"{input_tokens} prompt tokens",
                OUTPUT_TPM: f"max_tokens {max_output_tokens}"}[resource]
        capacity, level, extra = float(limits[resource] or 0), float(reply[2]), float(reply[3])
        bucket = Bucket(capacity, level, 0.0)
        wait = bucket.wait_for(need - extra, capacity + extra)
        refused = refusal(tenant, quota_name, resource, capacity, wait,
                          f"needs {what}, {max(0.0, level):.0f} left")
        smallest = bucket.wait_for(1 - extra, capacity + extra)
        if smallest > 0 and not math.isinf(smallest):
            spent = f"{max(0.0, level):.0f} left, not enough for any request"
            self._spent[tenant] = (now + min(smallest, SPENT_SECONDS), lambda wait: refusal(
                tenant, quota_name, resource, capacity, wait, spent))
        return refused

    # ---- settling

    def settle(self, reservation: Reservation, output_tokens: int, now: float,
               prompt_tokens: int | None = None) -> None:
        """Like `QuotaLedger.settle`; a shared reservation is settled in Redis in the
        background (the caller is a response's close, which cannot wait)."""
        if reservation.settled:
            return
        self._spent.clear()  # (a slot freed, tokens refunded: any tenant may fit again)
        self.local.settle(reservation, output_tokens, now, prompt_tokens)
        if not reservation.shared:
            return
        prompt = reservation.input_tokens if prompt_tokens is None else prompt_tokens
        task = asyncio.get_running_loop().create_task(
            self._settle_shared(reservation, output_tokens, prompt, now))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _settle_shared(self, reservation: Reservation, output_tokens: int,
                             prompt_tokens: int, now: float) -> None:
        held = self._held.pop(reservation.id, None)
        tenant = reservation.tenant
        # Its TenantQuota gone since: no buckets of its own to settle, but the slot and what
        # its lenders are owed still are.
        spec = self.local.quota(tenant) if self.local.known(tenant) else None
        limits = rate_limits(spec) if spec is not None else dict.fromkeys(RESOURCES)
        refunds = settle_refunds(reservation, output_tokens, prompt_tokens)
        slot = held[0] if held else self._key("s", tenant)
        keys = [self._key("q", tenant), slot, self._key("o", tenant)]
        args: list[Any] = [self._now(), reservation.id]
        args += [_cap(limits[r]) for r in RESOURCES]
        args += [borrow_cap(spec, r, limits[r] or 0) if spec is not None else 0.0
                 for r in RESOURCES]
        args += [refunds.get(r, 0.0) for r in RESOURCES]
        entries = []
        for (resource, lender), amount in reservation.borrowed.items():
            lender_spec = self.local.quota(lender) if self.local.known(lender) else None
            cap = None if lender_spec is None else rate_limits(lender_spec)[resource]
            if cap is not None:
                keys.append(self._key("q", lender))
                entries += [RESOURCES.index(resource) + 1, amount, cap]
        args += [len(entries) // 3, *entries]
        try:
            await self._settle(keys=keys, args=args)
        except UNREACHABLE as exc:
            # Not retried: the slot's lease runs out by itself, and the refund not given
            # back leaves the tenant charged more than it used, never less.
            self._lost(exc)

    async def drain(self) -> None:
        """Waits for the settles under way (tests; the router's shutdown)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    # ---- leases and health

    async def keep_leases(self) -> None:
        """Renews the slot leases of the requests still running, every RENEW_SECONDS; while
        Redis is away, asks it every RETRY_SECONDS whether it is back."""
        renew_at = time.monotonic() + RENEW_SECONDS
        while True:
            await asyncio.sleep(RETRY_SECONDS)
            if not self.up:
                await self.probe()
            if time.monotonic() >= renew_at:
                renew_at = time.monotonic() + RENEW_SECONDS
                await self.renew()

    async def probe(self) -> None:
        """Closes the breaker if Redis answers a PING."""
        try:
            await self.client.execute("PING")
        except UNREACHABLE as exc:
            self.down_reason = f"{type(exc).__name__}: {exc}"[:200]
            return
        self._back()

    async def renew(self) -> None:
        keys, ids = [], []
        for rid, held in list(self._held.items()):
            keys += held
            ids += [rid] * len(held)
        if not keys:
            return
        try:
            await self._renew(keys=keys, args=[self._now(), LEASE_SECONDS, *ids])
        except UNREACHABLE as exc:
            self._lost(exc)

    async def levels(self, tenant: str) -> dict[str, float]:
        """What the tenant's fleet-wide buckets hold now (resource name -> level)."""
        spec = self.local.quota(tenant)
        if spec is None:
            return {}
        limits = rate_limits(spec)
        reply = await self._levels(keys=[self._key("q", tenant)],
                                   args=[self._now(), *(_cap(limits[r]) for r in RESOURCES)])
        return {r.value: float(v) for r, v in zip(RESOURCES, reply, strict=True) if v}

    def _lost(self, exc: BaseException) -> None:
        if not self.up:
            return
        self.up, self.down_since = False, time.time()
        self.down_reason = f"{type(exc).__name__}: {exc}"[:200]
        log.error("shared quota ledger at %s unreachable (%s): each limit is now enforced as "
                  "this router's 1/%d share until it is back", self.where, self.down_reason,
                  self.local.replicas)
        self._on_change(False)

    def _back(self) -> None:
        if self.up:
            return
        self.up, self.down_since = True, None
        log.warning("shared quota ledger at %s is back: limits are fleet-wide again",
                    self.where)
        self._on_change(True)

    def condition(self) -> tuple[bool, str, str]:
        """(status, reason, message) of the TenantQuotas' FleetWide condition."""
        if self.up:
            return True, "SharedLedger", f"limits are enforced fleet-wide (ledger at {self.where})"
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.down_since or 0))
        return False, "SharedLedgerUnavailable", (
            f"the shared ledger at {self.where} is unreachable since {since} "
            f"({self.down_reason}): each router enforces its 1/{self.local.replicas} share "
            "of every limit")


def connect(url: str, prefix: str, local: QuotaLedger,
            on_change: Callable[[bool], None] | None = None,
            timeout: float = COMMAND_SECONDS) -> SharedLedger:
    """A shared ledger at a redis:// URL. Short timeouts: a Redis that hangs must not hold
    admissions, they fall back to the local share (connecting may take a TLS handshake: at
    least 0.25 s)."""
    client = Redis.from_url(url, timeout=timeout, connect_timeout=max(timeout, 0.25))
    where = url.split("@")[-1]  # never a password in logs or conditions
    return SharedLedger(local, client, prefix, where, on_change)
