"""Two operator replicas on the real apiserver: one leads (the Lease), the other stands by
answering its liveness probe, and takes over when the leader is SIGKILLed (no clean release:
the Lease must expire), reconciling new pools within the lease duration and a few seconds."""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.test_operator_e2e import (  # noqa: F401 (crds is a fixture)
    H100,
    OPERATOR_NAMESPACE,
    Kubectl,
    OperatorProcess,
    _artifact_and_pool,
    _available,
    _create,
    _free_port,
    _wait_pool,
    crds,
    operator_kubeconfig,
)
from kvfleet.api.builders import make_pool
from kvfleet.devcluster.kube import KubeClient
from kvfleet.operator.leadership import LEASE_NAME

pytestmark = pytest.mark.e2e

LEASE_SECONDS = 15  # kvfleet.operator.leadership's default


def _holder(kube: KubeClient, namespace: str) -> str | None:
    lease = kube.get_or_none("Lease", LEASE_NAME, namespace)
    return ((lease or {}).get("spec") or {}).get("holderIdentity")


def _alive(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
        return bool(response.status == 200)


@pytest.fixture
def replicas(kube: KubeClient, kubectl: Kubectl, crds: None,  # noqa: F811
             tmp_path: Path) -> Iterator[dict[str, tuple[OperatorProcess, int]]]:
    """Two replicas as the chart runs them: the operator's ServiceAccount (its Lease Role in
    its own namespace), the same Lease."""
    kubeconfig = operator_kubeconfig(kube, kubectl, tmp_path)
    started: dict[str, tuple[OperatorProcess, int]] = {}
    for name in ("op-a", "op-b"):
        port = _free_port()
        log_dir = tmp_path / name
        log_dir.mkdir()
        proc = OperatorProcess(
            kubeconfig, log_dir, extra_args=(
                "--leader-elect", "--leader-election-namespace", OPERATOR_NAMESPACE,
                "--liveness", f"http://127.0.0.1:{port}/healthz"),
            env={"POD_NAME": name})
        proc.start()
        started[name] = (proc, port)
        if name == "op-a":  # a leads first, then b joins
            time.sleep(0.5)
    try:
        yield started
    finally:
        for proc, _ in started.values():
            proc.stop()
        kube.delete("Lease", LEASE_NAME, OPERATOR_NAMESPACE)


def test_one_replica_leads_and_the_standby_takes_over_when_it_is_killed(
    kube: KubeClient, namespace: str, replicas: dict[str, tuple[OperatorProcess, int]],
) -> None:
    leader = kube.wait_for("a leader", lambda: _holder(kube, OPERATOR_NAMESPACE), 60)
    standby = next(name for name in replicas if name != leader)
    lead_proc, _ = replicas[leader]
    standby_proc, standby_port = replicas[standby]
    _artifact_and_pool(kube, namespace, "ha-1")
    _wait_pool(kube, lead_proc, namespace, "ha-1", _available, "ha-1 Available by the leader")
    # Only the leader reconciles; the standby answers its liveness probe all the while.
    assert 'kvfleet_operator_reconciles_total{kind="ServingPool"}' in lead_proc.metrics()
    assert 'kvfleet_operator_reconciles_total{kind="ServingPool"}' not in \
        standby_proc.metrics()
    assert _alive(standby_port)
    assert f"held by {leader}; {standby} stands by" in standby_proc.log_tail()

    lead_proc.stop(signal.SIGKILL)
    killed = time.monotonic()
    kube.wait_for("the standby to take the Lease",
                  lambda: _holder(kube, OPERATOR_NAMESPACE) == standby or None,
                  LEASE_SECONDS + 20)
    taken_after = time.monotonic() - killed
    _create(kube, make_pool("ha-2", "qwen3-8b", namespace).set("spec.gpu.product", H100).data())
    _wait_pool(kube, standby_proc, namespace, "ha-2", _available, "ha-2 Available by the new "
               "leader", 60)
    assert 'kvfleet_operator_reconciles_total{kind="ServingPool"}' in standby_proc.metrics()
    assert taken_after <= LEASE_SECONDS + 10, taken_after
