"""Harness options for large fake fleets: node leases and the node-monitor grace period."""

from __future__ import annotations

import pytest

from kvfleet.devcluster.cluster import (
    DEFAULT_NODE_LEASE_SECONDS,
    ClusterOptions,
    DevCluster,
    node_lease_seconds_for,
)


def test_small_fleets_keep_kubernetes_defaults_and_large_ones_renew_about_20_leases_a_second() -> (
    None
):
    assert node_lease_seconds_for(20) == node_lease_seconds_for(200) == DEFAULT_NODE_LEASE_SECONDS
    lease = node_lease_seconds_for(2000)
    assert lease == 400
    renewals_per_second = 2000 / (lease / 4)  # KWOK renews every quarter of the lease
    assert renewals_per_second == pytest.approx(20)
    with pytest.raises(ValueError, match="num_nodes"):
        node_lease_seconds_for(-1)


def test_the_grace_period_keeps_kubernetes_ratio_to_the_lease() -> None:
    default = DevCluster(ClusterOptions())
    long = DevCluster(ClusterOptions(node_lease_seconds=400))
    try:
        assert default.node_monitor_grace_seconds == 50  # kube-controller-manager's default
        assert long.node_monitor_grace_seconds == 500
    finally:
        default.stop()
        long.stop()


def test_a_lease_kwok_could_not_renew_is_refused() -> None:
    with pytest.raises(ValueError, match="node_lease_seconds"):
        ClusterOptions(node_lease_seconds=3)
