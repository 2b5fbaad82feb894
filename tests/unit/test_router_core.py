"""The router's pure core: keys, quotas, traffic split, replica choice, config."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.api.servingpool import ServingPoolStatus, TrafficRole, TrafficTarget
from kvfleet.api.tenantquota import BorrowableResource, Borrowing, Limits, TenantQuotaSpec
from kvfleet.router.errors import BadRequest, NoTenantQuota, QuotaExceeded, Unauthorized
from kvfleet.router.keys import KeyRing
from kvfleet.router.picker import EndpointLoad, pick
from kvfleet.router.quota import QuotaLedger, share
from kvfleet.router.state import ConfigError, parse_config
from kvfleet.router.traffic import TrafficTable, conversation_key, session_key

STABLE, CANARY, SHADOW = "a" * 64, "b" * 64, "c" * 64
KEY = "sk-team-a-0123456789abcdef"


def secret(name: str, tenant: str | None, key: str | None) -> dict[str, object]:
    labels = {"kvfleet.io/tenant": tenant} if tenant else {}
    data = {"key": base64.b64encode(key.encode()).decode()} if key else {}
    return {"metadata": {"name": name, "namespace": "llm", "labels": labels}, "data": data}


def test_keys_from_secrets_authenticate_tenants_and_never_log_a_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        ring = KeyRing.from_secrets([secret("a", "team-a", KEY), secret("b", None, "x" * 20),
                                     secret("c", "team-c", "short")])
    assert len(ring) == 1
    assert ring.tenant_for(f"Bearer {KEY}") == "team-a"
    assert ring.tenant_for(f"bearer  {KEY} ") == "team-a"
    assert "Secret llm/b" in caplog.text and "Secret llm/c" in caplog.text
    assert "x" * 20 not in caplog.text and "short" not in caplog.text.replace("skipped", "")
    for header, message in [(None, "no API key"), ("Basic abc", "must be 'Bearer <key>'"),
                            (f"Bearer {KEY}x", "invalid API key")]:
        with pytest.raises(Unauthorized, match=message) as info:
            ring.tenant_for(header)
        assert info.value.status == 401 and KEY not in info.value.message


def quota(**limits: int) -> TenantQuotaSpec:
    return TenantQuotaSpec(tenant="team-a", limits=Limits(**limits))


def test_rates_are_token_buckets_and_a_refusal_names_the_limit_and_quota() -> None:
    ledger = QuotaLedger()
    ledger.set_quotas({"team-a": ("llm/team-a", quota(requests_per_minute=60))}, now=0.0)
    for _ in range(60):  # a whole minute's allowance at once
        ledger.settle(ledger.admit("team-a", 10, 10, now=0.0), 10, now=0.0)
    with pytest.raises(QuotaExceeded) as info:
        ledger.admit("team-a", 10, 10, now=0.0)
    assert "requestsPerMinute = 60 of TenantQuota llm/team-a" in info.value.message
    assert info.value.headers() == {"retry-after": "1"}  # one request refills in 1 s
    ledger.admit("team-a", 10, 10, now=1.0)


def test_a_tenant_without_a_tenantquota_is_refused_or_held_to_the_default() -> None:
    """Fail closed: a key whose tenant has no TenantQuota was unlimited."""
    ledger = QuotaLedger()
    ledger.set_quotas({"team-a": ("llm/team-a", quota(requests_per_minute=60))}, now=0.0)
    with pytest.raises(NoTenantQuota, match="tenant 'other' has no TenantQuota") as info:
        ledger.admit("other", 1, 1, now=0.0)
    assert info.value.status == 403 and "--default-quota" in info.value.message
    assert ledger.quota("other") is None
    # With a default quota each such tenant gets its own buckets of it.
    default = TenantQuotaSpec(tenant="default", limits=Limits(requests_per_minute=2))
    ledger.set_quotas({"team-a": ("llm/team-a", quota(requests_per_minute=60))}, 0.0, default)
    for tenant in ("other", "third"):
        ledger.admit(tenant, 1, 1, now=0.0)
        ledger.admit(tenant, 1, 1, now=0.0)
        with pytest.raises(QuotaExceeded, match="of TenantQuota the router's default quota"):
            ledger.admit(tenant, 1, 1, now=0.0)
    # A state change (any watched object) does not refill them; replicas resize them.
    ledger.set_quotas({"team-a": ("llm/team-a", quota(requests_per_minute=60))}, 0.0, default)
    with pytest.raises(QuotaExceeded):
        ledger.admit("other", 1, 1, now=0.0)
    assert ledger.usage("other") == (2, 0, 2)
    # Its own TenantQuota replaces the default; without a default, others are refused again.
    ledger.set_quotas({"other": ("llm/other", quota(requests_per_minute=60))}, 1.0)
    ledger.admit("other", 1, 1, now=2.0)  # (its bucket's level carries over, as on any edit)
    with pytest.raises(NoTenantQuota):
        ledger.admit("third", 1, 1, now=2.0)


def test_output_tokens_are_reserved_then_settled_to_the_real_count() -> None:
    ledger = QuotaLedger()
    ledger.set_quotas({"team-a": ("llm/team-a", quota(output_tokens_per_minute=1000))}, 0.0)
    first = ledger.admit("team-a", 5, 800, now=0.0)
    with pytest.raises(QuotaExceeded, match="outputTokensPerMinute") as info:
        ledger.admit("team-a", 5, 300, now=0.0)  # 800 reserved, 200 left
    assert 5 <= info.value.retry_after <= 7  # 100 tokens at 1000/60 a second
    ledger.settle(first, 50, now=0.0)  # only 50 generated: 750 come back
    ledger.settle(first, 50, now=0.0)  # idempotent
    ledger.admit("team-a", 5, 900, now=0.0)
    with pytest.raises(QuotaExceeded, match="it can never fit"):
        ledger.admit("team-a", 5, 5000, now=0.0)


def test_concurrency_counts_in_flight_requests_until_settled() -> None:
    ledger = QuotaLedger()
    ledger.set_quotas({"team-a": ("llm/team-a", quota(max_concurrent_requests=2))}, 0.0)
    held = [ledger.admit("team-a", 1, 1, 0.0), ledger.admit("team-a", 1, 1, 0.0)]
    with pytest.raises(QuotaExceeded, match=r"maxConcurrentRequests = 2 .*2 requests in flight"):
        ledger.admit("team-a", 1, 1, 0.0)
    ledger.settle(held[0], 1, 0.0)
    ledger.admit("team-a", 1, 1, 0.0)
    assert ledger.usage("team-a") == (3, 2, 2)


def test_borrowing_uses_other_tenants_idle_allowance_up_to_max_percent() -> None:
    borrower = TenantQuotaSpec(tenant="team-a", limits=Limits(max_concurrent_requests=2),
                               borrowing=Borrowing(resources=[
                                   BorrowableResource.MAX_CONCURRENT_REQUESTS], max_percent=50))
    lender = TenantQuotaSpec(tenant="team-b", limits=Limits(max_concurrent_requests=1))
    ledger = QuotaLedger()
    ledger.set_quotas({"team-a": ("llm/a", borrower), "team-b": ("llm/b", lender)}, 0.0)
    for _ in range(3):  # 2 + 50 %
        ledger.admit("team-a", 1, 1, 0.0)
    with pytest.raises(QuotaExceeded):
        ledger.admit("team-a", 1, 1, 0.0)
    # team-b busy: nothing idle to borrow.
    ledger2 = QuotaLedger()
    ledger2.set_quotas({"team-a": ("llm/a", borrower), "team-b": ("llm/b", lender)}, 0.0)
    ledger2.admit("team-b", 1, 1, 0.0)
    ledger2.admit("team-a", 1, 1, 0.0)
    ledger2.admit("team-a", 1, 1, 0.0)
    with pytest.raises(QuotaExceeded):
        ledger2.admit("team-a", 1, 1, 0.0)


def test_a_lender_gets_its_slot_and_tokens_back_when_the_borrowers_quota_is_gone() -> None:
    borrower = TenantQuotaSpec(tenant="team-a", limits=Limits(
        max_concurrent_requests=1, output_tokens_per_minute=100), borrowing=Borrowing(
        resources=[BorrowableResource.MAX_CONCURRENT_REQUESTS,
                   BorrowableResource.OUTPUT_TOKENS_PER_MINUTE], max_percent=100))
    lender = TenantQuotaSpec(tenant="team-b", limits=Limits(
        max_concurrent_requests=1, output_tokens_per_minute=100))
    ledger = QuotaLedger()
    both = {"team-a": ("llm/a", borrower), "team-b": ("llm/b", lender)}
    ledger.set_quotas(both, 0.0)
    own = ledger.admit("team-a", 1, 100, 0.0)
    lent = ledger.admit("team-a", 1, 100, 0.0)  # team-b's slot and its 100 tokens
    assert lent.slot_lender == "team-b" and lent.borrowed
    with pytest.raises(QuotaExceeded):
        ledger.admit("team-b", 1, 1, 0.0)
    ledger.set_quotas({"team-b": ("llm/b", lender)}, 0.0)  # team-a's TenantQuota deleted
    for reservation in (own, lent):
        ledger.settle(reservation, 0, 0.0)
    ledger.admit("team-b", 1, 100, 0.0)  # its slot and its whole minute are back


def test_a_replaced_token_follows_its_pool_not_the_name_clients_use() -> None:
    from kvfleet.router.state import PoolRoute, RouterState, carry_loads

    old, new = RouterState(), RouterState()
    old.pools["ns1/llm"] = old.pools["llm"] = PoolRoute("llm", None, router_token="tok-ns1" * 3,
                                                        namespace="ns1")
    # ns1's pool went away and ns2's came in one change: the bare name now means ns2's.
    new.pools["ns2/llm"] = new.pools["llm"] = PoolRoute("llm", None, router_token="tok-ns2" * 3,
                                                        namespace="ns2")
    carry_loads(new, old, 100.0)
    assert new.pools["llm"].previous(100.0) is None  # never ns1's token to ns2's engines


def test_each_router_replica_enforces_its_share() -> None:
    ledger = QuotaLedger(replicas=2)
    ledger.set_quotas({"team-a": ("llm/team-a", quota(requests_per_minute=5))}, 0.0)
    for _ in range(3):  # ceil(5 / 2)
        ledger.admit("team-a", 1, 1, 0.0)
    with pytest.raises(QuotaExceeded, match="this router's 1/2 share"):
        ledger.admit("team-a", 1, 1, 0.0)
    # The other replica went away: the full limit from now on (refilling at 5 a minute, one
    # request every 12 s), what was spent stays spent.
    ledger.set_replicas(1, 0.0)
    with pytest.raises(QuotaExceeded, match=r"= 5 of TenantQuota llm/team-a: .*retry after 12 s"):
        ledger.admit("team-a", 1, 1, 0.0)
    ledger.admit("team-a", 1, 1, 12.0)


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(0, 50), replicas=st.integers(1, 7), tenant=st.text(max_size=12))
def test_the_routers_shares_of_a_limit_sum_to_it_and_differ_by_at_most_one(
    limit: int, replicas: int, tenant: str,
) -> None:
    shares = [share(limit, replicas, rank, tenant) for rank in range(replicas)]
    assert sum(shares) == limit
    assert max(shares) - min(shares) <= 1


def test_with_two_routers_a_limit_of_one_is_admitted_by_one_of_them_only() -> None:
    """No shared ledger (or it is down): `maxConcurrentRequests: 1` over 2 routers was 1 on
    each (rounded up), 2 in flight fleet-wide. Now one router holds the slot; the other refuses,
    says why and asks for a retry in 1 s (the Service may send it to the one that holds it)."""
    routers = [QuotaLedger(replicas=2, rank=rank) for rank in range(2)]
    admitted, refused = [], []
    for ledger in routers:
        ledger.set_quotas({"team-a": ("llm/team-a", quota(max_concurrent_requests=1))}, 0.0)
        try:
            admitted.append(ledger.admit("team-a", 1, 1, 0.0))
        except QuotaExceeded as exc:
            refused.append(exc)
    assert len(admitted) == 1 and len(refused) == 1
    assert "this router's share of the limit is 0, another router holds it" in str(refused[0])
    assert refused[0].headers() == {"retry-after": "1"}
    # A limit of 0 (a paused tenant) is 0 on every router: not "another router holds it".
    paused = QuotaLedger(replicas=2, rank=0)
    paused.set_quotas({"team-b": ("llm/team-b", quota(max_concurrent_requests=0))}, 0.0)
    with pytest.raises(QuotaExceeded) as refused_everywhere:
        paused.admit("team-b", 1, 1, 0.0)
    assert "another router" not in str(refused_everywhere.value)
    # Other tenants' units fall on either router (a stable hash of the tenant turns the rank).
    holders = {t: [share(1, 2, rank, t) for rank in range(2)].index(1)
               for t in (f"team-{i}" for i in range(20))}
    assert set(holders.values()) == {0, 1}


def status(canary: int = 0, shadow: int = 0) -> ServingPoolStatus:
    traffic = [TrafficTarget(revision=STABLE, role=TrafficRole.STABLE, weight=100 - canary)]
    if canary:
        traffic.append(TrafficTarget(revision=CANARY, role=TrafficRole.CANARY, weight=canary))
    if shadow:
        traffic.append(TrafficTarget(revision=SHADOW, role=TrafficRole.SHADOW,
                                     shadow_percent=shadow))
    return ServingPoolStatus(serving_revision=STABLE, traffic=traffic)


@pytest.mark.parametrize("weight", [0, 10, 50, 100])
def test_canary_weights_are_realised_by_conversation(weight: int) -> None:
    table = TrafficTable.from_status(status(canary=weight))
    assert table is not None
    routes = Counter(table.route("pool", "t", f"s{i}", f"r{i}").live for i in range(4000))
    assert abs(routes[CANARY] / 4000 * 100 - weight) <= 3


def test_raising_the_weight_never_moves_a_conversation_back() -> None:
    sessions = [f"s{i}" for i in range(2000)]
    previous = {s: STABLE for s in sessions}
    for weight in (5, 10, 25, 50, 75, 100):
        table = TrafficTable.from_status(status(canary=weight))
        assert table is not None
        now = {s: table.route("pool", "t", s, "r").live for s in sessions}
        assert all(now[s] == CANARY for s in sessions if previous[s] == CANARY)
        previous = now


def test_without_a_user_a_conversation_is_keyed_by_its_opening_and_stays_on_one_revision(
) -> None:
    table = TrafficTable.from_status(status(canary=50))
    assert table is not None
    system = {"role": "system", "content": "You are terse."}
    live = Counter()
    for i in range(400):
        turns = [system, {"role": "user", "content": f"question {i}"}]
        key = conversation_key({"messages": turns})
        assert key is not None
        revision = table.route("pool", "t", key, f"r{i}").live
        live[revision] += 1
        later = [*turns, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
        assert conversation_key({"messages": later}) == key  # every turn: the same revision
    assert abs(live[CANARY] / 400 - 0.5) <= 0.1  # spread within one tenant
    for odd in ({"prompt": ["x"]}, {"messages": []}, {"messages": "x"}, {"messages": [1]}):
        assert conversation_key(odd) is None  # the router's random draw then


def test_a_constant_user_still_spreads_by_the_weight_while_each_conversation_sticks() -> None:
    """A backend that sends one `user` for all its end users put all of them on one side
    (0 % or 100 % canary); the user is now keyed with the conversation."""
    table = TrafficTable.from_status(status(canary=30))
    assert table is not None
    live = Counter()
    for i in range(1000):
        chat = {"user": "backend", "messages": [{"role": "user", "content": f"q{i}"}]}
        key = session_key(chat, None, f"draw{i}")
        assert key == session_key({**chat, "temperature": 0}, None, "another draw")
        live[table.route("pool", "t", key, f"r{i}").live] += 1
    assert abs(live[CANARY] / 1000 - 0.3) <= 0.05, live
    # Completions: keyed by the prompt; a session header still pins a session as it says.
    prompts = Counter(table.route("pool", "t", session_key(
        {"user": "backend", "prompt": f"p{i}"}, None, "d"), "r").live for i in range(1000))
    assert abs(prompts[CANARY] / 1000 - 0.3) <= 0.05, prompts
    assert session_key({"user": "backend"}, "my-session", "d") == "my-session"
    assert session_key({}, None, "d") == "d"



def test_shadow_copies_a_share_of_requests_and_never_the_live_revision() -> None:
    table = TrafficTable.from_status(status(shadow=20))
    assert table is not None
    shadows = [table.route("pool", "t", "s", f"r{i}").shadow for i in range(4000)]
    assert abs(shadows.count(SHADOW) / 4000 * 100 - 20) <= 3
    assert TrafficTable.from_status(ServingPoolStatus(serving_revision=STABLE)) == \
        TrafficTable(STABLE)
    assert TrafficTable.from_status(ServingPoolStatus()) is None


def loaded(address: str, waiting: float = 0, running: float = 0, at: float | None = 0.0
           ) -> EndpointLoad:
    return EndpointLoad(address, waiting=waiting, running=running, scraped_at=at)


def test_load_comes_first_then_prefix_affinity_agreed_without_coordination() -> None:
    endpoints = [loaded("a:1"), loaded("b:1"), loaded("c:1", running=20)]
    prompts = [f"system prompt {i} " * 20 for i in range(200)]
    chosen = [pick(endpoints, "t", p, now=0.1) for p in prompts]
    assert all(c is not None and c.address != "c:1" for c in chosen)
    # Same tenant and prefix -> same replica, from any router (a fresh copy of the list).
    again = [pick([loaded("a:1"), loaded("b:1"), loaded("c:1", running=20)], "t", p, 0.1)
             for p in prompts]
    assert [c.address for c in chosen if c] == [c.address for c in again if c]
    spread = Counter(c.address for c in chosen if c)
    assert spread["a:1"] > 50 and spread["b:1"] > 50


def test_stale_endpoints_count_as_saturated_and_all_stale_means_least_in_flight() -> None:
    fresh, stale = loaded("a:1", running=5, at=10.0), loaded("b:1", at=1.0)
    assert pick([fresh, stale], "t", "p", now=10.2) is fresh
    one, two = loaded("a:1", at=None), loaded("b:1", at=None)
    one.in_flight = 3
    assert pick([one, two], "t", "p", now=10.0) is two
    assert pick([one], "t", "p", 10.0, exclude=frozenset({"a:1"})) is None


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"pools\[0\].name"):
        parse_config({"pools": [{}]})
    with pytest.raises(ConfigError, match=r"pools\[0\].status: .*servingRevision"):
        parse_config({"pools": [{"name": "p", "status": {"servingRevision": "nope"}}]})
    with pytest.raises(ConfigError, match=r"tenants\[0\].keys: .*16 characters"):
        parse_config({"tenants": [{"tenant": "a", "keys": ["short"]}]})
    with pytest.raises(ConfigError, match=r"tenants\[0\].quota.limits.requestsPerMinute"):
        parse_config({"tenants": [{"tenant": "a", "quota": {"limits": {
            "requestsPerMinute": -1}}}]})
    (tmp_path / "token").write_text("t" * 32 + "\n")
    state = parse_config({"pools": [{"name": "p", "status": {"servingRevision": STABLE},
                                     "endpoints": {STABLE: ["127.0.0.1:1"]},
                                     "routerTokenFile": "token"}],
                          "tenants": [{"tenant": "a", "keys": [KEY],
                                       "quota": {"limits": {"requestsPerMinute": 5}}}]},
                         tmp_path)
    assert state.pools["p"].router_token == "t" * 32
    assert [e.address for e in state.pools["p"].ready(STABLE)] == ["127.0.0.1:1"]
    assert state.keys.tenant_for(f"Bearer {KEY}") == "a"
    assert state.quotas["a"][1].limits.requests_per_minute == 5
    assert state.pools["p"].namespace == "default"  # a file that names no namespace
    named = parse_config({"namespace": "llm", "pools": [{"name": "p"},
                                                        {"name": "q", "namespace": "ops"}]})
    assert [named.pools[n].namespace for n in "pq"] == ["llm", "ops"]


def engine_pod(name: str, pool: str, revision: str, ip: str, ready: bool = True,
               namespace: str = "llm") -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": namespace,
                         "labels": {"kvfleet.io/pool": pool, "kvfleet.io/revision": revision,
                                    "app.kubernetes.io/component": "engine"}},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready",
                                                    "status": "True" if ready else "False"}]}}


def pool_object(name: str, namespace: str = "llm") -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": namespace},
            "status": {"servingRevision": STABLE}}


def test_cluster_objects_become_the_routing_state() -> None:
    from kvfleet.router.cluster import state_from_objects

    token = {"metadata": {"name": "smol-router-token", "namespace": "llm",
                          "labels": {"kvfleet.io/router-token-for": "smol"}},
             "data": {"token": base64.b64encode(b"t" * 32).decode()}}
    quotas = [{"metadata": {"name": "a", "namespace": "llm", "creationTimestamp": "2026-01-01"},
               "spec": {"tenant": "team-a", "limits": {"requestsPerMinute": 5}}},
              {"metadata": {"name": "dup", "namespace": "llm",
                            "creationTimestamp": "2026-02-01"},
               "spec": {"tenant": "team-a", "limits": {"requestsPerMinute": 500}}}]
    state = state_from_objects(
        [pool_object("smol")],
        [engine_pod("p1", "smol", STABLE[:12], "10.0.0.1"),
         engine_pod("p2", "smol", STABLE[:12], "10.0.0.2", ready=False),
         engine_pod("p3", "smol", STABLE[:12], "10.0.0.3", namespace="other")],
        [secret("k", "team-a", KEY)], [token], quotas, cluster_wide=False)
    route = state.pools["smol"]
    assert route.namespace == "llm"  # every router series is labelled with it
    assert [e.address for e in route.ready(STABLE)] == ["10.0.0.1:8000"]  # Ready pods only
    assert route.router_token == "t" * 32
    assert state.keys.tenant_for(f"Bearer {KEY}") == "team-a"
    assert state.quotas["team-a"][0] == "llm/a"  # the older of two quotas for one tenant
    wide = state_from_objects([pool_object("smol"), pool_object("smol", "other"),
                               pool_object("solo", "other")], [], [], [], [],
                              cluster_wide=True)
    assert set(wide.pools) == {"llm/smol", "other/smol", "other/solo", "solo"}
    # Two pools of one name are two series: each route carries its own namespace.
    assert {n: wide.pools[n].namespace for n in wide.pools} == {
        "llm/smol": "llm", "other/smol": "other", "other/solo": "other", "solo": "other"}


def test_the_router_manifests_on_disk_are_the_generated_ones() -> None:
    import yaml

    from kvfleet.router.manifests import build_manifests

    root = Path(__file__).resolve().parents[2]
    on_disk = list(yaml.safe_load_all((root / "deploy/router/router.yaml").read_text()))
    assert on_disk == build_manifests("llm"), (
        "regenerate: kvfleet router --print-manifests -n llm > deploy/router/router.yaml")
    role = next(m for m in on_disk if m["kind"] == "Role")
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert verbs == {"get", "list", "watch", "patch"}  # reads, and the quota status patch
    # With the shared ledger, its URL comes from a Secret's key, as the chart's does.
    (deployment,) = [m for m in build_manifests("llm", redis_secret="ledger")
                     if m["kind"] == "Deployment"]
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVFLEET_REDIS_URL"]["valueFrom"] == {
        "secretKeyRef": {"name": "ledger", "key": "url"}}
    assert "KVFLEET_REDIS_URL" not in yaml.safe_dump_all(on_disk)


def test_engines_export_the_gauges_an_inference_pool_endpoint_picker_reads() -> None:
    from kvfleet.engine.metrics import EngineMetrics, EngineStats

    metrics = EngineMetrics("m", "r")
    metrics.observe_stats(EngineStats(3, 2, 0.5, 0, 0, 0))
    lines = metrics.exposition().decode().splitlines()
    for name, value in [("vllm:num_requests_running", 3.0), ("vllm:num_requests_waiting", 2.0),
                        ("vllm:kv_cache_usage_perc", 0.5)]:
        assert f'{name}{{model="m",revision="r"}} {value}' in lines
    metrics.record_cache_config(16, 1200, "float16", "cpu")
    assert ('vllm:cache_config_info{block_size="16",cache_dtype="float16",model="m",'
            'num_gpu_blocks="1200",revision="r"} 1.0') in \
        metrics.exposition().decode().splitlines()


def test_shadow_answers_are_compared_as_far_as_the_shadow_cap_allows() -> None:
    from kvfleet.router.outcome import read_frames
    from kvfleet.router.server import compare

    assert compare("The sky is blue.", "The sky is blue.", False) == ("identical", None)
    assert compare("The sky is blue.", "The sky is red.", False) == ("diverged", 11)
    assert compare("The sky is blue.", "The sky", True) == ("identical", None)  # capped
    assert compare("The sky is blue.", "The sky", False) == ("length", None)  # stopped early
    frames = (b'id: 0\ndata: {"choices":[{"delta":{"role":"assistant","content":"Hi"}}]}\n\n'
              b'id: 1\ndata: {"choices":[{"text":" there"}]}\n\ndata: [DONE]')
    assert read_frames(frames).texts == ["Hi", " there"]


def test_the_prompt_estimate_is_corrected_to_the_engines_count() -> None:
    ledger = QuotaLedger()
    ledger.set_quotas({"team-a": ("llm/team-a", quota(input_tokens_per_minute=100))}, 0.0)
    over = ledger.admit("team-a", 60, 1, now=0.0)  # estimated 60, the engine counted 20
    ledger.settle(over, 1, now=0.0, prompt_tokens=20)
    ledger.admit("team-a", 70, 1, now=0.0)  # 80 left, not 40
    with pytest.raises(QuotaExceeded, match="inputTokensPerMinute"):
        ledger.admit("team-a", 20, 1, now=0.0)
    assert ledger.usage("team-a") == (2, 21, 1)


def test_in_a_cluster_each_router_enforces_its_share_of_the_ready_routers() -> None:
    from kvfleet.router.cluster import ClusterSource
    from kvfleet.router.server import Router

    router = Router(parse_config({}))
    source = ClusterSource(api=None, router=router, namespace="llm",  # type: ignore[arg-type]
                           name="router-0")
    quota_obj = {"metadata": {"name": "a", "namespace": "llm", "uid": "q"},
                 "spec": {"tenant": "team-a", "limits": {"requestsPerMinute": 10}}}
    source.informers["quotas"].store.put(quota_obj)
    for i, ready in enumerate((True, True, False)):
        pod = engine_pod(f"router-{i}", "-", "-", f"10.1.0.{i}", ready=ready)
        pod["metadata"]["uid"] = f"r{i}"  # type: ignore[index]
        source.informers["routers"].store.put(pod)
    source.rebuild()
    assert router.ledger.replicas == 2  # the Ready ones
    assert router.ledger.rank == 0  # router-0 before router-1, in every router's eyes
    for _ in range(5):
        router.ledger.admit("team-a", 1, 1, 0.0)
    with pytest.raises(QuotaExceeded, match="1/2 share"):
        router.ledger.admit("team-a", 1, 1, 0.0)


class ListingApi:
    """Records what each informer lists: (kind, label selector, namespace); empty lists and
    quiet watches."""

    def __init__(self) -> None:
        self.listed: list[tuple[str, str | None, str | None]] = []

    async def list_page(self, kind: str, params: dict[str, str],
                        namespace: str | None = None) -> dict[str, Any]:
        self.listed.append((kind, params.get("labelSelector"), namespace))
        return {"items": [], "metadata": {"resourceVersion": "1"}}

    async def watch(self, kind: str, params: dict[str, str],
                    namespace: str | None = None) -> Any:
        await asyncio.Event().wait()
        yield {}


@pytest.mark.asyncio
async def test_with_all_namespaces_only_router_pods_of_its_own_namespace_are_its_replicas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A router watching every namespace (-A) still counts its replicas in its own only: a
    tenant who may create pods in hers could otherwise add Ready pods wearing the router's
    labels and shrink every replica's share of each limit."""
    from kvfleet.commands.router import _own_namespace
    from kvfleet.router.cluster import ROUTER_SELECTOR, TENANT_LABEL, ClusterSource
    from kvfleet.router.server import Router

    monkeypatch.setenv("POD_NAMESPACE", "kvfleet")
    api = ListingApi()
    source = ClusterSource(api, Router(parse_config({})), None,  # type: ignore[arg-type]
                           name="router-0", own_namespace=_own_namespace())
    tasks = [asyncio.create_task(i.run()) for i in source.informers.values()]
    try:
        async with asyncio.timeout(5):
            while not source.synced():
                await asyncio.sleep(0.01)
    finally:
        for task in tasks:
            task.cancel()
    assert ("Pod", ROUTER_SELECTOR, "kvfleet") in api.listed
    assert ("Secret", TENANT_LABEL, None) in api.listed  # keys: every namespace, as asked
    assert not [x for x in api.listed if x[1] == ROUTER_SELECTOR and x[2] != "kvfleet"]


def test_a_pool_with_a_long_name_finds_its_pods_and_token_by_the_operators_label_value() -> None:
    from kvfleet.api.labels import label_value
    from kvfleet.router.cluster import state_from_objects

    name = "a-very-long-pool-name-" + "x" * 60  # over 63: the label value is cut + digest
    token = {"metadata": {"name": "t", "namespace": "llm",
                          "labels": {"kvfleet.io/router-token-for": label_value(name)}},
             "data": {"token": base64.b64encode(b"t" * 32).decode()}}
    state = state_from_objects([pool_object(name)],
                               [engine_pod("p", label_value(name), STABLE[:12], "10.0.0.9")],
                               [], [token], [], cluster_wide=False)
    assert [e.address for e in state.pools[name].ready(STABLE)] == ["10.0.0.9:8000"]
    assert state.pools[name].router_token == "t" * 32


def test_engine_and_router_agree_on_the_headers_and_defaults_between_them() -> None:
    # The two sides cannot import each other (the engine imports no control-plane code, the
    # control plane talks to engines only over HTTP): the contract is checked here.
    from kvfleet.engine import server as engine
    from kvfleet.router import server as router

    settings = engine.ServerSettings()
    assert settings.tenant_header == router.TENANT_HEADER
    assert router.ROUTER_TOKEN_HEADER == engine.ROUTER_TOKEN_HEADER
    assert router.SHARED_PREFIX_HEADER == engine.SHARED_PREFIX_HEADER
    assert router.DEFAULT_MAX_TOKENS["/v1/chat/completions"] == settings.default_max_tokens
    from kvfleet.engine.router_token import GRACE_SECONDS
    from kvfleet.router.state import TOKEN_GRACE_SECONDS
    assert TOKEN_GRACE_SECONDS == GRACE_SECONDS  # a replaced token: sent and accepted as long


def _source_with_quota(name: str, status: dict[str, object] | None = None,
                       router_pods: tuple[str, ...] = ()) -> tuple[object, object]:
    from kvfleet.router.cluster import ClusterSource
    from kvfleet.router.server import Router

    router = Router(parse_config({}))
    source = ClusterSource(api=None, router=router, namespace="llm",  # type: ignore[arg-type]
                           name=name)
    source.informers["quotas"].store.put({
        "metadata": {"name": "a", "namespace": "llm", "uid": "q", "generation": 1},
        "spec": {"tenant": "team-a", "limits": {"requestsPerMinute": 60}},
        "status": status or {}})
    for i, pod in enumerate(router_pods):
        obj = engine_pod(pod, "-", "-", f"10.1.0.{i}")
        obj["metadata"]["uid"] = pod  # type: ignore[index]
        source.informers["routers"].store.put(obj)
    return source, router


def _ago(seconds: float) -> str:
    from datetime import UTC, datetime, timedelta

    return (datetime.now(UTC) - timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_a_restarted_router_starts_from_its_last_report_not_from_full_buckets() -> None:
    # Router r0 had 2 of 60 requests left 5 s ago (a request a second refills since).
    report = {"at": _ago(5), "requestsPerMinute": 58, "remaining": {"requestsPerMinute": 2}}
    source, router = _source_with_quota("r0", {"routers": {"r0": report}}, ("r0",))
    source.rebuild()  # type: ignore[attr-defined]
    admitted = 0
    now = time.monotonic()
    with pytest.raises(QuotaExceeded):
        for _ in range(60):
            router.ledger.admit("team-a", 1, 1, now)  # type: ignore[attr-defined]
            admitted += 1
    assert admitted == 7, admitted  # 2 left + 5 refilled, not 60


def test_a_replaced_router_pod_starts_from_the_gone_pods_report_and_a_live_ones_is_not_its_own(
) -> None:
    reports = {"old-pod": {"at": _ago(1), "remaining": {"requestsPerMinute": 0}},
               "live-pod": {"at": _ago(1), "remaining": {"requestsPerMinute": 0}}}
    # The new pod takes over the report of the pod that no longer exists.
    source, router = _source_with_quota("new-pod", {"routers": reports},
                                        ("new-pod", "live-pod"))
    source.rebuild()  # type: ignore[attr-defined]
    with pytest.raises(QuotaExceeded):
        for _ in range(3):
            router.ledger.admit("team-a", 1, 1, time.monotonic())  # type: ignore[attr-defined]
    # Had the old pod still existed, the new one would start full (the live one's report is
    # that router's own share).
    source, router = _source_with_quota("new-pod", {"routers": reports},
                                        ("new-pod", "live-pod", "old-pod"))
    source.rebuild()  # type: ignore[attr-defined]
    for _ in range(20):
        router.ledger.admit("team-a", 1, 1, time.monotonic())  # type: ignore[attr-defined]
    # A report over a minute old says nothing: the bucket has refilled since.
    stale = {"old-pod": {"at": _ago(61), "remaining": {"requestsPerMinute": 0}}}
    source, router = _source_with_quota("new-pod", {"routers": stale}, ("new-pod",))
    source.rebuild()  # type: ignore[attr-defined]
    for _ in range(20):
        router.ledger.admit("team-a", 1, 1, time.monotonic())  # type: ignore[attr-defined]


def test_each_router_writes_its_own_report_and_the_fleets_usage_is_their_sum() -> None:
    from datetime import UTC, datetime

    from kvfleet.router.cluster import usage_status

    reports = {"peer": {"at": _ago(3), "requestsPerMinute": 30, "tokensPerMinute": 300,
                        "concurrentRequests": 2},
               "gone": {"at": _ago(3), "requestsPerMinute": 99},
               "gone-old": {"at": _ago(61), "requestsPerMinute": 0},
               "dead-busy": {"at": _ago(70), "requestsPerMinute": 99},
               "idle": {"at": _ago(70), "requestsPerMinute": 0}}
    raw = {"metadata": {"generation": 3}, "status": {"routers": reports}}
    ledger = QuotaLedger()
    ledger.set_quotas({"team-a": ("llm/a", quota(requests_per_minute=60))}, 0.0)
    held = [ledger.admit("team-a", 5, 5, 0.0) for _ in range(10)]
    for reservation in held[:4]:
        ledger.settle(reservation, 3, 0.0)
    status = usage_status(ledger, "team-a", None, 60.0, raw, "me",
                          {"me", "peer", "dead-busy", "idle"}, datetime.now(UTC), 0.0)
    assert status is not None
    mine = status["routers"]["me"]
    assert (mine["requestsPerMinute"], mine["tokensPerMinute"], mine["concurrentRequests"]) \
        == (10, 32, 6)
    assert mine["remaining"]["requestsPerMinute"] == 50
    assert status["usage"] == {"requestsPerMinute": 40, "tokensPerMinute": 332,
                               "concurrentRequests": 8}
    # Pruned after a minute: a gone pod's report and a busy one no one renewed. A gone pod's
    # younger report stays for its replacement to start from (not counted in the usage); an
    # idle live router's stays (it does not rewrite an unchanged report).
    assert status["routers"]["gone-old"] is None and status["routers"]["dead-busy"] is None
    assert "gone" not in status["routers"] and "idle" not in status["routers"]
    assert "peer" not in status["routers"]
    # What the apiserver's schema accepts.
    from kvfleet.api.tenantquota import TenantQuotaStatus

    TenantQuotaStatus.model_validate({**status, "routers": {
        k: v for k, v in status["routers"].items() if v is not None}})


@pytest.mark.asyncio
async def test_a_tenantquota_the_router_cannot_read_refuses_its_tenant_and_says_why() -> None:
    """It was logged and dropped, and its tenant became unlimited (fail open)."""
    import httpx

    from kvfleet.router.cluster import ClusterSource, state_from_objects
    from kvfleet.router.server import Router, build_app

    newer = {"metadata": {"name": "a", "namespace": "llm", "generation": 2},
             "spec": {"tenant": "team-a", "limits": {"requestsPerMinute": 5,
                                                     "gpuSecondsPerDay": 10}}}
    state = state_from_objects([pool_object("smol")], [], [secret("k", "team-a", KEY)], [],
                               [newer], cluster_wide=False)
    assert "team-a" not in state.quotas
    assert "spec.limits.gpuSecondsPerDay" in state.refused["team-a"]
    router = Router(state)
    try:
        transport = httpx.ASGITransport(app=build_app(router))
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
            for path, body in (("/v1/chat/completions", {"model": "smol", "messages": []}),
                               ("/v1/models", None)):
                resp = await (client.post(path, json=body, headers={
                    "authorization": f"Bearer {KEY}"}) if body is not None else client.get(
                    path, headers={"authorization": f"Bearer {KEY}"}))
                assert resp.status_code == 403, resp.text
                error = resp.json()["error"]
                assert error["code"] == "tenant_quota_unreadable"
                assert "TenantQuota llm/a cannot be read" in error["message"]

        class Api:
            def __init__(self) -> None:
                self.patches: list[tuple[str, str, str, dict[str, object]]] = []

            async def patch_status(self, kind: str, ns: str, name: str,
                                   status: dict[str, object]) -> None:
                self.patches.append((kind, ns, name, status))

        api = Api()
        source = ClusterSource(api=api, router=router, namespace="llm")  # type: ignore[arg-type]
        await source._write_status(newer, 10.0)
        ((kind, ns, name, status),) = api.patches
        assert (kind, ns, name) == ("TenantQuota", "llm", "a")
        (ready,) = status["conditions"]  # type: ignore[misc]
        assert (ready["status"], ready["reason"]) == ("False", "Unreadable")
        assert "gpuSecondsPerDay" in ready["message"] and ready["observedGeneration"] == 2
        await source._write_status({**newer, "status": status}, 10.0)
        assert len(api.patches) == 1  # said once, not every interval
    finally:
        await router.close()


def test_a_default_quota_comes_from_the_config_or_a_flag_and_is_checked(tmp_path: Path) -> None:
    from kvfleet.commands.router import _default_quota

    state = parse_config({"tenants": [{"tenant": "a", "keys": [KEY]}],
                          "defaultQuota": {"limits": {"requestsPerMinute": 60}}})
    assert state.default_quota is not None
    assert state.default_quota.limits.requests_per_minute == 60
    with pytest.raises(ConfigError, match=r"defaultQuota: limits\.requestsPerMinuet: Extra"):
        parse_config({"defaultQuota": {"limits": {"requestsPerMinuet": 60}}})
    flag = tmp_path / "default.yaml"
    flag.write_text("limits: {maxConcurrentRequests: 2}\npriorityClass: batch\n")
    assert _default_quota(flag).limits.max_concurrent_requests == 2
    flag.write_text("- not a mapping\n")
    with pytest.raises(ConfigError, match=f"--default-quota {flag}: a TenantQuota's spec"):
        _default_quota(flag)


def test_a_key_minted_outside_its_tenants_namespace_is_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With -A every namespace's Secrets are watched: a key for team-a made in namespace
    `other` by someone who can write Secrets there spent team-a's budget."""
    from kvfleet.router.cluster import state_from_objects

    forged_key = "sk-forged-0123456789abcdef"
    forged = secret("forged", "team-a", forged_key)
    forged["metadata"]["namespace"] = "other"  # type: ignore[index]
    orphan = secret("orphan", "team-z", "sk-orphan-0123456789abcdef")  # no quota anywhere
    quota = {"metadata": {"name": "a", "namespace": "llm"}, "spec": {"tenant": "team-a"}}
    with caplog.at_level(logging.WARNING):
        state = state_from_objects([pool_object("smol")], [],
                                   [secret("k", "team-a", KEY), forged, orphan], [], [quota],
                                   cluster_wide=True)
    assert state.keys.tenant_for(f"Bearer {KEY}") == "team-a"
    with pytest.raises(Unauthorized):
        state.keys.tenant_for(f"Bearer {forged_key}")
    assert "Secret other/forged: ignored, its tenant 'team-a' belongs to namespace llm" in \
        caplog.text and forged_key not in caplog.text
    # A tenant without any TenantQuota: its key authenticates, and the ledger refuses it (or
    # holds it to the router's default quota). Its home is the namespace of its oldest key: a
    # later key for the same name elsewhere would share its default-quota buckets.
    assert state.keys.tenant_for("Bearer sk-orphan-0123456789abcdef") == "team-z"
    orphan["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"  # type: ignore[index]
    squatter = secret("squat", "team-z", "sk-squatter-0123456789abcdef")
    squatter["metadata"].update(namespace="other",  # type: ignore[attr-defined]
                                creationTimestamp="2026-02-01T00:00:00Z")
    state = state_from_objects([pool_object("smol")], [], [squatter, orphan], [], [],
                               cluster_wide=True)
    assert state.keys.tenant_for("Bearer sk-orphan-0123456789abcdef") == "team-z"
    with pytest.raises(Unauthorized):
        state.keys.tenant_for("Bearer sk-squatter-0123456789abcdef")


def test_only_pods_the_pools_deployments_own_are_routed_to(caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    """Engine labels are no proof: any pod can wear them. A pod gets prompts and the router
    token only if its ReplicaSet's Deployment is the ServingPool's (by UID)."""
    from kvfleet.router.cluster import pool_pods

    def obj(uid: str, owner: str | None, name: str = "") -> dict[str, Any]:
        meta: dict[str, Any] = {"uid": uid, "name": name or uid, "namespace": "llm"}
        if owner is not None:
            meta["ownerReferences"] = [{"uid": "other", "controller": False},
                                       {"uid": owner, "controller": True}]
        return {"metadata": meta, "status": {"podIP": "10.0.0.9", "conditions": [
            {"type": "Ready", "status": "True"}]}}

    pools = [obj("pool-uid", None)]
    deployments = [obj("dep", "pool-uid"), obj("dep-foreign", "someone-else")]
    sets = [obj("rs", "dep"), obj("rs-foreign", "dep-foreign")]
    pods = [obj("good", "rs"), obj("forged", None), obj("foreign", "rs-foreign"),
            obj("direct", "dep")]
    kept, strays = pool_pods(pools, deployments, sets, pods)
    assert [p["metadata"]["uid"] for p in kept] == ["good"]
    assert [p["metadata"]["uid"] for p in strays] == ["forged", "foreign", "direct"]
    # The router says so, once per pod however often it rebuilds.
    source, _ = _source_with_quota("router-0")
    source.informers["pods"].store.put(pods[1])  # type: ignore[attr-defined]
    for _ in range(2):
        source.rebuild()  # type: ignore[attr-defined]
    assert caplog.text.count("llm/forged wears a pool's engine labels but no ServingPool's "
                             "Deployment owns it") == 1


def test_a_pool_another_autoscaler_takes_to_zero_is_held_for_when_it_says_so() -> None:
    """KEDA or an HPA driving /scale from 0: the annotation makes the routers hold its requests
    (the held count is what such an autoscaler scales on) instead of answering 503."""
    from kvfleet.api.servingpool import WAKE_ANNOTATION
    from kvfleet.router.cluster import state_from_objects

    plain, marked = pool_object("plain"), pool_object("marked")
    marked["metadata"] = {**marked["metadata"],  # type: ignore[dict-item]
                          "annotations": {WAKE_ANNOTATION: "true"}}
    own = {**pool_object("own"), "spec": {"autoscaling": {"minReplicas": 0}}}
    state = state_from_objects([plain, marked, own], [], [], [], [], cluster_wide=False)
    assert {n: p.wakes for n, p in state.pools.items()} == {
        "plain": False, "marked": True, "own": True}


def test_a_tenantquota_claiming_a_reserved_name_is_refused_by_the_router_too() -> None:
    """Past the webhook (an old object, a cluster without it): the probes' tenant stays the
    router's own."""
    from kvfleet.router.cluster import state_from_objects

    claim = {"metadata": {"name": "sneaky", "namespace": "llm"},
             "spec": {"tenant": "kvfleet-probe", "sharedPrefixCache": True}}
    state = state_from_objects([pool_object("smol")], [], [secret("k", "kvfleet-probe", KEY)],
                               [], [claim], cluster_wide=False)
    assert "kvfleet-probe" not in state.quotas
    assert "a name kvfleet keeps for itself" in state.refused["kvfleet-probe"]


def test_a_long_prompt_is_counted_in_pieces_as_one_text_would_be() -> None:
    """Counted whole, a 4 MiB prompt's encodings took 240 MB; in pieces cut before spaces
    the count is the whole text's (SmolLM2's byte-level BPE splits there anyway)."""
    from tokenizers import Tokenizer

    from kvfleet.router import tokens

    tokenizer = Tokenizer.from_str(_embedded_tokenizer_json())
    prose = ("The router counts every prompt token, before admission, with the pool's "
             "own tokenizer; numbers like 1234567 and  double  spaces too. ") * 3000
    pieces = list(tokens._pieces(prose, 4096))
    assert "".join(pieces) == prose and max(map(len, pieces)) <= 4096
    whole = len(tokenizer.encode(prose, add_special_tokens=False).ids)
    assert tokens._count_ids(tokenizer, [prose]) == whole
    # A text without a space is cut hard: within a token a piece.
    solid = "x" * 200_000
    assert abs(tokens._count_ids(tokenizer, [solid])
               - len(tokenizer.encode(solid, add_special_tokens=False).ids)) <= 4
    with pytest.raises(BadRequest, match="a list of token ids"):
        tokens.texts_of({"prompt": ["text", 5]})


def _embedded_tokenizer_json() -> str:
    from kvfleet.engine.model.gguf_file import read_tokenizer_spec
    from kvfleet.engine.model.gguf_reader import GGUFFile
    from kvfleet.engine.model.loader import default_model_path
    from kvfleet.engine.tokenizer import Tokenizer

    path = default_model_path()
    return Tokenizer.from_gguf(read_tokenizer_spec(GGUFFile(path).metadata, path), path).to_json()
