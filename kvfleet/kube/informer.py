"""List-and-watch of one kind into a store: client-go's reflector, small.

The operator reads its Deployments, Services, ConfigMaps, PodDisruptionBudgets and engine pods
from memory (see `operator.cache`); the router its pools, engine pods, key Secrets and
TenantQuotas. These need no kopf handler machinery: nothing is ever persisted on them, no
handler retries. Watching them through kopf cost a per-object memory, worker task and event
queue for five objects per pool (most of the operator's memory at 1,000 pools); an `Informer`
keeps only what its `index` files for an object (the operator: a slimmed copy) and calls
`on_event` inline.

It also gives the guarantee controller-runtime users expect: after a watch expires (`410
Gone`) it lists again and replaces the store, and every object that vanished meanwhile is
reported as DELETED — a child deleted while the watch was away is seen and recreated
(kopf re-lists without reporting such deletions).

Protocol: LIST (paged, by label selector, cluster-wide) → `synced` is set → WATCH from the
list's resourceVersion with bookmarks; a watch that ends is resumed from the last version
seen; `410 Gone` (as an HTTP status or an ERROR event) → LIST again; any other failure →
LIST again after a back-off.

Store views are what the operator's `cache.Cache` reads: key -> the objects filed under it.
A store made with `pack=True` keeps each filed value compressed (`Packed`) and hands out a
fresh copy on every read: the operator's children cost ~65 KB a pool as Python dicts and
~6 KB packed (bench/README, "Operator memory"), for ~50 µs a read.
"""

from __future__ import annotations

import asyncio
import logging
import marshal
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, Protocol

import aiohttp

from kvfleet.kube.api import JsonObj, KubeError, api_version_of

log = logging.getLogger("kvfleet.kube")
# Events as the watch names them; None for an object of the first listing (as kopf does).
OnEvent = Callable[[str | None, JsonObj], None]
# What the store files for an object of a kind: {key: value}, {} for nothing.
Index = Callable[[str, JsonObj], Mapping[Any, JsonObj]]


def by_namespaced_name(kind: str, obj: JsonObj) -> dict[Any, JsonObj]:
    """The whole object under (namespace, name)."""
    meta = obj.get("metadata") or {}
    return {(str(meta.get("namespace") or ""), str(meta.get("name"))): obj}
PAGE_SIZE = 500
WATCH_TIMEOUT_SECONDS = 300  # the apiserver ends the watch; it is resumed from its version
BACKOFF_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0)


class WatchApi(Protocol):
    """The two reads an informer needs (kube.KubeApi has them)."""

    def list_page(self, kind: str, params: dict[str, str],
                  namespace: str | None = None) -> Awaitable[JsonObj]: ...

    def watch(self, kind: str, params: dict[str, str],
              namespace: str | None = None) -> AsyncIterator[JsonObj]: ...


class WatchExpiredError(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class Packed:
    """A decoded JSON value kept compressed (marshal, then zlib at its fastest level): a
    Deployment's ~38 KB of dicts and strings become ~3 KB. `unpack` builds a new copy."""

    __slots__ = ("_data",)

    def __init__(self, value: JsonObj) -> None:
        self._data = zlib.compress(marshal.dumps(value), 1)

    def unpack(self) -> JsonObj:
        value: JsonObj = marshal.loads(zlib.decompress(self._data))
        return value

    def __len__(self) -> int:
        return len(self._data)


class Store(Mapping[Any, list[JsonObj]]):
    """Key -> the objects filed under it (by `index`), plus each object by uid. With `pack`,
    values are kept as `Packed` and every read unpacks a fresh copy (a reader may change it;
    without `pack`, readers share the stored objects and must not)."""

    def __init__(self, kind: str, index: Index = by_namespaced_name, *,
                 pack: bool = False) -> None:
        self.kind = kind
        self._index = index
        self._pack = pack
        # uid -> (key, value, resourceVersion)
        self._by_uid: dict[str, tuple[Any, JsonObj | Packed, str | None]] = {}
        self._by_key: dict[Any, dict[str, JsonObj | Packed]] = {}

    def put(self, obj: JsonObj) -> None:
        uid = _uid(obj)
        self.discard(uid)
        version = (obj.get("metadata") or {}).get("resourceVersion")
        for key, value in self._index(self.kind, obj).items():
            kept = Packed(value) if self._pack else value
            self._by_uid[uid] = (key, kept, version)
            self._by_key.setdefault(key, {})[uid] = kept

    def discard(self, uid: str) -> JsonObj | None:
        found = self._by_uid.pop(uid, None)
        if found is None:
            return None
        key, value, _ = found
        filed = self._by_key.get(key, {})
        filed.pop(uid, None)
        if not filed:
            self._by_key.pop(key, None)
        return _unpacked(value)

    def uids(self) -> set[str]:
        return set(self._by_uid)

    def version_of(self, uid: str) -> str | None:
        found = self._by_uid.get(uid)
        return None if found is None else found[2]

    def __getitem__(self, key: Any) -> list[JsonObj]:
        return [_unpacked(v) for v in self._by_key[key].values()]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)


class Informer:
    """One kind, cluster-wide or in one namespace, filtered by a server-side label selector;
    see the module doc. `on_list(kind)` is called after each complete listing."""

    def __init__(
        self,
        api: WatchApi,
        kind: str,
        selector: str,
        on_event: OnEvent,
        *,
        index: Index = by_namespaced_name,
        namespace: str | None = None,
        on_list: Callable[[str], None] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        pack: bool = False,
    ) -> None:
        self.kind = kind
        self.store = Store(kind, index, pack=pack)
        self._namespace = namespace
        self._on_list = on_list
        self.synced = asyncio.Event()
        self.num_lists = 0
        self._api = api
        self._selector = selector
        self._on_event = on_event
        self._sleep = sleep

    async def run(self) -> None:
        """List and watch until cancelled."""
        failures = 0
        while True:
            try:
                version = await self._list()
                failures = 0
                while True:
                    version = await self._watch(version)
            except WatchExpiredError:
                log.debug("%s watch expired; listing again", self.kind)
            except (KubeError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                delay = BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS) - 1)]
                failures += 1
                log.warning("%s watch failed (%s); listing again in %.0f s", self.kind, exc, delay)
                await self._sleep(delay)

    async def _list(self) -> str:
        items: list[JsonObj] = []
        params = {"labelSelector": self._selector, "limit": str(PAGE_SIZE)}
        while True:
            page = await self._api.list_page(self.kind, params, self._namespace)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            if not meta.get("continue"):
                break
            params = {**params, "continue": str(meta["continue"])}
        self._replace(items)
        self.num_lists += 1
        if self._on_list is not None:
            self._on_list(self.kind)
        self.synced.set()
        return str(meta.get("resourceVersion") or "")

    def _replace(self, items: list[JsonObj]) -> None:
        """The listing becomes the store; after the first one, differences become events."""
        first = not self.synced.is_set()
        listed: set[str] = set()
        for obj in items:
            obj.setdefault("kind", self.kind)  # list items carry neither, watch events both
            obj.setdefault("apiVersion", api_version_of(self.kind))
            uid = _uid(obj)
            listed.add(uid)
            before = self.store.version_of(uid)
            self.store.put(obj)
            if first:
                self._on_event(None, obj)
            elif before is None:
                self._on_event("ADDED", obj)
            elif before != obj["metadata"].get("resourceVersion"):
                self._on_event("MODIFIED", obj)
        for uid in self.store.uids() - listed:
            gone = self.store.discard(uid)
            if gone is not None:
                self._on_event("DELETED", gone)

    async def _watch(self, version: str) -> str:
        params = {
            "labelSelector": self._selector,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_SECONDS),
            "resourceVersion": version,
        }
        try:
            async for event in self._api.watch(self.kind, params, self._namespace):
                version = self._apply(event) or version
        except KubeError as exc:
            if exc.status == 410:
                raise WatchExpiredError(str(exc)) from exc
            raise
        return version

    def _apply(self, event: JsonObj) -> str | None:
        """Apply one watch event; the resourceVersion it brings, if any."""
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise WatchExpiredError(str(obj.get("message", "410 Gone")))
            raise ValueError(f"{self.kind} watch error: {obj.get('message', obj)}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind == "BOOKMARK":
            return str(version) if version else None
        obj.setdefault("kind", self.kind)
        if kind == "DELETED":
            self.store.discard(_uid(obj))
        elif kind in ("ADDED", "MODIFIED"):
            self.store.put(obj)
        else:
            raise ValueError(f"{self.kind} watch sent an event of unknown type {kind!r}")
        self._on_event(kind, obj)
        return str(version) if version else None


def _unpacked(value: JsonObj | Packed) -> JsonObj:
    return value.unpack() if isinstance(value, Packed) else value


def _uid(obj: JsonObj) -> str:
    return str((obj.get("metadata") or {}).get("uid", ""))
