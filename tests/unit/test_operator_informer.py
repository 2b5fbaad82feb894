"""Informers: the child kinds' list-and-watch, and what a re-list after `410 Gone` reports.

A fake apiserver serves pages and scripted watch streams; the informer's store and the events
it reports are what the operator's cache and triggers see.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubeconfig_fakes import write_kubeconfig
from operator_fakes import artifact, pool
from test_operator_cache import FakeCluster, _converge  # the cache tests' fake apiserver

from kvfleet.compat import default_matrix
from kvfleet.kube.api import JsonObj, KubeApi, KubeError, api_version_of
from kvfleet.kube.credentials import Credentials
from kvfleet.kube.informer import Informer, Packed, Store
from kvfleet.operator import naming
from kvfleet.operator.cache import INDEX_IDS, Cache, index_entry
from kvfleet.operator.handlers import drift_forever
from kvfleet.operator.runtime import Runtime

NS = "default"
SELECTOR = f"app.kubernetes.io/managed-by={naming.MANAGED_BY}"
Events = list[tuple[str | None, str]]  # (type, name)


def child(name: str, version: int, pool_uid: str = "uid-chat", kind: str = "Service") -> JsonObj:
    return {
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "resourceVersion": str(version),
            "managedFields": [{"manager": "kvfleet-operator"}],
            "ownerReferences": [
                {"kind": "ServingPool", "name": "chat", "uid": pool_uid, "controller": True}
            ],
        },
        "spec": {"ports": [{"port": 8000}]},
    }


class FakeWatchApi:
    """Lists from `objects` (paged by `page_size`); each watch plays the next script."""

    def __init__(self, objects: list[JsonObj], page_size: int = 2) -> None:
        self.objects = objects
        self.version = 10
        self.page_size = page_size
        self.scripts: list[list[JsonObj] | KubeError] = []
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.watch_ended = asyncio.Event()
        self.proceed = asyncio.Event()  # scripted watches start once this is set
        self.proceed.set()

    async def list_page(self, kind: str, params: dict[str, str],
                        namespace: str | None = None) -> JsonObj:
        self.calls.append(("list", params))
        start = int(params.get("continue", "0"))
        end = start + self.page_size
        meta: JsonObj = {"resourceVersion": str(self.version)}
        if end < len(self.objects):
            meta["continue"] = str(end)
        items = [{k: v for k, v in o.items() if k != "kind"} for o in self.objects[start:end]]
        return {"items": items, "metadata": meta}

    async def watch(self, kind: str, params: dict[str, str],
                    namespace: str | None = None) -> AsyncIterator[JsonObj]:
        self.calls.append(("watch", params))
        if not self.scripts:
            self.watch_ended.set()
            await asyncio.Event().wait()  # a quiet watch, until cancelled
        await self.proceed.wait()
        script = self.scripts.pop(0)
        if isinstance(script, KubeError):
            raise script
        for event in script:
            yield event


async def run_until(informer: Informer, api: FakeWatchApi) -> None:
    """Run the informer until it has played every script and waits on a quiet watch."""
    task = asyncio.create_task(informer.run())
    await asyncio.wait_for(api.watch_ended.wait(), 2)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def recorder() -> tuple[Events, Any]:
    events: Events = []
    return events, lambda kind, obj: events.append((kind, obj["metadata"]["name"]))


@pytest.mark.asyncio
async def test_lists_every_page_then_watches_from_the_lists_version_with_the_selector() -> None:
    api = FakeWatchApi([child("a", 1), child("b", 2), child("c", 3)])
    events, on_event = recorder()
    informer = Informer(api, "Service", SELECTOR, on_event, index=index_entry)
    await run_until(informer, api)
    assert informer.synced.is_set()
    assert events == [(None, "a"), (None, "b"), (None, "c")]  # the first listing, as kopf's
    assert [call for call, _ in api.calls] == ["list", "list", "watch"]
    assert all(params["labelSelector"] == SELECTOR for _, params in api.calls)
    watch = api.calls[-1][1]
    assert watch["resourceVersion"] == "10" and watch["allowWatchBookmarks"] == "true"
    (stored,) = informer.store[(NS, "uid-chat")][:1]
    assert stored["kind"] == "Service" and stored["apiVersion"] == "v1"
    assert "managedFields" not in stored["metadata"]


@pytest.mark.asyncio
async def test_watch_events_update_the_store_and_a_bookmark_moves_the_version() -> None:
    api = FakeWatchApi([child("a", 1)])
    api.scripts = [
        [
            {"type": "ADDED", "object": child("b", 11)},
            {"type": "MODIFIED", "object": child("a", 12)},
            {"type": "DELETED", "object": child("b", 13)},
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20"}}},
        ]
    ]
    events, on_event = recorder()
    informer = Informer(api, "Service", SELECTOR, on_event, index=index_entry)
    await run_until(informer, api)
    assert events == [(None, "a"), ("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
    (only,) = informer.store[(NS, "uid-chat")]
    assert only["metadata"]["resourceVersion"] == "12"
    assert api.calls[-1][1]["resourceVersion"] == "20"  # resumed where the bookmark said


@pytest.mark.asyncio
@pytest.mark.parametrize("expiry", ["event", "status"])
async def test_after_410_gone_a_relist_reports_what_changed_while_the_watch_was_away(
    expiry: str,
) -> None:
    api = FakeWatchApi([child("kept", 1), child("deleted-meanwhile", 2), child("edited", 3)])
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}
    api.scripts = [
        [gone] if expiry == "event" else KubeError("GET", "/api/v1/services", 410, "Gone")
    ]
    events, on_event = recorder()
    informer = Informer(api, "Service", SELECTOR, on_event, index=index_entry)
    api.proceed.clear()
    task = asyncio.create_task(informer.run())
    await asyncio.wait_for(informer.synced.wait(), 2)
    # While the watch is away: one object is deleted, one edited, one created.
    api.objects = [child("kept", 1), child("edited", 30), child("created-meanwhile", 31)]
    api.proceed.set()
    await asyncio.wait_for(api.watch_ended.wait(), 2)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert informer.num_lists == 2
    assert sorted(events[3:]) == [
        ("ADDED", "created-meanwhile"),
        ("DELETED", "deleted-meanwhile"),
        ("MODIFIED", "edited"),
    ]
    names = sorted(o["metadata"]["name"] for o in informer.store[(NS, "uid-chat")])
    assert names == ["created-meanwhile", "edited", "kept"]


@pytest.mark.asyncio
async def test_a_failed_list_is_retried_after_a_backoff() -> None:
    api = FakeWatchApi([child("a", 1)])
    real_list = api.list_page
    failures = [KubeError("GET", "/api/v1/services", 503, "unavailable")]

    async def flaky(kind: str, params: dict[str, str], namespace: str | None = None) -> JsonObj:
        if failures:
            raise failures.pop()
        return await real_list(kind, params, namespace)

    api.list_page = flaky  # type: ignore[method-assign]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    informer = Informer(api, "Service", SELECTOR, lambda *_: None, index=index_entry, sleep=sleep)
    await run_until(informer, api)
    assert slept == [1.0] and informer.synced.is_set()


def test_store_files_children_by_controlling_pool_and_pods_by_pool_label() -> None:
    services, pods = Store("Service", index_entry), Store("Pod", index_entry)
    services.put(child("a", 1))
    services.put(child("a", 2, pool_uid="uid-other"))  # the controller changed: refiled
    assert list(services) == [(NS, "uid-other")]
    pod = {"kind": "Pod", "metadata": {"name": "p", "namespace": NS, "uid": "uid-p",
           "labels": {naming.POOL_LABEL: "chat"}}, "spec": {"containers": []}}  # fmt: skip
    pods.put(pod)
    (stored,) = pods[(NS, "chat")]
    assert api_version_of("Deployment") == "apps/v1" and api_version_of("Pod") == "v1"
    assert "spec" not in stored
    assert pods.discard("uid-p") is not None and len(pods) == 0


def test_a_packed_store_keeps_bodies_compressed_and_hands_out_copies() -> None:
    deployment = child("a", 7, kind="Deployment")
    deployment["spec"] = {"template": {"spec": {"containers": [
        {"name": "engine", "env": [{"name": f"V{i}", "value": "x" * 40} for i in range(60)]}]}}}
    plain, packed = Store("Deployment", index_entry), Store("Deployment", index_entry, pack=True)
    plain.put(deployment)
    packed.put(deployment)
    (first,) = packed[(NS, "uid-chat")]
    assert first == plain[(NS, "uid-chat")][0]  # the same body a plain store files
    first["spec"]["template"] = {}  # a reader's change stays its own
    (second,) = packed[(NS, "uid-chat")]
    assert second == plain[(NS, "uid-chat")][0] and second is not first
    ((_, kept, version),) = packed._by_uid.values()
    assert isinstance(kept, Packed) and version == "7"
    assert packed.version_of(deployment["metadata"]["uid"]) == "7"
    assert len(kept) * 5 < len(json.dumps(deployment))  # repetitive bodies shrink
    assert packed.discard(deployment["metadata"]["uid"]) == plain[(NS, "uid-chat")][0]
    assert len(packed) == 0


def serving_one_pool(cluster: FakeCluster) -> Runtime:
    """An artifact and a pool stored and delivered; a runtime reading the cluster's cache."""
    cluster.store(artifact().to_wire(), "ADDED")
    cluster.store(pool().to_wire(), "ADDED")
    cluster.deliver()
    runtime = Runtime(api=cluster, cache=Cache(cluster.indices), matrix=default_matrix())  # type: ignore[arg-type]
    cluster.cache = runtime.cache
    return runtime


@pytest.mark.asyncio
async def test_a_child_deleted_while_the_watch_was_away_is_recreated() -> None:
    """The gap a kopf re-list left: the Service vanishes during a 410, the re-list reports it
    DELETED, and the pool's next reconcile applies it again."""
    cluster = FakeCluster()
    runtime = serving_one_pool(cluster)
    await runtime.pools.trigger((NS, "chat"))
    cluster.deliver()
    service = next(o for (kind, _), o in cluster.objects.items() if kind == "Service")
    name = service["metadata"]["name"]

    # An informer over the fake cluster's Services feeds the cache's Service index.
    api = FakeWatchApi([service])
    triggered: list[str] = []

    def on_event(kind: str | None, obj: JsonObj) -> None:
        if kind == "DELETED":
            runtime.cache.seen_deleted(obj)
            triggered.append(obj["metadata"]["ownerReferences"][0]["name"])

    informer = Informer(api, "Service", SELECTOR, on_event, index=index_entry)
    cluster.indices[INDEX_IDS["Service"]] = informer.store  # type: ignore[assignment]
    api.scripts = [[{"type": "ERROR", "object": {"code": 410, "message": "too old"}}]]
    api.proceed.clear()
    task = asyncio.create_task(informer.run())
    await asyncio.wait_for(informer.synced.wait(), 2)
    assert runtime.cache.owned("Service", NS, "uid-chat") != []
    cluster.objects.pop(("Service", name))  # deleted while the watch is away
    api.objects = []
    api.proceed.set()
    await asyncio.wait_for(api.watch_ended.wait(), 2)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert triggered == ["chat"]
    cluster.requests.clear()
    await runtime.pools.trigger((NS, "chat"))
    assert ("PATCH", f"Service {name}") in cluster.requests
    assert ("Service", name) in cluster.objects


@pytest.mark.asyncio
async def test_the_drift_loop_checks_every_cached_pool_once_per_interval_spread_over_it() -> None:
    cluster = FakeCluster()
    for name in ("a", "b", "c", "d"):
        cluster.store(pool(name).to_wire(), "ADDED")
    cluster.deliver()
    runtime = Runtime(api=cluster, cache=Cache(cluster.indices), matrix=default_matrix())  # type: ignore[arg-type]
    slept: list[float] = []
    checked: list[str] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) > 8:
            raise asyncio.CancelledError

    with contextlib.suppress(asyncio.CancelledError):
        await drift_forever(runtime, 20.0, lambda key: checked.append(key[1]), sleep)
    assert sorted(checked[:4]) == ["a", "b", "c", "d"] and checked[4:] == checked[:4]
    assert slept[:8] == [5.0] * 8  # 20 s over 4 pools
    assert cluster.requests == []  # the loop itself reads only the cache


@pytest.mark.asyncio
async def test_kube_api_watch_splits_lines_across_chunks_and_reports_410(tmp_path: Path) -> None:
    """The real client over a real HTTP server: an event larger than aiohttp's line limit, a
    line split between chunks, and a watch refused with 410 Gone."""
    from aiohttp import web

    big = child("big", 5)
    big["metadata"]["annotations"] = {"blob": "x" * 300_000}
    lines = [
        json.dumps({"type": "ADDED", "object": o}).encode() + b"\n" for o in (big, child("a", 6))
    ]
    payload = b"".join(lines)

    async def services(request: web.Request) -> web.StreamResponse:
        if request.query.get("resourceVersion") == "1":
            return web.json_response(
                {"kind": "Status", "code": 410, "message": "too old"}, status=410
            )
        if request.query.get("watch") != "true":
            return web.json_response({"items": [], "metadata": {"resourceVersion": "9"}})
        response = web.StreamResponse()
        await response.prepare(request)
        for start in range(0, len(payload), 7001):  # chunks that cut lines anywhere
            await response.write(payload[start : start + 7001])
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/api/v1/services", services)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    api = KubeApi(Credentials(write_kubeconfig(tmp_path / "kc", {}, {},
                                               server=f"http://127.0.0.1:{port}")))
    try:
        page = await api.list_page("Service", {"labelSelector": SELECTOR})
        assert page["metadata"]["resourceVersion"] == "9"
        events = [e async for e in api.watch("Service", {"watch": "true", "resourceVersion": "9"})]
        assert [e["object"]["metadata"]["name"] for e in events] == ["big", "a"]
        assert len(events[0]["object"]["metadata"]["annotations"]["blob"]) == 300_000
        with pytest.raises(KubeError) as refused:
            async for _ in api.watch("Service", {"watch": "true", "resourceVersion": "1"}):
                pass
        assert refused.value.status == 410
    finally:
        await api.close()
        await runner.cleanup()


class ForgetfulWatchCluster(FakeCluster):
    """The fake apiserver answering 404 to a status write of an object it no longer has."""

    async def patch_status(self, kind: str, namespace: str, name: str, status: JsonObj) -> JsonObj:
        if (kind, name) not in self.objects:
            await self._request("PATCH", f"{kind} {name}/status")
            raise KubeError("PATCH", f"{kind}/{name}/status", 404, "not found")
        return await super().patch_status(kind, namespace, name, status)


@pytest.mark.asyncio
async def test_a_pool_deleted_while_kopfs_watch_was_away_stops_being_served_at_its_first_404() -> (
    None
):
    """kopf's re-list never reports the pool's deletion, so the pool stays in its index; the
    garbage collector removes the children (the informers report that), the reconcile that
    follows writes the pool's status, the 404 evicts the pool, and nothing is written again."""
    cluster = ForgetfulWatchCluster()
    runtime = serving_one_pool(cluster)
    await _converge(cluster, runtime)
    del cluster.objects[("ServingPool", "chat")]
    cluster.undelivered = []  # the watch was away: its DELETED never comes
    for kind, name in [key for key in cluster.objects if key[0] != "ModelArtifact"]:
        cluster.remove(kind, name)  # the garbage collector's cascade, which informers report
    cluster.deliver()
    assert runtime.cache.get("ServingPool", NS, "chat") is not None  # still cached
    with pytest.raises(KubeError):
        await runtime._reconcile_pool((NS, "chat"))  # (reconcile_pool logs a 404 and returns)
    assert ("PATCH", "ServingPool chat/status") in cluster.take()
    assert runtime.cache.get("ServingPool", NS, "chat") is None
    await runtime.reconcile_pool((NS, "chat"))
    assert cluster.take() == []
