"""Compiled torch extensions of the engine (`csrc/`), built once per source and ISA level.

Each is compiled with torch's C++ extension builder (a C++ compiler and ninja, as for any
torch extension) for one x86-64 level (`v4_vnni` = AVX-512 with VNNI's integer dot products,
`v4` = AVX-512, `v3` = AVX2 + FMA, `generic`), into a
folder keyed by that level and a digest of the sources, compiler flags, torch and Python
versions: `$KVFLEET_KERNEL_CACHE` (default `~/.cache/kvfleet/kernels`). A second checkout of the
same sources, or a second engine on the machine, loads the finished library without compiling;
an edited source builds anew beside the old one; a cache shared between machines never runs
code a CPU lacks. `kvfleet kernels build --all-targets` prebuilds every level (the image does,
so a pod never compiles at start; a finished library loads from a read-only folder).

The engine runs the widest level this CPU has; `KVFLEET_CPU_TARGET=x86_64_v3` (or `generic`)
runs a narrower one, which is how one host measures every level it can execute. A build that
fails is logged once, with what the engine does instead, and not tried again.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
CACHE_ENV = "KVFLEET_KERNEL_CACHE"
TARGET_ENV = "KVFLEET_CPU_TARGET"
# Every extension of the engine, in the order `kvfleet kernels build` builds them.
STEMS = ("paged_attention", "quant_matmul", "packed_matmul", "fused_ops")
# Widest first; each level's compiler flags. x86-64-v4 is AVX-512 (F, BW, CD, DQ, VL); with
# VNNI (Ice Lake, Zen 4 and later) the 16-bit-activation matmul sums a pair of int16 products
# in one instruction (`vpdpwssd`): its matmuls 1.1-1.2x faster than the AVX-512BW form (two).
TARGETS: dict[str, list[str]] = {
    "x86_64_v4_vnni": ["-march=x86-64-v4", "-mavx512vnni"],
    "x86_64_v4": ["-march=x86-64-v4"],
    "x86_64_v3": ["-march=x86-64-v3"],
    "generic": [],
}
_TARGET_FLAGS = {
    "x86_64_v4_vnni": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma",
                       "bmi2", "avx512_vnni"},
    "x86_64_v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma",
                  "bmi2"},
    "x86_64_v3": {"avx2", "fma", "bmi2", "f16c", "movbe"},
    "generic": set(),
}
_COMPLETE = "complete"  # written after a successful build: the library may be loaded as is

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


class KernelTargetError(ValueError):
    """`KVFLEET_CPU_TARGET` names an unknown level or one this CPU cannot run."""


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in `/proc/cpuinfo` (every core of a host shows the same
    model and flags); empty where it cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> set[str]:
    return set(_cpuinfo().get("flags", "").split())


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`), or "unknown"."""
    return _cpuinfo().get("model name", "unknown")


def cpu_identity() -> str:
    """The model name with the CPU's family, model and stepping numbers (`/proc/cpuinfo`). A
    hypervisor may show only a vendor line as the name ("AMD EPYC" for both a Zen 4 and a
    Zen 5 here), so the numbers tell apart CPUs whose measured speeds differ."""
    info = _cpuinfo()
    return (f"{info.get('model name', 'unknown')}, family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')} stepping {info.get('stepping', '?')}")


def supported_targets() -> list[str]:
    """The levels this CPU can run, widest first (always ends with "generic")."""
    flags = cpu_flags()
    return [name for name, needs in _TARGET_FLAGS.items() if needs <= flags]


def cpu_target() -> tuple[str, list[str]]:
    """(level, compiler flags) the engine runs: the widest this CPU supports, or the one
    `KVFLEET_CPU_TARGET` names (it must be one the CPU can run)."""
    supported = supported_targets()
    wanted = os.environ.get(TARGET_ENV, "").strip()
    if not wanted:
        return supported[0], TARGETS[supported[0]]
    if wanted not in TARGETS:
        raise KernelTargetError(f"{TARGET_ENV}={wanted!r} is not a level the engine builds; "
                                f"use one of {', '.join(TARGETS)}")
    if wanted not in supported:
        raise KernelTargetError(f"{TARGET_ENV}={wanted!r}: this CPU ({cpu_model()}) cannot run "
                                f"it; it runs {', '.join(supported)}")
    return wanted, TARGETS[wanted]


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvfleet" / "kernels")


def _cflags(march: list[str]) -> list[str]:
    return ["-O3", "-fopenmp", *march]


def build_name(stem: str, target: str) -> str:
    """The library's name: stem, level and a digest of everything that shapes the binary."""
    import torch

    digest = hashlib.sha256()
    for path in sorted([CSRC / f"{stem}.cpp", *CSRC.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(_cflags(TARGETS[target])).encode())
    digest.update(f"torch {torch.__version__} python {sys.version_info[:2]}".encode())
    return f"kvfleet_{stem}_{target}_{digest.hexdigest()[:12]}"


def _library(folder: Path, name: str) -> Path:
    return folder / f"{name}.so"


def _import(folder: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, _library(folder, name))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {_library(folder, name)}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stage_sources(stem: str, folder: Path) -> list[str]:
    """Copies the sources into the build folder once: the build then names the same paths from
    every checkout, so ninja finds it up to date (the copies are what the digest covers)."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in [CSRC / f"{stem}.cpp", *CSRC.glob("*.h")]:
        staged = folder / path.name
        if not staged.exists():
            tmp = folder / f".{path.name}.{os.getpid()}"
            shutil.copyfile(path, tmp)
            tmp.replace(staged)
    return [str(folder / f"{stem}.cpp")]


def compile_library(stem: str, target: str, *, load: bool) -> ModuleType | None:
    """Builds `csrc/<stem>.cpp` for `target` unless finished already; imports it when `load`
    (only for a level this CPU runs). Raises what the build raised."""
    name = build_name(stem, target)
    folder = cache_root() / name
    if (folder / _COMPLETE).exists():
        return _import(folder, name) if load else None
    sources = _stage_sources(stem, folder)
    from torch.utils import cpp_extension

    cflags = _cflags(TARGETS[target])
    module: ModuleType | None = None
    if load:
        module = cpp_extension.load(name=name, sources=sources, extra_cflags=cflags,
                                    extra_ldflags=["-fopenmp"], build_directory=str(folder),
                                    verbose=False)
    else:  # another level's library, which importing could crash on this CPU
        cpp_extension._write_ninja_file_and_build_library(  # no public build-only API
            name=name, sources=sources, extra_cflags=cflags, extra_cuda_cflags=[],
            extra_sycl_cflags=[], extra_ldflags=["-fopenmp"], extra_include_paths=[],
            build_directory=str(folder), verbose=False, with_cuda=False, with_sycl=False)
    (folder / _COMPLETE).write_text(f"{name}\n")
    return module


def build(stem: str, what: str, instead: str, switch: str) -> ModuleType | None:
    """The extension `csrc/<stem>.cpp` for the level the engine runs, or None when it cannot be
    built here (the reason is logged once as a warning naming `what` it is, what the engine does
    `instead`, and the environment `switch` that skips it)."""
    target, _ = cpu_target()
    key = f"{stem}_{target}"
    with _lock:
        if key in _loaded:
            return _loaded[key]
        module: ModuleType | None = None
        started = time.monotonic()
        try:
            name = build_name(stem, target)
            if not (cache_root() / name / _COMPLETE).exists():
                log.info("building the %s for %s (first use of these sources on this machine, "
                         "about a minute on 2 cores) in %s", what, target, cache_root() / name)
            module = compile_library(stem, target, load=True)
            log.info("%s (%s) ready in %.1f s", what, target, time.monotonic() - started)
        except Exception as exc:  # no compiler, no ninja, a failed build: there is a fallback
            log.warning(
                "%s unavailable (%s: %s); %s. Install a C++ compiler and ninja to build it, "
                "or set %s to skip trying",
                what, type(exc).__name__,
                str(exc).strip().splitlines()[-1][:300] if str(exc) else "", instead, switch,
            )
        _loaded[key] = module
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
