"""Reconciles read the watch-fed cache: apiserver requests per reconcile, and drift still closes.

A fake apiserver holds the truth and a fake watch delivers its changes to kopf-like indices
only when told to, so each test can put the cache behind the cluster, as a real watch is.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from operator_fakes import artifact, pool
from prometheus_client import generate_latest

from kvfleet.api.builders import make_artifact, make_rollout
from kvfleet.compat import default_matrix
from kvfleet.kube.api import KubeError
from kvfleet.operator import cache, handlers, metrics, naming
from kvfleet.operator.builders import EngineOptions
from kvfleet.operator.cache import INDEX_IDS, Cache
from kvfleet.operator.handlers import OperatorConfig, build_registry
from kvfleet.operator.runtime import Runtime
from kvfleet.operator.slots import Slots

JsonObj = dict[str, Any]
Requests = list[tuple[str, str]]  # (verb, what)
JsonList = list[JsonObj]
NS = "default"


class FakeIndex(Mapping[Any, list[JsonObj]]):
    """One kopf index: key -> the values filed by each object (by uid) under it."""

    def __init__(self) -> None:
        self.stores: dict[Any, dict[str, JsonObj]] = {}

    def __getitem__(self, key: Any) -> list[JsonObj]:
        return list(self.stores[key].values())

    def __iter__(self) -> Iterator[Any]:
        return iter(self.stores)

    def __len__(self) -> int:
        return len(self.stores)


class FakeCluster:
    """The apiserver (objects, resourceVersions, the operator's requests) and a lagging watch."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], JsonObj] = {}  # (kind, name) -> object
        self.indices = {index_id: FakeIndex() for index_id in INDEX_IDS.values()}
        self.requests: Requests = []
        self.undelivered: list[tuple[str, JsonObj]] = []  # watch events not yet delivered
        self.in_flight = 0
        self.max_in_flight = 0
        self._versions = itertools.count(100)
        self._uids = itertools.count(1)
        self.cache: Cache | None = None

    # -- the cluster side -----------------------------------------------------------------

    def store(self, obj: JsonObj, event: str = "MODIFIED") -> JsonObj:
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        meta.setdefault("namespace", NS)
        meta.setdefault("uid", f"uid-{next(self._uids)}")
        meta["resourceVersion"] = str(next(self._versions))
        meta["managedFields"] = [{"manager": "kvfleet-operator"}]
        self.objects[(obj["kind"], meta["name"])] = obj
        self.undelivered.append((event, copy.deepcopy(obj)))
        return obj

    def remove(self, kind: str, name: str) -> None:
        obj = self.objects.pop((kind, name))
        obj["metadata"]["resourceVersion"] = str(next(self._versions))
        self.undelivered.append(("DELETED", obj))

    def edit(self, kind: str, name: str, path: list[str], value: Any) -> None:
        """A hand edit (kubectl), not the operator's."""
        obj = copy.deepcopy(self.objects[(kind, name)])
        target = obj
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        self.store(obj)

    def ready(self, name: str) -> None:
        """The Deployment controller and kubelet caught up: every replica ready."""
        d = copy.deepcopy(self.objects[("Deployment", name)])
        want = d["spec"]["replicas"]
        d["metadata"]["generation"] = 1
        d["status"] = {"observedGeneration": 1, "replicas": want, "updatedReplicas": want,
                       "readyReplicas": want, "availableReplicas": want}  # fmt: skip
        self.store(d)

    def deliver(self) -> None:
        """The watch catches up, as kopf feeds its indices (and the DELETED handler)."""
        for event, obj in self.undelivered:
            index = self.indices[INDEX_IDS[obj["kind"]]]
            uid = obj["metadata"]["uid"]
            for stores in index.stores.values():
                stores.pop(uid, None)
            if event == "DELETED":
                if self.cache is not None:
                    self.cache.seen_deleted(obj)
                continue
            for key, value in cache.index_entry(obj["kind"], obj).items():
                index.stores.setdefault(key, {})[uid] = value
        for idx in self.indices.values():  # kopf drops a key with no values left
            idx.stores = {key: values for key, values in idx.stores.items() if values}
        self.undelivered = []

    # -- the KubeApi verbs the runtime uses -------------------------------------------------

    async def _request(self, verb: str, what: str) -> None:
        self.requests.append((verb, what))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0.01)  # a round trip: concurrent requests overlap here
        self.in_flight -= 1

    async def apply(self, obj: JsonObj) -> JsonObj:
        await self._request("PATCH", f"{obj['kind']} {obj['metadata']['name']}")
        current = self.objects.get((obj["kind"], obj["metadata"]["name"]))
        merged = copy.deepcopy(obj)
        if current is not None:
            merged["metadata"]["uid"] = current["metadata"]["uid"]
            merged["status"] = current.get("status", {})
        return self.store(merged, "MODIFIED" if current else "ADDED")

    async def patch_status(self, kind: str, namespace: str, name: str, status: JsonObj) -> JsonObj:
        await self._request("PATCH", f"{kind} {name}/status")
        obj = copy.deepcopy(self.objects[(kind, name)])
        merged = {**obj.get("status", {}), **status}
        obj["status"] = {k: v for k, v in merged.items() if v is not None}
        return self.store(obj)

    async def create(self, obj: JsonObj) -> None:
        await self._request("POST", f"Event {obj['reason']}")

    async def delete(self, kind: str, namespace: str, name: str, uid: str | None) -> None:
        await self._request("DELETE", f"{kind} {name}")
        self.remove(kind, name)

    async def patch(self, kind: str, namespace: str, name: str, body: JsonObj) -> JsonObj:
        await self._request("PATCH", f"{kind} {name} {json.dumps(body, sort_keys=True)}")
        obj = copy.deepcopy(self.objects[(kind, name)])
        obj["spec"].update(body.get("spec", {}))
        return self.store(obj)

    async def list(self, kind: str, namespace: str, selector: str | None = None) -> JsonList:
        await self._request("GET", f"{kind} list")
        return [o for (k, _), o in self.objects.items() if k == kind]

    async def get(self, kind: str, namespace: str, name: str) -> JsonObj | None:
        await self._request("GET", f"{kind} {name}")
        return self.objects.get((kind, name))

    # -- what the tests look at -------------------------------------------------------------

    def take(self) -> Requests:
        requests, self.requests = self.requests, []
        return requests


def _runtime(cluster: FakeCluster) -> Runtime:
    cluster.cache = Cache(cluster.indices)
    return Runtime(api=cluster, cache=cluster.cache, matrix=default_matrix())  # type: ignore[arg-type]


@pytest.fixture
def cluster() -> FakeCluster:
    c = FakeCluster()
    c.store(artifact().to_wire(), "ADDED")
    c.store(pool().to_wire(), "ADDED")
    c.deliver()
    return c


async def _converge(cluster: FakeCluster, runtime: Runtime) -> str:
    """Create the pool's objects, let the watch and the Deployment catch up; the Deployment."""
    await runtime.reconcile_pool((NS, "chat"))
    cluster.deliver()
    (deployment,) = [name for kind, name in cluster.objects if kind == "Deployment"]
    cluster.ready(deployment)
    cluster.deliver()
    await runtime.reconcile_pool((NS, "chat"))
    cluster.deliver()
    cluster.take()
    return deployment


def _writes(requests: Requests) -> Requests:
    return [r for r in requests if r[0] != "POST"]  # events aside


@pytest.mark.asyncio
async def test_a_new_pool_is_written_in_one_round_trip_without_reads(cluster: FakeCluster) -> None:
    runtime = _runtime(cluster)
    await runtime.reconcile_pool((NS, "chat"))
    requests = cluster.take()
    assert sorted(_writes(requests)) == [
        ("PATCH", f"Deployment {_deployment_name(cluster)}"),
        ("PATCH", "NetworkPolicy chat"),
        ("PATCH", "PodDisruptionBudget chat"),
        ("PATCH", "Secret chat-router-token"),
        ("PATCH", "Service chat"),
        ("PATCH", "ServingPool chat/status"),
    ]
    assert ("POST", "Event Created") in requests
    assert not [r for r in requests if r[0] == "GET"]
    assert cluster.max_in_flight == len(requests)  # all at once: one round trip of latency


@pytest.mark.asyncio
async def test_a_reconcile_before_the_watch_delivers_its_own_writes_writes_nothing(
    cluster: FakeCluster,
) -> None:
    runtime = _runtime(cluster)
    await runtime.reconcile_pool((NS, "chat"))
    cluster.take()
    # A trigger arrives before the watch has delivered the creates and the status.
    await runtime.reconcile_pool((NS, "chat"))
    assert cluster.take() == []
    cluster.deliver()
    await runtime.reconcile_pool((NS, "chat"))
    assert cluster.take() == []


@pytest.mark.asyncio
async def test_a_converged_pool_costs_no_request(cluster: FakeCluster) -> None:
    runtime = _runtime(cluster)
    await _converge(cluster, runtime)
    pool_status = cluster.objects[("ServingPool", "chat")]["status"]
    assert any(
        c["type"] == "Available" and c["status"] == "True" for c in pool_status["conditions"]
    )
    for _ in range(3):  # drift ticks
        await runtime.reconcile_pool((NS, "chat"))
    assert cluster.take() == []


@pytest.mark.asyncio
async def test_hand_edits_are_restored_and_spec_is_never_written(cluster: FakeCluster) -> None:
    runtime = _runtime(cluster)
    deployment = await _converge(cluster, runtime)
    spec = copy.deepcopy(cluster.objects[("ServingPool", "chat")]["spec"])
    cluster.edit("Deployment", deployment, ["spec", "replicas"], 3)  # kubectl scale
    cluster.deliver()
    await runtime.reconcile_pool((NS, "chat"))
    requests = cluster.take()
    assert ("PATCH", f"Deployment {deployment}") in requests
    assert ("POST", "Event Restored") in requests
    assert cluster.objects[("Deployment", deployment)]["spec"]["replicas"] == 1
    assert not [r for r in requests if r[1] == "ServingPool chat"]  # only ever /status
    assert cluster.objects[("ServingPool", "chat")]["spec"] == spec


@pytest.mark.asyncio
async def test_a_deleted_child_is_recreated(cluster: FakeCluster) -> None:
    runtime = _runtime(cluster)
    await _converge(cluster, runtime)
    cluster.remove("Service", "chat")
    cluster.deliver()
    await runtime.reconcile_pool((NS, "chat"))
    assert ("PATCH", "Service chat") in cluster.take()
    assert ("Service", "chat") in cluster.objects


@pytest.mark.asyncio
async def test_a_child_deleted_before_the_watch_saw_it_created_is_recreated(
    cluster: FakeCluster,
) -> None:
    runtime = _runtime(cluster)
    await runtime.reconcile_pool((NS, "chat"))  # creates; the watch has not delivered them
    cluster.take()
    cluster.remove("Service", "chat")
    cluster.deliver()  # ADDED, then DELETED
    await runtime.reconcile_pool((NS, "chat"))
    assert ("PATCH", "Service chat") in cluster.take()


@pytest.mark.asyncio
async def test_a_restarted_operator_with_a_synced_cache_writes_nothing(
    cluster: FakeCluster,
) -> None:
    await _converge(cluster, _runtime(cluster))
    restarted = _runtime(cluster)  # a new process: nothing but what the watches list
    await restarted.reconcile_pool((NS, "chat"))
    assert cluster.take() == []


@pytest.mark.asyncio
async def test_a_deleted_pool_is_not_brought_back_by_its_last_status_write(
    cluster: FakeCluster,
) -> None:
    runtime = _runtime(cluster)
    await runtime.reconcile_pool((NS, "chat"))  # status written: a stand-in exists
    cluster.deliver()
    cluster.take()
    cluster.remove("ServingPool", "chat")
    cluster.deliver()
    await runtime.reconcile_pool((NS, "chat"))
    assert cluster.take() == []


def test_the_newer_resource_version_wins_and_stand_ins_expire() -> None:
    index = FakeIndex()
    indices = {i: FakeIndex() for i in INDEX_IDS.values()} | {INDEX_IDS["ServingPool"]: index}
    now = [0.0]
    c = Cache(indices, ttl_seconds=10, clock=lambda: now[0])
    meta = {"name": "a", "namespace": NS, "uid": "u", "resourceVersion": "5"}
    watched: JsonObj = {"kind": "ServingPool", "metadata": meta, "status": {"n": 1}}
    index.stores[(NS, "a")] = {"u": watched}
    written = copy.deepcopy(watched)
    written["metadata"]["resourceVersion"], written["status"] = "6", {"n": 2}
    c.wrote(written)
    assert c.get("ServingPool", NS, "a") == written
    now[0] = 11.0
    assert c.get("ServingPool", NS, "a") == watched  # expired: back to the watch's view
    c.wrote(written)
    newer = copy.deepcopy(watched)
    newer["metadata"]["resourceVersion"], newer["status"] = "7", {"n": 3}
    index.stores[(NS, "a")] = {"u": newer}
    assert c.get("ServingPool", NS, "a") == newer
    assert len(c) == 0  # the stand-in went once the watch passed it


def test_a_childs_stand_in_goes_once_the_watch_delivers_its_version() -> None:
    """During a burst of creates a stand-in kept for its whole TTL is a second copy of
    every new child: the watch's event for the same version ends it."""
    c = Cache({i: FakeIndex() for i in INDEX_IDS.values()}, ttl_seconds=60, clock=lambda: 0.0)
    owner = {"kind": "ServingPool", "controller": True, "uid": "p"}
    written: JsonObj = {"kind": "Service", "metadata": {
        "name": "s", "namespace": NS, "uid": "u", "resourceVersion": "6",
        "ownerReferences": [owner]}}  # fmt: skip
    older = copy.deepcopy(written)
    older["metadata"]["resourceVersion"] = "5"
    c.wrote(written)
    c.seen(older)  # an event from before the write: the stand-in is still the latest
    assert len(c) == 1 and c.owned("Service", NS, "p") == [written]
    c.seen(copy.deepcopy(written))
    assert len(c) == 0 and c._children == {}


def test_cached_objects_drop_managed_fields_and_pods_their_spec() -> None:
    owner = {"kind": "ServingPool", "controller": True, "uid": "p"}
    meta: JsonObj = {"name": "d", "namespace": NS, "ownerReferences": [owner]}
    d: JsonObj = {"kind": "Deployment", "metadata": {**meta, "managedFields": [{}]}, "spec": {}}
    assert cache.index_entry("Deployment", d) == {
        (NS, "p"): {"kind": "Deployment", "metadata": meta, "spec": {}}
    }
    orphan: JsonObj = {"kind": "Service", "metadata": {"name": "s", "namespace": NS}}
    assert cache.index_entry("Service", orphan) == {}
    pod_meta = {"name": "x", "namespace": NS, "labels": {naming.POOL_LABEL: "chat"}}
    p: JsonObj = {"kind": "Pod", "metadata": pod_meta, "spec": {"containers": []}, "status": {}}
    assert cache.index_entry("Pod", p) == {
        (NS, "chat"): {"kind": "Pod", "metadata": pod_meta, "status": {}}
    }


def test_every_cache_index_is_fed_by_kopf_or_an_informer() -> None:
    """The login handler takes the pool and artifact indices from kopf's keyword arguments by
    their ids, and the others from the informers' stores."""
    registry = build_registry(OperatorConfig(matrix=default_matrix()))
    ids = {h.id for h in registry._indexing.get_all_handlers()}
    assert ids == {INDEX_IDS[kind] for kind in handlers.KOPF_INDEXED.values()}
    assert set(handlers.KOPF_INDEXED.values()) | set(handlers.INFORMED) == set(INDEX_IDS)
    assert not set(handlers.KOPF_INDEXED.values()) & set(handlers.INFORMED)


def _deployment_name(cluster: FakeCluster) -> str:
    (name,) = [n for kind, n in cluster.objects if kind == "Deployment"]
    return name


@pytest.mark.asyncio
async def test_a_rollouts_events_are_posted_only_once_its_status_landed(
    cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator whose status write is refused (or that dies before it lands) decides again
    from the old status: had it announced the transition already, it would do so twice."""
    runtime = _runtime(cluster)
    await _converge(cluster, runtime)
    cluster.store(make_artifact("qwen3-8b-v2").set("spec.samplingDefaults.topK", 7).data(),
                  "ADDED")
    cluster.store(make_rollout().data(), "ADDED")
    cluster.edit("ServingPool", "chat", ["spec", "artifactRef", "name"], "qwen3-8b-v2")
    cluster.deliver()
    real_patch_status = cluster.patch_status

    async def refused(kind: str, namespace: str, name: str, status: JsonObj) -> JsonObj:
        if kind == "Rollout":
            await cluster._request("PATCH", f"{kind} {name}/status")
            raise KubeError("PATCH", f"rollouts/{name}/status", 500, "etcd timed out")
        return await real_patch_status(kind, namespace, name, status)

    monkeypatch.setattr(cluster, "patch_status", refused)
    with pytest.raises(KubeError):
        await runtime.reconcile_pool((NS, "chat"))
    assert ("PATCH", "Rollout chat/status") in (requests := cluster.take())
    assert not [r for r in requests if r[0] == "POST"], requests

    monkeypatch.setattr(cluster, "patch_status", real_patch_status)
    await runtime.reconcile_pool((NS, "chat"))
    requests = cluster.take()
    posted = [r for r in requests if r[0] == "POST"]
    assert posted.count(("POST", "Event RolloutStarted")) == 1, requests
    assert requests.index(("PATCH", "Rollout chat/status")) < requests.index(posted[0])
    # The operator's own series say where the rollout stands.
    phase = {p: metrics.ROLLOUT_PHASE.labels(namespace=NS, rollout="chat", phase=p)._value.get()
             for p in ("Idle", "Progressing", "Promoted")}
    assert phase == {"Idle": 0, "Progressing": 1, "Promoted": 0}
    assert metrics.ROLLOUT_STEP.labels(namespace=NS, rollout="chat")._value.get() == 0
    assert metrics.ROLLOUT_WEIGHT.labels(namespace=NS, rollout="chat")._value.get() == 0
    # A deleted Rollout's series go with it.
    metrics.forget_rollout(NS, "chat")
    exposed = generate_latest().decode()
    assert 'rollout="chat"' not in exposed
    metrics.forget_rollout(NS, "chat")  # twice: nothing left to forget, no error


@pytest.mark.asyncio
async def test_an_incompatible_artifact_gets_one_warning_not_two(cluster: FakeCluster) -> None:
    """Ready repeats the failing Compatible condition's reason and message; the artifact's
    events say it once."""
    runtime = _runtime(cluster)
    cluster.store(make_artifact("fp8").set("spec.dtype", "fp8").data(), "ADDED")
    cluster.deliver()
    await runtime.reconcile_artifact((NS, "fp8"))
    posted = [r for r in cluster.take() if r[0] == "POST"]
    assert posted.count(("POST", "Event Incompatible")) == 1, posted


@pytest.mark.asyncio
async def test_a_handed_over_pool_is_tried_again_with_back_off_until_it_lands(
    cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kopf's handlers hand a pool over and return (`Runtime.enqueue`): the runtime itself
    tries a failed reconcile again, waiting longer after each failure in a row, and a
    success starts the count over."""
    runtime = _runtime(cluster)
    real_apply, refusals = cluster.apply, [2]
    waits: list[tuple[float, bool]] = []

    async def apply(obj: JsonObj) -> JsonObj:
        if refusals[0] > 0 and obj["kind"] == "Service":
            refusals[0] -= 1
            raise KubeError("PATCH", "services/chat", 500, "etcd timed out")
        return await real_apply(obj)

    def wake(key: tuple[str, str], seconds: float, urgent: bool = True) -> None:
        waits.append((seconds, urgent))
        runtime.enqueue(key)  # at once: the test does not wait out the back-off

    monkeypatch.setattr(cluster, "apply", apply)
    monkeypatch.setattr(runtime, "wake", wake)
    runtime.enqueue((NS, "chat"))
    while runtime._woken:
        await asyncio.gather(*list(runtime._woken))
    assert waits == [(5.0, False), (10.0, False)]  # behind the urgent lane, longer each time
    assert ("Service", "chat") in cluster.objects and runtime._failures == {}


@pytest.mark.asyncio
async def test_a_pool_the_models_reject_is_not_retried_and_says_why(
    cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = _runtime(cluster)
    cluster.edit("ServingPool", "chat", ["spec", "replicas"], "three")
    cluster.deliver()
    monkeypatch.setattr(runtime, "wake", lambda *_: pytest.fail("an invalid pool was retried"))
    for _ in range(3):  # its event, then the drift loop's checks: said once
        runtime.enqueue((NS, "chat"))
        while runtime._woken:
            await asyncio.gather(*list(runtime._woken))
    assert cluster.take().count(("POST", "Event InvalidSpec")) == 1


@pytest.mark.asyncio
async def test_requests_while_a_pools_reconcile_queues_add_no_task(cluster: FakeCluster) -> None:
    """At 5,000 pools a pool waited minutes for a slot, and each request meanwhile (the drift
    loop, every child's and pod's watch event) added a task waiting for that same run: 30,000
    after three minutes, and the operator's memory grew with them. A run not started yet
    covers them, several in one turn of the event loop included, and sees their state."""
    runtime = _runtime(cluster)
    state = handlers._State()
    state.runtime = runtime
    runtime._slots = Slots(1)
    await runtime._slots.acquire()  # the burst holds the only slot
    cluster.edit("ServingPool", "chat", ["spec", "replicas"], 3)  # what the requests announce
    cluster.deliver()
    for _ in range(100):
        state.reconcile_soon((NS, "chat"))  # a child's watch event
        runtime.enqueue((NS, "chat"))  # the pool's own
    await asyncio.sleep(0)
    for _ in range(100):
        state.reconcile_soon((NS, "chat"))
        await asyncio.sleep(0)
    assert len(runtime._woken) <= 2 and not state.background  # waiting for a slot, and one more
    runtime._slots.release()
    while runtime._woken:
        await asyncio.gather(*list(runtime._woken))
    assert [o["spec"]["replicas"] for (k, _), o in cluster.objects.items()
            if k == "Deployment"] == [3]  # the run read the state the requests announced


@pytest.mark.asyncio
async def test_a_failed_run_that_covered_other_requests_is_tried_again(
    cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's own event found a run (a child's event's) pending and added nothing: when
    that run fails, it is tried again with back-off as the pool's own would have been."""
    runtime = _runtime(cluster)
    state = handlers._State()
    state.runtime = runtime
    waits: list[float] = []
    monkeypatch.setattr(runtime, "wake", lambda key, seconds, urgent=True: waits.append(seconds))

    async def refuse(obj: JsonObj) -> JsonObj:
        raise KubeError("PATCH", "services/chat", 500, "etcd timed out")

    monkeypatch.setattr(cluster, "apply", refuse)
    runtime._slots = Slots(1)
    await runtime._slots.acquire()
    runtime.enqueue((NS, "chat"))
    await asyncio.sleep(0)  # a run started: it waits for the slot
    state.reconcile_soon((NS, "chat"))  # a child's event: the follow-up run
    await asyncio.sleep(0)
    runtime.enqueue((NS, "chat"))  # the pool's own event: covered by the follow-up
    assert len(runtime._woken) == 2
    runtime._slots.release()
    while runtime._woken:
        await asyncio.gather(*list(runtime._woken))
    assert waits == [5.0, 10.0]  # both runs failed, and each is tried again


@pytest.mark.asyncio
async def test_an_operator_with_a_new_engine_image_rolls_the_fleet_in_a_bounded_wave() -> None:
    """Three governed pools serving under image 0.1; the operator restarts with 0.2: two
    start a rollout (--max-concurrent-rollouts 2), the third waits and says so; once one
    rolled back from 0.2, the third stays on stable for good."""
    cluster = FakeCluster()
    cluster.store(artifact().to_wire(), "ADDED")
    names = ("a", "b", "c")
    for name in names:
        cluster.store(pool(name).to_wire(), "ADDED")
        cluster.store(make_rollout(name, name, NS).data(), "ADDED")
    cluster.deliver()
    old = _runtime(cluster)
    for name in names:
        await old.reconcile_pool((NS, name))
    cluster.deliver()
    for kind, name in list(cluster.objects):
        if kind == "Deployment":
            cluster.ready(name)
    cluster.deliver()
    for name in names:
        await old.reconcile_pool((NS, name))
    cluster.deliver()
    stable = {n for k, n in cluster.objects if k == "Deployment"}
    assert len(stable) == 3

    new = Runtime(api=cluster, cache=cluster.cache, matrix=default_matrix(),  # type: ignore[arg-type]
                  options=EngineOptions(image="ghcr.io/kvfleet/kvfleet:0.2.0"))
    for name in names:
        await new.reconcile_pool((NS, name))
        cluster.deliver()
    status = {n: cluster.objects[("Rollout", n)].get("status", {}) for n in names}
    assert [status[n].get("phase") for n in names] == ["Progressing", "Progressing", "Idle"]
    assert status["a"]["wave"] == "ghcr.io/kvfleet/kvfleet:0.2.0"
    assert status["a"]["canaryChange"] == \
        "image ghcr.io/kvfleet/kvfleet:0.1.0 -> ghcr.io/kvfleet/kvfleet:0.2.0"
    assert "waiting for the fleet wave" in status["c"]["message"]
    canaries = {n for k, n in cluster.objects if k == "Deployment"} - stable
    assert {c.split("-")[0] for c in canaries} == {"a", "b"}

    cluster.edit("Rollout", "a", ["status", "phase"], "RolledBack")
    cluster.edit("Rollout", "b", ["status", "phase"], "Promoted")
    cluster.deliver()
    await new.reconcile_pool((NS, "c"))
    cluster.deliver()
    held = cluster.objects[("Rollout", "c")]["status"]
    assert held["phase"] == "Idle" and "stopped: pool default/a rolled back" in held["message"]
    assert not [n for k, n in cluster.objects if k == "Deployment" and n.startswith("c-")
                and n not in stable]


@pytest.mark.asyncio
async def test_an_autoscaled_pools_count_is_shared_by_stable_and_canary_mid_rollout() -> None:
    """The autoscaler's count grows from 2 to 4 during a 50 % step: stable and canary both
    grow, in proportion (stable kept its old count while only the canary was sized)."""
    cluster = FakeCluster()
    cluster.store(artifact().to_wire(), "ADDED")
    cluster.store(pool(spec__replicas=2, spec__autoscaling={
        "minReplicas": 1, "maxReplicas": 4}).to_wire(), "ADDED")
    cluster.deliver()
    runtime = _runtime(cluster)
    stable = await _converge(cluster, runtime)
    assert cluster.objects[("Deployment", stable)]["spec"]["replicas"] == 2
    cluster.store(make_artifact("qwen3-8b-v2").set("spec.samplingDefaults.topK", 7).data(),
                  "ADDED")
    cluster.store(make_rollout().set("spec.steps", [
        {"weight": 50, "analysis": False, "pauseSeconds": 3600}, {"weight": 100}]).data(),
        "ADDED")
    cluster.edit("ServingPool", "chat", ["spec", "artifactRef", "name"], "qwen3-8b-v2")
    cluster.deliver()

    async def sizes() -> dict[str, int]:
        await runtime.reconcile_pool((NS, "chat"))
        cluster.deliver()
        return {name: obj["spec"]["replicas"] for (kind, name), obj in cluster.objects.items()
                if kind == "Deployment"}

    first = await sizes()
    (canary,) = set(first) - {stable}
    assert first == {stable: 2, canary: 1}  # the canary first; stable whole while at 0 %
    cluster.ready(canary)
    cluster.deliver()
    assert await sizes() == {stable: 1, canary: 1}  # 50 %: stable has its half
    assert cluster.objects[("Rollout", "chat")]["status"]["currentWeight"] == 50
    cluster.edit("ServingPool", "chat", ["spec", "replicas"], 4)  # the autoscaler
    cluster.deliver()
    assert await sizes() == {stable: 2, canary: 2}
