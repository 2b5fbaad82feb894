"""Which pools a tenant reaches, and by what name: a tenant belongs to one namespace (its
TenantQuota's; without one, its oldest key Secret's; a config file's tenant, the file's or its
entry's `namespace`) and uses that namespace's pools. Another namespace's pool takes both
sides' word: the tenant's TenantQuota lists it in `allowedPools` as `namespace/name`, and the
pool's owners list the tenant's namespace (or `*`) in its `kvfleet.io/shared-with`
annotation. Before this, a cluster-wide router (`-A`) let any key use any namespace's pools,
by a bare name unique across the cluster.

Names: a bare name is a pool of the tenant's own namespace, or the one other namespace's pool
of that name its `allowedPools` lists; `namespace/name` is explicit. A pool the tenant may not
see at all is answered as no pool (404, as for a name that exists nowhere): a key learns
nothing of other namespaces' pools, not even by listing one in its `allowedPools`. A pool it
sees and may not use (its own namespace's, or another's shared with its namespace, that its
`allowedPools` leaves out) is a 403. `GET /v1/models` lists what the key may use, by the
names it would send.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvfleet.api.tenantquota import TenantQuotaSpec
from kvfleet.router.errors import PoolNotAllowed, UnknownPool
from kvfleet.router.state import PoolRoute, RouterState

EVERY_NAMESPACE = "*"


def _qualified(route: PoolRoute) -> str:
    return f"{route.namespace}/{route.name}"


def _shares_with(route: PoolRoute, home: str | None) -> bool:
    return EVERY_NAMESPACE in route.shared_with or (home is not None and home in route.shared_with)


def may_use(route: PoolRoute, home: str | None, allowed: Iterable[str]) -> bool:
    allowed = list(allowed)
    if route.namespace == home:
        return not allowed or route.name in allowed or _qualified(route) in allowed
    return _qualified(route) in allowed and _shares_with(route, home)


def _place(state: RouterState, home: str | None, model: str, allowed: list[str]
           ) -> PoolRoute | None:
    namespace, slash, name = model.partition("/")
    if slash:
        return state.places.get((namespace, name))
    own = state.places.get((home, model)) if home is not None else None
    if own is not None:
        return own
    listed = [entry for entry in allowed if entry.partition("/")[2] == model]
    if len(listed) == 1:
        other, _, name = listed[0].partition("/")
        return state.places.get((other, name))
    return None


def resolve(state: RouterState, tenant: str, quota: TenantQuotaSpec | None,
            model: str) -> PoolRoute:
    """The pool `model` names for `tenant`; UnknownPool or PoolNotAllowed saying why."""
    home = state.homes.get(tenant)
    allowed = list(quota.allowed_pools) if quota is not None else []
    route = _place(state, home, model, allowed)
    unknown = UnknownPool(f"model {model!r} is no ServingPool this key may use; GET "
                          "/v1/models lists them", "model")
    if route is None:
        raise unknown
    if may_use(route, home, allowed):
        return route
    if route.namespace == home or _shares_with(route, home):
        raise PoolNotAllowed(f"tenant {tenant!r} may not use pool {model!r}: its "
                             "TenantQuota's allowedPools does not list it", "model")
    raise unknown  # (listed or not: whether it exists is its namespace's to tell)


def visible(state: RouterState, tenant: str, quota: TenantQuotaSpec | None) -> list[str]:
    """The names `tenant` may send, as it would send them: its own namespace's pools bare,
    another namespace's as `namespace/name`."""
    home = state.homes.get(tenant)
    allowed = list(quota.allowed_pools) if quota is not None else []
    return sorted(route.name if route.namespace == home else _qualified(route)
                  for route in state.places.values() if may_use(route, home, allowed))
