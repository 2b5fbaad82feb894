"""Compiled torch extensions of the engine (`csrc/`), built on first use and cached.

Each is compiled with torch's C++ extension builder (a C++ compiler and ninja, as for any
torch extension) the first time an engine starts on a machine and cached by torch
(`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`); later starts load the cached
library. A build targets the instruction set this CPU has (x86-64-v4 = AVX-512, v3 = AVX2),
named per target, so a cache shared between machines never runs code a CPU lacks. A build
that fails is logged once, with what the engine does instead, and not tried again.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


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


def build(stem: str, what: str, instead: str, switch: str) -> ModuleType | None:
    """The extension `csrc/<stem>.cpp`, or None when it cannot be built here (the reason is
    logged once as a warning naming `what` it is, what the engine does `instead`, and the
    environment `switch` that skips it)."""
    target, march = cpu_target()
    name = f"kvfleet_{stem}_{target}"
    with _lock:
        if name in _loaded:
            return _loaded[name]
        module: ModuleType | None = None
        started = time.monotonic()
        log.info("loading the %s (a first start on a machine builds it)", what)
        try:
            from torch.utils.cpp_extension import load

            module = load(
                name=name,
                sources=[str(CSRC / f"{stem}.cpp")],
                extra_cflags=["-O3", "-fopenmp", *march],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
            log.info("%s ready in %.1f s", what, time.monotonic() - started)
        except Exception as exc:  # no compiler, no ninja, a failed build: there is a fallback
            log.warning(
                "%s unavailable (%s: %s); %s. Install a C++ compiler and ninja to build it, "
                "or set %s to skip trying",
                what, type(exc).__name__,
                str(exc).strip().splitlines()[-1][:300] if str(exc) else "", instead, switch,
            )
        _loaded[name] = module
        return module


def return_freed_memory() -> None:
    """Hand freed heap memory back to the OS (e.g. model loading's dequantization buffers, a few
    hundred MiB). glibc keeps freed memory in its arenas, where it would count against the
    pod's memory limit for the life of the engine; elsewhere this is a no-op."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
