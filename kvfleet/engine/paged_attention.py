"""The compiled decode-attention kernel (`csrc/paged_attention.cpp`), built on first use.

Decode attention is most of what a step does besides its weight matmuls, and the SDPA path
pays for a copy: it gathers each sequence's K/V blocks into one contiguous tensor and then
reads that copy. The kernel reads every cached position once, straight from the blocks.

It is compiled with torch's C++ extension builder (a C++ compiler and ninja, as for any torch
extension) the first time an engine starts on a machine and cached by torch
(`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`); later starts load the cached
library. The build targets the instruction set this CPU has (x86-64-v4 = AVX-512, v3 = AVX2),
named per target, so a cache shared between machines never runs code a CPU lacks.

`KVFLEET_ATTENTION=sdpa` turns the kernel off; when it cannot be built the engine logs why
once and uses SDPA (same results within float rounding, slower).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Protocol, cast

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
ENV_SWITCH = "KVFLEET_ATTENTION"


class Kernel(Protocol):
    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...


_lock = threading.Lock()
_loaded: dict[str, Kernel | None] = {}


def cpu_target() -> tuple[str, list[str]]:
    """(name, compiler flags) for the widest x86-64 level this CPU supports."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags:
        return "x86_64_v4", ["-march=x86-64-v4"]
    if {"avx2", "fma", "bmi2"} <= flags:
        return "x86_64_v3", ["-march=x86-64-v3"]
    return "generic", []


def load_kernel() -> Kernel | None:
    """The kernel, or None (switched off, or not buildable here: the reason is logged once)."""
    if os.environ.get(ENV_SWITCH, "kernel").lower() == "sdpa":
        return None
    target, march = cpu_target()
    with _lock:
        if target in _loaded:
            return _loaded[target]
        kernel: Kernel | None = None
        started = time.monotonic()
        log.info("loading the paged attention kernel (a first start on a machine builds it)")
        try:
            from torch.utils.cpp_extension import load

            module = load(
                name=f"kvfleet_paged_attention_{target}",
                sources=[str(SOURCE)],
                extra_cflags=["-O3", "-fopenmp", *march],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
            kernel = cast(Kernel, module)
            log.info("paged attention kernel ready in %.1f s", time.monotonic() - started)
        except Exception as exc:  # no compiler, no ninja, a failed build: SDPA still works
            log.warning(
                "paged attention kernel unavailable (%s: %s); decode attention uses SDPA. "
                "Install a C++ compiler and ninja to build it, or set %s=sdpa to skip trying",
                type(exc).__name__, str(exc).strip().splitlines()[-1][:300] if str(exc) else "",
                ENV_SWITCH,
            )
        _loaded[target] = kernel
        return kernel
