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

CPU threads (`--cpu-threads` or `$OMP_NUM_THREADS`, default auto): the CPUs this process may
use, its affinity mask capped by the cgroup's CPU quota (where Kubernetes puts a container's
limits.cpu), not the host's core count torch starts with. Every step is a string of parallel
regions whose threads wait for each other; with more threads than the CPUs they get, a region
waits on a thread that is descheduled while the others spin. Two engines with 2 threads each
on one 2-core host answered 2.8 short chat requests a second between them, against 24.3-24.8
with one thread each or passive waiting (22.5 for one engine alone; measured, see bench/README.md).

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


def cgroup_memory_limit(root: Path | None = None) -> int | None:
    """The memory limit of this process's cgroup (v2 `memory.max`, v1 `limit_in_bytes`), or
    None when there is none."""
    root = root or CGROUP_ROOT
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit():
            return None
        value = int(text)
        return value if value < 1 << 60 else None  # v1's "unlimited" is a huge number
    return None


def cgroup_cpu_limit(root: Path | None = None) -> float | None:
    """CPUs the CFS quota of this process's cgroup allows (v2 `cpu.max`: "quota period"; v1
    `cfs_quota_us` / `cfs_period_us`), or None when there is no quota."""
    root = root or CGROUP_ROOT
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        for folder in (root / "cpu", root / "cpu,cpuacct"):
            try:
                quota = (folder / "cpu.cfs_quota_us").read_text().strip()
                period = (folder / "cpu.cfs_period_us").read_text().strip()
                break
            except OSError:
                continue
        else:
            return None
    if not quota.lstrip("-").isdigit() or not period.isdigit() or int(quota) <= 0 \
            or int(period) <= 0:
        return None  # "max" (v2) or -1 (v1): no quota
    return int(quota) / int(period)


@dataclass(frozen=True)
class CpuThreads:
    """How many threads a step's parallel regions use, and why (for the start-up log)."""

    threads: int
    reason: str


def cpu_threads(requested: int | None, affinity: int, quota: float | None,
                omp_num_threads: str | None = None) -> CpuThreads:
    """`requested` when given, else `$OMP_NUM_THREADS` when set (the usual way to say it for
    any torch program); else the CPUs in the affinity mask, capped by the quota rounded down
    (a 1.5-CPU quota runs 1 thread: a second would be throttled every period, and a region
    waits for its slowest thread), never below 1."""
    if requested is not None:
        return CpuThreads(requested, "--cpu-threads")
    if omp_num_threads and omp_num_threads.strip().isdigit() and int(omp_num_threads) > 0:
        return CpuThreads(int(omp_num_threads), "$OMP_NUM_THREADS")
    if quota is not None and int(quota) < affinity:
        return CpuThreads(max(1, int(quota)),
                          f"the cgroup CPU quota ({quota:g} CPUs, the pod's limits.cpu)")
    return CpuThreads(affinity, f"the CPUs this process may run on ({affinity})")


def apply_cpu_threads(requested: int | None) -> CpuThreads:
    """Sets torch's intra-op threads (every later parallel region, on any thread) from
    `cpu_threads` for this process."""
    chosen = cpu_threads(requested, len(os.sched_getaffinity(0)), cgroup_cpu_limit(),
                         os.environ.get("OMP_NUM_THREADS"))
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


