"""Which pools a tenant reaches: its own namespace's, another's only when both sides say so
(kvfleet.router.access). A cluster-wide router let any key use any namespace's pool."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.api.servingpool import SHARED_WITH_ANNOTATION
from kvfleet.api.tenantquota import TenantQuotaSpec
from kvfleet.router.access import resolve, visible
from kvfleet.router.cluster import state_from_objects
from kvfleet.router.errors import PoolNotAllowed, UnknownPool
from kvfleet.router.state import RouterState, parse_config

STABLE = "a" * 64


def _pool(name: str, namespace: str, shared_with: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if shared_with is not None:
        meta["annotations"] = {SHARED_WITH_ANNOTATION: shared_with}
    return {"metadata": meta, "status": {"servingRevision": STABLE}}


def _quota(tenant: str, namespace: str, allowed: list[str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": tenant, "namespace": namespace},
            "spec": {"tenant": tenant, "allowedPools": allowed or []}}


def _fleet(allowed: list[str] | None = None, shared_with: str | None = None) -> RouterState:
    """A cluster-wide router's view: llm/smol, research/smol, research/solo; team-a's
    TenantQuota in llm, team-r's in research."""
    return state_from_objects(
        [_pool("smol", "llm"), _pool("smol", "research"),
         _pool("solo", "research", shared_with)], [], [], [],
        [_quota("team-a", "llm", allowed), _quota("team-r", "research")], cluster_wide=True)


def _spec(state: RouterState, tenant: str) -> TenantQuotaSpec:
    return state.quotas[tenant][1]


def _where(state: RouterState, tenant: str, model: str) -> str:
    route = resolve(state, tenant, _spec(state, tenant), model)
    return f"{route.namespace}/{route.name}"


def test_a_tenant_reaches_its_own_namespaces_pools_and_learns_nothing_of_others() -> None:
    state = _fleet()
    assert _where(state, "team-a", "smol") == "llm/smol"  # a bare name: its own namespace
    assert _where(state, "team-r", "smol") == "research/smol"
    assert _where(state, "team-a", "llm/smol") == "llm/smol"
    # A cluster-wide bare name unique in the cluster used to reach another namespace's pool.
    for other in ("solo", "research/solo", "research/smol", "nowhere", "x/y"):
        with pytest.raises(UnknownPool, match="no ServingPool this key may use"):
            _where(state, "team-a", other)
    assert visible(state, "team-a", _spec(state, "team-a")) == ["smol"]
    assert visible(state, "team-r", _spec(state, "team-r")) == ["smol", "solo"]


def test_another_namespaces_pool_takes_both_the_tenants_and_the_pools_word() -> None:
    # Listed by the tenant, not shared by the pool: no pool (a 403 would tell a TenantQuota's
    # editor which names exist in another namespace).
    listed = _fleet(allowed=["smol", "research/solo"])
    with pytest.raises(UnknownPool):
        _where(listed, "team-a", "research/solo")
    assert visible(listed, "team-a", _spec(listed, "team-a")) == ["smol"]
    # Shared by the pool, not listed by a tenant that lists others: a 403.
    shared = _fleet(allowed=["smol"], shared_with="llm, ops")
    with pytest.raises(PoolNotAllowed, match="allowedPools does not list it"):
        _where(shared, "team-a", "research/solo")
    # Both: by its qualified name, or its bare name when no pool of the tenant's has it.
    both = _fleet(allowed=["smol", "research/solo"], shared_with="*")
    assert _where(both, "team-a", "research/solo") == "research/solo"
    assert _where(both, "team-a", "solo") == "research/solo"
    assert _where(both, "team-a", "smol") == "llm/smol"
    assert visible(both, "team-a", _spec(both, "team-a")) == ["research/solo", "smol"]
    # A non-empty allowedPools bounds the tenant's own namespace too.
    only_other = _fleet(allowed=["research/solo"], shared_with="llm")
    with pytest.raises(PoolNotAllowed, match="allowedPools does not list it"):
        _where(only_other, "team-a", "smol")


def test_a_config_files_tenants_belong_to_its_namespace_or_their_own() -> None:
    state = parse_config({"namespace": "llm", "pools": [
        {"name": "p"}, {"name": "q", "namespace": "ops", "sharedWith": ["llm"]}],
        "tenants": [{"tenant": "a", "keys": ["sk-a-0123456789abcdef"], "quota": {}},
                    {"tenant": "o", "namespace": "ops", "keys": ["sk-o-0123456789abcdef"],
                     "quota": {}},
                    {"tenant": "b", "keys": ["sk-b-0123456789abcdef"],
                     "quota": {"allowedPools": ["ops/q"]}}]})
    assert visible(state, "a", _spec(state, "a")) == ["p"]
    assert visible(state, "o", _spec(state, "o")) == ["q"]
    assert visible(state, "b", _spec(state, "b")) == ["ops/q"]
    assert _where(state, "b", "q") == "ops/q"
