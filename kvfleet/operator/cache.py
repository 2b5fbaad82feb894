"""The operator's read side: every object a reconcile reads, as the watches last delivered it.

Watches already stream each kind a ServingPool reconcile reads: kopf streams the ServingPools
and ModelArtifacts (a kopf index handler each, in `handlers.py`), and `informer.Informer`s,
through server-side label selectors, the operator's own Deployments, Services,
PodDisruptionBudgets and engine pods. Each keeps the latest body of every object (values from
`slim`/`slim_pod`; the informers' compressed, `informer.Packed`, each read a fresh copy), so
a reconcile reads memory instead of sending GETs — controller-runtime's informer cache. Pool
handlers run only once kopf's indices and every informer hold their initial listing (as
controller-runtime waits for its caches to sync), so after a restart the first reconciles see
what exists and create nothing twice.

Indices (read-only views: kopf's, or an informer's store), by id:
  pool_index, artifact_index,
  rollout_index                   (namespace, name) -> the object
  <child>_index                   (namespace, uid of the controlling ServingPool) -> children
  pod_index                       (namespace, pool label value) -> engine pods (no spec)

The watch delivers the operator's own writes a moment after the apiserver answered them.
Until it does, the answered object stands in for the cached one (client-go's MutationCache):
whichever has the higher resourceVersion wins; a stand-in is dropped once the watch delivers
its version or a later one (`seen`), and expires after `ttl_seconds` at the latest (during a
burst of creates, stand-ins kept for their whole TTL were a second copy of every new child).
Deleting hides the object by uid until its DELETED event arrives. A stand-in never brings
back a pool or artifact the watch no longer has: the operator only writes their status. A
pool or artifact whose status write is answered 404 reads as absent from then on (`gone`):
kopf's watch of those kinds re-lists without reporting deletions (the child kinds come from
informers, which do report them).

Invariant the reconcilers rely on: a read here may be a moment old but is never older than
the watch, and every change the watch delivers later triggers another reconcile, which
closes the gap (level-based). Applies are server-side and idempotent, so a stale read costs
at most a write that changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.operator.naming import POOL_LABEL

JsonObj = dict[str, Any]
# The kopf index id of each kind the operator reads; handlers.py registers one per kind.
INDEX_IDS: dict[str, str] = {
    "ServingPool": "pool_index",
    "ModelArtifact": "artifact_index",
    "Rollout": "rollout_index",
    "Deployment": "deployment_index",
    "Service": "service_index",
    "PodDisruptionBudget": "pdb_index",
    "Secret": "secret_index",
    "NetworkPolicy": "network_policy_index",
    "Pod": "pod_index",
}
TOP_LEVEL = frozenset({"ServingPool", "ModelArtifact", "Rollout"})
CHILD_KINDS = frozenset({"Deployment", "Service", "PodDisruptionBudget", "Secret",
                         "NetworkPolicy"})
# An index as kopf exposes it: key -> the values of every object filed under that key.
IndexView = Mapping[Any, Iterable[JsonObj]]


def slim(body: Mapping[str, Any]) -> JsonObj:
    """The body without `managedFields` (the bulk of a server-side-applied object, never read)."""
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    return {**body, "metadata": meta}


def slim_pod(body: Mapping[str, Any]) -> JsonObj:
    """What `placement.diagnose` reads of a pod: metadata and status (not the spec)."""
    kept = slim(body)
    return {k: kept[k] for k in ("apiVersion", "kind", "metadata", "status") if k in kept}


def index_entry(kind: str, body: Mapping[str, Any]) -> dict[tuple[str, str], JsonObj]:
    """What a kopf index handler files for `body`: {key: value}, {} for nothing (kopf then
    drops what it filed for the object before, e.g. when a pool no longer controls a child)."""
    meta = body.get("metadata") or {}
    namespace = str(meta.get("namespace") or "default")
    if kind in TOP_LEVEL:
        return {(namespace, str(meta.get("name"))): slim(body)}
    if kind == "Pod":
        label = (meta.get("labels") or {}).get(POOL_LABEL)
        return {(namespace, label): slim_pod(body)} if isinstance(label, str) and label else {}
    owner = controller_pool_uid(body)
    return {} if owner is None else {(namespace, owner): slim(body)}


def controller_pool_uid(body: Mapping[str, Any]) -> str | None:
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "ServingPool" and ref.get("controller"):
            uid = ref.get("uid")
            return uid if isinstance(uid, str) else None
    return None


def resource_version(obj: Mapping[str, Any]) -> int | None:
    """The resourceVersion as a number, or None. Kubernetes calls it opaque; etcd-backed
    apiservers use the etcd revision, and client-go's MutationCache compares it the same way."""
    value = (obj.get("metadata") or {}).get("resourceVersion")
    return int(value) if isinstance(value, str) and value.isdigit() else None


def _ref(obj: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(kind, namespace, name), or None for a body without them."""
    kind, meta = obj.get("kind"), obj.get("metadata") or {}
    namespace, name = meta.get("namespace"), meta.get("name")
    if isinstance(kind, str) and isinstance(namespace, str) and isinstance(name, str):
        return kind, namespace, name
    return None


def _uid(obj: Mapping[str, Any]) -> str | None:
    uid = (obj.get("metadata") or {}).get("uid")
    return uid if isinstance(uid, str) else None


def _newer(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """`a` is known to be a later version than `b` (unknown versions: no)."""
    rv_a, rv_b = resource_version(a), resource_version(b)
    return rv_a is not None and rv_b is not None and rv_a > rv_b


@dataclass
class _StandIn:
    obj: JsonObj
    expires: float


class Cache:
    """Reads for the reconcilers: kopf's indices, overlaid with the operator's own writes."""

    def __init__(
        self,
        indices: Mapping[str, IndexView],
        *,
        ttl_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        missing = [i for i in INDEX_IDS.values() if i not in indices]
        if missing:
            raise KeyError(f"kopf indices {missing} are not registered (see handlers.py)")
        self._indices = indices
        self._ttl = ttl_seconds
        self._clock = clock
        # (kind, namespace, name) of a pool or artifact -> its last written version.
        self._top: dict[tuple[str, str, str], _StandIn] = {}
        # (kind, namespace, pool uid) -> name -> the last written version of that child.
        self._children: dict[tuple[str, str, str], dict[str, _StandIn]] = {}
        self._hidden: dict[str, float] = {}  # uid of an object the operator deleted -> expiry
        self._gone: set[str] = set()  # uids of pools/artifacts a write found deleted
        self._next_sweep = clock() + ttl_seconds

    # -- reads ----------------------------------------------------------------------------

    def get(self, kind: str, namespace: str, name: str) -> JsonObj | None:
        """A ServingPool or ModelArtifact, or None when the watch does not have it."""
        cached = _latest(self._index(kind).get((namespace, name), ()))
        if cached is None or _uid(cached) in self._gone:
            return None  # gone: a stand-in never resurrects it
        key = (kind, namespace, name)
        stand_in = self._top.get(key)
        if stand_in is None:
            return cached
        if (
            self._expired(stand_in)
            or _uid(stand_in.obj) != _uid(cached)
            or not _newer(stand_in.obj, cached)
        ):
            del self._top[key]
            return cached
        return stand_in.obj

    def owned(self, kind: str, namespace: str, pool_uid: str) -> list[JsonObj]:
        """The children of one kind whose controller is the pool with this uid."""
        found = {
            obj["metadata"]["name"]: obj for obj in self._index(kind).get((namespace, pool_uid), ())
        }
        stand_ins = self._children.get((kind, namespace, pool_uid), {})
        for name, stand_in in list(stand_ins.items()):
            cached = found.get(name)
            if self._expired(stand_in) or (cached is not None and not _newer(stand_in.obj, cached)):
                del stand_ins[name]
            else:
                found[name] = stand_in.obj
        if not stand_ins:
            self._children.pop((kind, namespace, pool_uid), None)
        return [obj for obj in found.values() if not self._is_hidden(obj)]

    def pods(self, namespace: str, pool_label: str) -> list[JsonObj]:
        return list(self._index("Pod").get((namespace, pool_label), ()))

    def keys(self, kind: str) -> list[tuple[str, str]]:
        """(namespace, name) of every cached pool or artifact."""
        return list(self._index(kind))

    def names(self, kind: str, namespace: str) -> list[str]:
        """The names of every cached pool or artifact in the namespace."""
        return sorted(name for ns, name in self._index(kind) if ns == namespace)

    def objects(self, kind: str, namespace: str) -> list[JsonObj]:
        found = (self.get(kind, namespace, name) for name in self.names(kind, namespace))
        return [obj for obj in found if obj is not None]

    # -- the operator's own writes, until the watch catches up ----------------------------

    def wrote(self, obj: Mapping[str, Any]) -> None:
        """Record what the apiserver answered to a write (apply, status patch)."""
        ref = _ref(obj)
        if ref is None:
            return
        kind, namespace, name = ref
        stand_in = _StandIn(slim(obj), self._clock() + self._ttl)
        if kind in TOP_LEVEL:
            self._top[(kind, namespace, name)] = stand_in
        elif kind in CHILD_KINDS and (owner := controller_pool_uid(obj)) is not None:
            self._children.setdefault((kind, namespace, owner), {})[name] = stand_in
        self._sweep()

    def deleted(self, obj: Mapping[str, Any]) -> None:
        """The operator deleted `obj`: hide it until the watch says it is gone."""
        uid = _uid(obj)
        if uid is not None:
            self._hidden[uid] = self._clock() + self._ttl
        self._forget_stand_in(obj)

    def gone(self, obj: Mapping[str, Any]) -> None:
        """A write to this pool or artifact was answered 404: the apiserver no longer has it,
        though the watch never said so (kopf re-lists after `410 Gone` without reporting what
        was deleted meanwhile). From now on it reads as absent; the uid is kept (one string
        per such object) since the watch will never deliver its DELETED."""
        uid = _uid(obj)
        if uid is not None:
            self._gone.add(uid)
        self._forget_stand_in(obj)

    def seen(self, obj: Mapping[str, Any]) -> None:
        """A child's ADDED or MODIFIED watch event: a stand-in no newer than it is done."""
        self._forget_stand_in(obj)

    def seen_deleted(self, obj: Mapping[str, Any]) -> None:
        """A DELETED watch event: no stand-in may keep the object alive."""
        uid = _uid(obj)
        if uid is not None:
            self._hidden.pop(uid, None)
        self._forget_stand_in(obj)

    # -- internals ------------------------------------------------------------------------

    def _index(self, kind: str) -> IndexView:
        return self._indices[INDEX_IDS[kind]]

    def _expired(self, stand_in: _StandIn) -> bool:
        return self._clock() >= stand_in.expires

    def _is_hidden(self, obj: Mapping[str, Any]) -> bool:
        uid = _uid(obj)
        expiry = self._hidden.get(uid) if uid is not None else None
        return expiry is not None and self._clock() < expiry

    def _forget_stand_in(self, obj: Mapping[str, Any]) -> None:
        ref = _ref(obj)
        if ref is None:
            return
        kind, namespace, name = ref
        if kind in TOP_LEVEL:
            self._top.pop(ref, None)
        elif (owner := controller_pool_uid(obj)) is not None:
            stand_ins = self._children.get((kind, namespace, owner), {})
            if name in stand_ins and not _newer(stand_ins[name].obj, obj):
                del stand_ins[name]
                if not stand_ins:
                    del self._children[(kind, namespace, owner)]

    def _sweep(self) -> None:
        """Drop expired entries of objects nobody reads any more (deleted pools)."""
        now = self._clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self._ttl
        self._top = {k: v for k, v in self._top.items() if v.expires > now}
        for key in list(self._children):
            alive = {n: v for n, v in self._children[key].items() if v.expires > now}
            if alive:
                self._children[key] = alive
            else:
                del self._children[key]
        self._hidden = {uid: t for uid, t in self._hidden.items() if t > now}

    def __len__(self) -> int:
        """Stand-ins and hidden uids held (bounded by the writes of the last `ttl_seconds`)."""
        return len(self._top) + sum(map(len, self._children.values())) + len(self._hidden)


def _latest(objs: Iterable[JsonObj]) -> JsonObj | None:
    """Of the objects filed under one name (briefly two across a delete and re-create), the
    latest one."""
    best: JsonObj | None = None
    for obj in objs:
        if best is None or _newer(obj, best):
            best = obj
    return best
