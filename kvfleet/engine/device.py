"""Where the engine runs and how much KV cache fits there.

`--device auto|cpu|cuda[:N]` (auto: the first GPU when one is visible), weights in the
artifact's dtype on a GPU (bfloat16 where the GPU has it, else float16; float32 on the CPU),
the KV cache in `--kv-cache-dtype` (auto: the weights' dtype).

The KV budget is measured after the weights are loaded, as `kvfleet capacity` plans it:

    GPU:  free device memory - workspace (the activations of the largest step) - safety
    CPU:  the cgroup's memory limit (the pod's limits.memory) - what the process holds
          - workspace - safety; without a limit, the configured default (512 MiB)

A pinned block count (`--num-kv-blocks`, what the operator passes from its plan) that does
not fit fails at start with this ledger in the message, never at the first long request.

CPU threads (`--cpu-threads`, `$OMP_NUM_THREADS`, the operator's `$KVFLEET_CPU_THREADS`, or
by default the cores this process may run on, capped by the cgroup's CPU quota, where
Kubernetes puts a container's limits.cpu), not the host's core count torch starts with. Every
step is a string of parallel regions whose threads wait for each other; with more threads
than the CPUs they get, a region waits on a thread that is descheduled while the others spin.
Two engines on a 2-core host, each with a thread per core, served a third of what they served
with one thread each (41.6 vs 119.6 output tok/s; one engine alone 84.8; bench/shared_host.py).

KVBudgetError    the pinned KV cache does not fit (the message is the ledger)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet.engine.config import MIB
from kvfleet.engine.errors import KvfleetEngineError
from kvfleet.engine.model.config import ModelConfig

GIB = 1 << 30
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The engine's threads as the operator sets them (from a pool's requests.cpu without a limit).
CPU_THREADS_ENV = "KVFLEET_CPU_THREADS"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVBudgetError(KvfleetEngineError):
    """The KV cache asked for does not fit; the message is the memory ledger."""


def resolve_device(spec: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N`; ValueError naming --device when it cannot be used."""
    spec = spec.strip().lower()
    if spec == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        index = 0 if spec == "cuda" else spec.removeprefix("cuda:")
        if not str(index).isdigit():
            raise ValueError(f"--device {spec}: expected cuda or cuda:N")
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec}: no CUDA device is visible (torch "
                             f"{torch.__version__}, CUDA build {torch.version.cuda}); use "
                             "--device cpu or auto")
        if int(index) >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: only {torch.cuda.device_count()} CUDA "
                             "device(s) are visible")
        return torch.device(f"cuda:{int(index)}")
    raise ValueError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N")


def resolve_dtype(spec: str, device: torch.device, checkpoint_dtype: str = "") -> torch.dtype:
    """The weights' dtype: float32 on the CPU; on a GPU the checkpoint's 16-bit dtype, else
    bfloat16 where the GPU supports it (sm80+), else float16."""
    if spec != "auto":
        if spec not in DTYPES:
            raise ValueError(f"--dtype {spec!r}: expected auto, {', '.join(DTYPES)}")
        return DTYPES[spec]
    if device.type == "cpu":
        return torch.float32
    if checkpoint_dtype == "float16":
        return torch.float16
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def dtype_name(dtype: torch.dtype) -> str:
    """`bfloat16` for torch.bfloat16: the name CacheConfig, the flags and the metrics use."""
    return str(dtype).removeprefix("torch.")


def resolve_kv_dtype(spec: str, weights: torch.dtype) -> torch.dtype:
    if spec == "auto":
        return weights
    if spec not in DTYPES:
        raise ValueError(f"--kv-cache-dtype {spec!r}: expected auto, {', '.join(DTYPES)}")
    return DTYPES[spec]


def cgroup_folders(controller: str, root: Path | None = None,
                   proc_cgroup: str | None = None) -> list[Path]:
    """Where limits on this process's `controller` may be written: the hierarchy as mounted
    (inside a container's cgroup namespace that is its own cgroup), and, on a host or under a
    runtime without a cgroup namespace, its own cgroup as /proc/self/cgroup names it and that
    cgroup's ancestors (a parent's limit caps its children); cgroup v2 and v1 alike."""
    root = root or CGROUP_ROOT
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            proc_cgroup = ""
    folders = [root, root / controller, root / f"{controller},cpuacct"]
    for line in proc_cgroup.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2's unified hierarchy
            base = root
        elif controller in controllers.split(","):
            base = root / controllers
        else:
            continue
        own = base / path.strip("/")
        folders += [own, *[p for p in own.parents if p.is_relative_to(base)]]
    return list(dict.fromkeys(folders))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_memory_limit(root: Path | None = None, proc_cgroup: str | None = None) -> int | None:
    """The lowest memory limit over this process's cgroups (v2 `memory.max`, v1
    `limit_in_bytes`), or None when there is none."""
    limits = []
    for folder in cgroup_folders("memory", root, proc_cgroup):
        for name in ("memory.max", "memory.limit_in_bytes"):
            text = _read(folder / name)
            # "max" (v2) and v1's huge "unlimited" are no limit.
            if text is not None and text.isdigit() and int(text) < 1 << 60:
                limits.append(int(text))
    return min(limits, default=None)


def cgroup_cpu_limit(root: Path | None = None, proc_cgroup: str | None = None) -> float | None:
    """The CPUs the lowest CFS quota over this process's cgroups allows (v2 `cpu.max`:
    "quota period"; v1 `cfs_quota_us` / `cfs_period_us`; Kubernetes writes a container's
    limits.cpu there), or None when there is no quota."""
    quotas = []
    for folder in cgroup_folders("cpu", root, proc_cgroup):
        pair = (_read(folder / "cpu.max") or "").split()[:2] or [
            _read(folder / "cpu.cfs_quota_us") or "", _read(folder / "cpu.cfs_period_us") or ""]
        # "max" (v2) and -1 (v1) are no quota.
        if len(pair) == 2 and all(v.isdigit() and int(v) > 0 for v in pair):
            quotas.append(int(pair[0]) / int(pair[1]))
    return min(quotas, default=None)


@dataclass(frozen=True)
class CpuThreads:
    """How many threads a step's parallel regions use, and why (for the start-up log)."""

    threads: int
    reason: str


def physical_cores(cpus: set[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """Cores among `cpus` (SMT siblings count once, as torch's own default does); the CPU
    count when the topology cannot be read."""
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        package, core = _read(topology / "physical_package_id"), _read(topology / "core_id")
        if package is None or core is None:
            return len(cpus)
        cores.add((package, core))
    return len(cores)


def cpu_threads(flag: int | None, env: dict[str, str], cores: int,
                quota: float | None) -> CpuThreads:
    """The first of: `--cpu-threads`; `$OMP_NUM_THREADS` (how any torch program is told);
    `$KVFLEET_CPU_THREADS` (the operator's, from requests.cpu); else the cores this process
    may run on, capped by the CFS quota rounded down (a region waits for its slowest thread,
    and a thread beyond the quota is one the scheduler parks every period), never below 1."""
    if flag is not None:
        return CpuThreads(flag, "--cpu-threads")
    for name in ("OMP_NUM_THREADS", CPU_THREADS_ENV):
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return CpuThreads(int(value), f"${name}")
    if quota is not None and int(quota) < cores:
        return CpuThreads(max(1, int(quota)), f"the cgroup CPU quota ({quota:g} CPUs)")
    return CpuThreads(cores, f"the cores this process may run on ({cores})")


def apply_cpu_threads(flag: int | None) -> CpuThreads:
    """Sets torch's intra-op threads (every later parallel region, on any thread) from
    `cpu_threads` for this process."""
    chosen = cpu_threads(flag, dict(os.environ), physical_cores(os.sched_getaffinity(0)),
                         cgroup_cpu_limit())
    torch.set_num_threads(chosen.threads)
    return chosen


def process_rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def workspace_bytes(config: ModelConfig, max_batched_tokens: int, max_running: int) -> int:
    """Activations of the largest step, float32: the residual stream, the fused q/k/v and
    gate/up outputs for every token, and the logits of every sampled row."""
    per_token = (2 * config.hidden_size + config.num_heads * config.head_dim + 2 * config.kv_dim
                 + 2 * config.intermediate_size)
    return 4 * (max_batched_tokens * per_token + max_running * config.vocab_size * 2)


@dataclass(frozen=True)
class KVLedger:
    """The memory the KV cache may take on the device, and where the rest goes."""

    where: str
    total: int  # the device's memory, or the cgroup limit
    held: int  # taken before the KV cache: weights, runtime, this process
    workspace: int
    safety: int

    @property
    def budget(self) -> int:
        return max(0, self.total - self.held - self.workspace - self.safety)

    def text(self) -> str:
        return (f"{self.where}: {self.total / GIB:.2f} GiB - held {self.held / GIB:.2f} GiB "
                f"(weights, runtime) - workspace {self.workspace / GIB:.2f} GiB - safety "
                f"{self.safety / GIB:.2f} GiB = {self.budget / GIB:.2f} GiB for the KV cache")


def measure(device: torch.device, config: ModelConfig, max_batched_tokens: int,
            max_running: int) -> KVLedger | None:
    """The ledger on `device` now (weights loaded), or None on a CPU without a memory limit."""
    workspace = workspace_bytes(config, max_batched_tokens, max_running)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return KVLedger(f"{device} ({torch.cuda.get_device_name(device)})", total,
                        total - free, workspace, max(512 * MIB, total // 20))
    limit = cgroup_memory_limit()
    if limit is None:
        return None
    return KVLedger("the cgroup memory limit", limit, process_rss_bytes(), workspace,
                    max(256 * MIB, limit // 10))


def check_pinned(blocks: int, bytes_per_block: int, ledger: KVLedger | None) -> None:
    """KVBudgetError when `blocks` do not fit the ledger (no ledger: nothing to check)."""
    needed = blocks * bytes_per_block
    if ledger is not None and needed > ledger.budget:
        raise KVBudgetError(
            f"--num-kv-blocks {blocks} needs {needed / GIB:.2f} GiB of KV cache "
            f"({blocks} x {bytes_per_block / MIB:.2f} MiB) and does not fit: {ledger.text()}. "
            "Lower --num-kv-blocks (the pool's plan: spec.engine, spec.gpu), use a 16-bit "
            "--kv-cache-dtype, or give the pod more memory")


