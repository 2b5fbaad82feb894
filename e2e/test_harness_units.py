"""Fast checks of the harness's pure parts (no binaries needed): cache keys, fleet manifests,
pod status, $(VAR) expansion, pod IP blocks, kubeconfig parsing, Prometheus relabelling."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvfleet.devcluster import fleet, toolchain
from kvfleet.devcluster.cluster import OWNER_FILE, WORKDIR_PREFIX, remove_orphaned_workdirs
from kvfleet.devcluster.errors import DevClusterError, ToolsMissingError
from kvfleet.devcluster.kube import connect
from kvfleet.devcluster.pki import create_pki, kubeconfig_yaml
from kvfleet.devcluster.podrunner import IpPool, container_exit_code
from kvfleet.devcluster.podstate import Container, LocalPod, expand, pod_status
from kvfleet.devcluster.prometheus import build_config


def test_cache_key_follows_pins_and_module_files(tmp_path: Path) -> None:
    src = tmp_path / "tools"
    shutil.copytree(toolchain.tools_src_dir(), src)
    kube = next(t for t in toolchain.TOOLS if t.name == "kubernetes")
    key = toolchain.cache_key(src, kube)
    assert key.startswith("kubernetes-v1.34.")
    assert toolchain.cache_key(src, kube) == key
    go_mod = src / "kubernetes" / "go.mod"
    go_mod.write_text(go_mod.read_text().replace("v1.34.4", "v1.34.3"))
    changed = toolchain.cache_key(src, kube)
    assert changed.startswith("kubernetes-v1.34.3-") and changed != key


def test_locate_names_the_build_command_when_binaries_are_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(toolchain.TOOLS_CACHE_ENV, str(tmp_path / "empty-cache"))
    with pytest.raises(ToolsMissingError, match=r"e2e/tools/build\.sh"):
        toolchain.locate()


def test_kubernetes_binaries_are_stamped_with_the_pinned_version() -> None:
    kube = next(t for t in toolchain.TOOLS if t.name == "kubernetes")
    flags = kube.ldflags("v1.34.4")
    assert "-X k8s.io/component-base/version.gitVersion=v1.34.4" in flags
    assert "-X k8s.io/client-go/pkg/version.gitMinor=34" in flags


def test_fleet_nodes_carry_gpu_labels_capacity_and_the_kwok_annotation() -> None:
    nodes = fleet.build_fleet([fleet.NodeGroup(fleet.H100_80GB, count=3, gpus_per_node=8)])
    assert [n["metadata"]["name"] for n in nodes] == ["gpu-h100-0", "gpu-h100-1", "gpu-h100-2"]
    labels = nodes[1]["metadata"]["labels"]
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["nvidia.com/gpu.count"] == "8"
    assert labels["topology.kubernetes.io/zone"] == "zone-b"
    assert nodes[0]["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert nodes[0]["metadata"]["annotations"][fleet.KWOK_ANNOTATION] == "fake"
    local = fleet.build_node("local-0", fleet.L4, 1, "z", fake=False)
    assert fleet.KWOK_ANNOTATION not in local["metadata"]["annotations"]
    with pytest.raises(ValueError, match="count"):
        fleet.NodeGroup(fleet.L4, count=-1, gpus_per_node=1)


def test_var_expansion_matches_kubernetes() -> None:
    env = {"POD_IP": "127.64.0.7"}
    assert expand("--host=$(POD_IP) $(MISSING)", env) == "--host=127.64.0.7 $(MISSING)"


def _pod(*containers: Container) -> LocalPod:
    return LocalPod("u", "ns", "p", "n", "127.64.0.2", Path("/nonexistent"), list(containers), [])


def test_pod_status_is_ready_only_when_every_container_is() -> None:
    a, b = Container({"name": "a"}), Container({"name": "b"})
    a.process = b.process = None
    a.restart_count, a.started_at = 1, "2026-01-01T00:00:00Z"  # ran, crashed, now waiting
    status = pod_status(_pod(a, b), {})
    assert status["phase"] == "Running"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"
    assert status["containerStatuses"][0]["state"] == {"waiting": {"reason": "CrashLoopBackOff"}}


def test_pod_that_cannot_start_stays_pending_with_the_reason() -> None:
    c = Container({"name": "a"}, restart_count=2, start_error="no command")
    status = pod_status(_pod(c), {})
    assert status["phase"] == "Pending"
    waiting = status["containerStatuses"][0]["state"]["waiting"]
    assert waiting == {"reason": "RunContainerError", "message": "no command"}


def test_pod_status_failed_when_a_container_exits_non_zero_for_good() -> None:
    c = Container({"name": "a"}, done=True, exit_code=3)
    status = pod_status(_pod(c), {})
    assert status["phase"] == "Failed"
    assert status["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3


def test_ip_pools_in_one_machine_never_share_a_block() -> None:
    first, second = IpPool(), IpPool()
    try:
        assert first.block != second.block
        ips = {first.take() for _ in range(5)}
        assert len(ips) == 5 and all(ip.startswith("127.64.") for ip in ips)
        first.give_back("127.64.0.9")
    finally:
        first.close()
        second.close()


def test_the_harness_kubeconfig_is_read_by_the_shared_loader(tmp_path: Path) -> None:
    pki = create_pki(tmp_path / "pki", "10.0.0.1")
    path = tmp_path / "files.kubeconfig"
    path.write_text(kubeconfig_yaml("https://127.0.0.1:6443/", pki.ca.cert, pki.admin, "admin"))
    client = connect(path)
    try:
        assert client.credentials.server == "https://127.0.0.1:6443"
        assert client.credentials.tls.cert == pki.admin.cert.read_bytes()
        assert client.credentials.tls.ca == pki.ca.cert.read_bytes()
    finally:
        client.close()
    path.write_text("current-context: nowhere\n")
    with pytest.raises(DevClusterError, match=f"kubeconfig {path}"):
        connect(path)


def test_prometheus_keeps_only_annotated_loopback_pods(tmp_path: Path) -> None:
    pki = create_pki(tmp_path, "10.0.0.1")
    config = build_config("https://127.0.0.1:1", pki.ca.cert, pki.admin)
    (job,) = config["scrape_configs"]
    keeps = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert [r["regex"] for r in keeps] == ["true", r"127\..*"]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    assert job["honor_labels"] is True  # the router's `namespace` is its pools', not its own


def test_exit_codes_follow_container_runtimes() -> None:
    assert container_exit_code(-15) == 143
    assert container_exit_code(3) == 3
    assert container_exit_code(None) is None


def test_orphaned_work_dirs_are_removed_and_live_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name, pid in (("orphan", dead.pid), ("live", os.getpid())):
        folder = tmp_path / f"{WORKDIR_PREFIX}{name}"
        folder.mkdir()
        (folder / OWNER_FILE).write_text(str(pid))
    remove_orphaned_workdirs()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{WORKDIR_PREFIX}live"]
