"""Where the engine runs and how much KV cache fits: device and dtype choice, the cgroup
limit, the ledger, and a pinned block count that does not fit failing at start."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import pytest
import torch
from tiny_llama import random_weights, tiny_config

from kvfleet.engine import device
from kvfleet.engine.model.llama import LlamaModel
from kvfleet.engine.model_runner import kv_bytes_per_block


def test_device_names() -> None:
    assert device.resolve_device("cpu") == torch.device("cpu")
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert device.resolve_device("auto") == torch.device(expected)
    for bad in ("tpu", "cuda:x"):
        with pytest.raises(ValueError, match="--device"):
            device.resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda:1: no CUDA device is visible"):
            device.resolve_device("cuda:1")


def test_dtypes_follow_the_device_and_the_checkpoint() -> None:
    cpu = torch.device("cpu")
    assert device.resolve_dtype("auto", cpu, "bfloat16") == torch.float32
    assert device.resolve_dtype("float16", cpu) == torch.float16
    with pytest.raises(ValueError, match="--dtype 'fp8'"):
        device.resolve_dtype("fp8", cpu)
    assert device.resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert device.resolve_kv_dtype("float16", torch.float32) == torch.float16


@pytest.mark.parametrize(("files", "limit"), [
    ({"memory.max": "max\n"}, None),  # cgroup v2, no limit
    ({"memory.max": "8589934592\n"}, 8 << 30),  # v2, limits.memory 8Gi
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # v1 unlimited
    ({"memory/memory.limit_in_bytes": "4294967296\n"}, 4 << 30),
    ({}, None),
])
def test_the_cgroup_memory_limit(tmp_path: Path, files: dict[str, str], limit: int | None
                                 ) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert device.cgroup_memory_limit(tmp_path, proc_cgroup="") == limit


@pytest.mark.parametrize(("files", "limit"), [
    ({"cpu.max": "max 100000\n"}, None),  # cgroup v2, no quota
    ({"cpu.max": "150000 100000\n"}, 1.5),  # v2, limits.cpu 1500m
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1
    ({"cpu,cpuacct/cpu.cfs_quota_us": "200000\n",
      "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 2.0),
    ({"cpu.max": "garbage\n"}, None),
    ({}, None),
])
def test_the_cgroup_cpu_quota(tmp_path: Path, files: dict[str, str], limit: float | None
                              ) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert device.cgroup_cpu_limit(tmp_path, proc_cgroup="") == limit


def test_limits_of_the_own_cgroup_and_its_parents_without_a_namespace(tmp_path: Path) -> None:
    # A host or a runtime without a cgroup namespace: the process's cgroup is a folder below
    # the mount, and a parent's limit caps it.
    own = tmp_path / "kubepods.slice" / "pod1" / "engine"
    own.mkdir(parents=True)
    (own / "cpu.max").write_text("400000 100000\n")
    (own.parent / "cpu.max").write_text("200000 100000\n")
    (own / "memory.max").write_text("max\n")
    (own.parent.parent / "memory.max").write_text(f"{8 << 30}\n")
    proc = "0::/kubepods.slice/pod1/engine\n"
    assert device.cgroup_cpu_limit(tmp_path, proc) == 2.0
    assert device.cgroup_memory_limit(tmp_path, proc) == 8 << 30
    # v1: each controller has its own hierarchy.
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "pod2").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "pod2" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu,cpuacct" / "pod2" / "cpu.cfs_period_us").write_text("100000\n")
    assert device.cgroup_cpu_limit(v1, "4:cpu,cpuacct:/pod2\n7:memory:/pod2\n") == 0.5


def test_physical_cores_count_smt_siblings_once(tmp_path: Path) -> None:
    for cpu, core in enumerate([0, 1, 0, 1]):  # 2 cores, 2 threads each
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert device.physical_cores({0, 1, 2, 3}, tmp_path) == 2
    assert device.physical_cores({0, 2}, tmp_path) == 1
    assert device.physical_cores({0, 9}, tmp_path) == 2  # no topology for cpu9: CPUs counted


def test_cpu_threads_are_the_cpus_the_process_gets() -> None:
    # A pod's limits.cpu caps the cores, rounded down, never below one thread.
    assert device.cpu_threads(None, {}, 64, 4.0).threads == 4
    assert device.cpu_threads(None, {}, 64, 1.5).threads == 1
    assert device.cpu_threads(None, {}, 64, 0.5).threads == 1
    assert "cgroup CPU quota (2.5 CPUs)" in device.cpu_threads(None, {}, 64, 2.5).reason
    # Fewer cores in the affinity mask (taskset, a static CPU manager) than the quota: the cores.
    assert device.cpu_threads(None, {}, 2, 8.0).threads == 2
    assert device.cpu_threads(None, {}, 3, None).threads == 3
    # Asked for: the flag, then $OMP_NUM_THREADS, then the operator's $KVFLEET_CPU_THREADS.
    both = {"OMP_NUM_THREADS": "3", "KVFLEET_CPU_THREADS": "4"}
    assert device.cpu_threads(5, both, 2, 1.0) == device.CpuThreads(5, "--cpu-threads")
    assert device.cpu_threads(None, both, 2, 1.0) == device.CpuThreads(3, "$OMP_NUM_THREADS")
    assert device.cpu_threads(None, {"KVFLEET_CPU_THREADS": "4"}, 2, None) == \
        device.CpuThreads(4, "$KVFLEET_CPU_THREADS")
    # Empty or unusable values are not asking.
    assert device.cpu_threads(None, {"OMP_NUM_THREADS": "", "KVFLEET_CPU_THREADS": "0"}, 2,
                              1.0).threads == 1
    assert device.cpu_threads(None, {"OMP_NUM_THREADS": "4,2"}, 2, None).threads == 2


def test_applied_threads_reach_every_thread() -> None:
    before = torch.get_num_threads()
    try:
        assert device.apply_cpu_threads(1).threads == 1
        seen: list[int] = []
        worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        worker.start()
        worker.join()
        assert seen == [1]  # the engine thread steps with what the loader set
    finally:
        torch.set_num_threads(before)


def _args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {
        "kv_cache_dtype": "auto", "block_size": 16, "max_num_batched_tokens": 512,
        "max_num_seqs": 8, "num_kv_blocks": None, "kv_cache_memory_mib": None,
        "enable_prefix_caching": True}
    return argparse.Namespace(**{**values, **overrides})


class _Loaded:
    def __init__(self) -> None:
        config = tiny_config()
        self.model = LlamaModel(config, random_weights(config))
        self.config = config


def _in_a_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int, rss: int
                 ) -> None:
    """This process as if in a pod with `limit` bytes of limits.memory, holding `rss`."""
    (tmp_path / "memory.max").write_text(str(limit))
    monkeypatch.setattr(device, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(device, "process_rss_bytes", lambda: rss)


def test_the_kv_cache_is_sized_from_the_pods_memory_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet.engine.serving_core import _cache_config

    _in_a_cgroup(tmp_path, monkeypatch, 2 << 30, 512 << 20)
    loaded = _Loaded()
    cpu = torch.device("cpu")
    config = _cache_config(_args(), loaded, cpu, torch.float32)  # type: ignore[arg-type]
    ledger = device.measure(cpu, loaded.config, 512, 8)
    assert ledger is not None and ledger.safety == max(256 << 20, (2 << 30) // 10)
    assert config.kv_cache_memory_bytes == ledger.budget
    assert ledger.budget == (2 << 30) - (512 << 20) - ledger.workspace - ledger.safety
    # 16 bits: the same budget, twice the blocks.
    half = _cache_config(_args(kv_cache_dtype="bfloat16"), loaded, cpu,  # type: ignore[arg-type]
                         torch.float32)
    assert half.kv_cache_dtype == "bfloat16"
    per_block = kv_bytes_per_block(loaded.config, 16, torch.bfloat16)
    assert half.resolve_num_blocks(per_block // 16) == ledger.budget // per_block
    # An explicit size wins; so does the operator's pinned count, when it fits.
    assert _cache_config(_args(kv_cache_memory_mib=64), loaded, cpu,  # type: ignore[arg-type]
                         torch.float32).kv_cache_memory_bytes == 64 << 20
    pinned = _cache_config(_args(num_kv_blocks=10), loaded, cpu,  # type: ignore[arg-type]
                           torch.float32)
    assert pinned.num_blocks == 10


def test_a_pinned_block_count_that_does_not_fit_fails_at_start_with_the_ledger(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet.engine.serving_core import _cache_config

    _in_a_cgroup(tmp_path, monkeypatch, 1 << 30, 400 << 20)
    loaded = _Loaded()
    blocks = (1 << 30) // kv_bytes_per_block(loaded.config, 16)  # the whole limit: too many
    with pytest.raises(device.KVBudgetError) as info:
        _cache_config(_args(num_kv_blocks=blocks), loaded,  # type: ignore[arg-type]
                      torch.device("cpu"), torch.float32)
    message = str(info.value)
    assert f"--num-kv-blocks {blocks} needs 1.00 GiB of KV cache" in message
    assert "the cgroup memory limit: 1.00 GiB - held 0.39 GiB" in message
    assert "Lower --num-kv-blocks" in message
