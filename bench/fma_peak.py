"""The host's float32 multiply-add peak at the engine's ISA level, measured, for a roof.

A 1,024^3 `torch.mm` is not the peak on every host: torch's MKL takes its AVX2 code on AMD
CPUs, so on a Zen 5 (full-width AVX-512) it reached 215 GFLOP/s while the engine's own
AVX-512 4-bit kernel ran SmolLM2's matmuls at 350, and a roof the engine beats bounds nothing.
This probe runs what the peak is by definition: independent multiply-add chains held in
registers, on every thread, compiled for the level the engine runs (`KVFLEET_CPU_TARGET`, so
the AVX2 level's roof is AVX2's peak). Built once per level into the kernel cache.

    python bench/fma_peak.py        # prints the peak at this level, and MKL's matmul beside it
"""

from __future__ import annotations

import hashlib
import sys
import time
from types import ModuleType

import torch

from kvfleet.engine import native

# Vector width in bytes per level: the widest register the level has. The chains are plain
# GCC vector arithmetic; -O3 with the level's -march fuses each a * x + b into one FMA.
_WIDTH = {"x86_64_v4_vnni": 64, "x86_64_v4": 64, "x86_64_v3": 32, "generic": 16}
# 10 chains: enough to cover a multiply-add's latency (4 cycles) on two pipes, and with the
# two constants within AVX2's 16 registers, so nothing spills.
_SOURCE = r"""
#include <torch/extension.h>
#include <omp.h>

typedef float vf __attribute__((vector_size(WIDTH)));
constexpr int CHAINS = 10;
constexpr int LANES = WIDTH / 4;

// Runs `iters` rounds of CHAINS multiply-adds on each of `threads` threads; returns the
// seconds taken and a sum of the results (so the work is not optimised away).
std::vector<double> fma_loop(int64_t iters, int64_t threads) {
  double sink = 0.0;
  double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    vf a, b, acc[CHAINS];
    for (int l = 0; l < LANES; ++l) { a[l] = 0.999999f; b[l] = 1e-6f; }
    for (int c = 0; c < CHAINS; ++c)
      for (int l = 0; l < LANES; ++l) acc[c][l] = 1.0f + c * 1e-3f + omp_get_thread_num();
    for (int64_t i = 0; i < iters; ++i) {
      for (int c = 0; c < CHAINS; ++c) acc[c] = acc[c] * a + b;
      asm volatile("" : "+x"(a));  // a might change: each round is done, not folded
    }
    for (int c = 0; c < CHAINS; ++c)
      for (int l = 0; l < LANES; ++l) sink += acc[c][l];
  }
  return {omp_get_wtime() - start, sink};
}

int64_t flops_per_iter() { return 2LL * CHAINS * LANES; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fma_loop", &fma_loop);
  m.def("flops_per_iter", &flops_per_iter);
}
"""

_modules: dict[str, ModuleType] = {}


def _probe() -> ModuleType:
    target, march = native.cpu_target()
    if target not in _modules:
        from torch.utils import cpp_extension

        source = _SOURCE.replace("WIDTH", str(_WIDTH[target]))
        digest = hashlib.sha256((source + " ".join(march) + torch.__version__).encode())
        name = f"kvfleet_fma_peak_{target}_{digest.hexdigest()[:12]}"
        folder = native.cache_root() / name
        folder.mkdir(parents=True, exist_ok=True)
        if not any(folder.glob("*.so")):
            print(f"building the FMA peak probe for {target} in {folder} (once, ~30 s)",
                  file=sys.stderr, flush=True)
        _modules[target] = cpp_extension.load_inline(
            name=name, cpp_sources=[source], extra_cflags=["-O3", "-fopenmp", *march],
            extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
    return _modules[target]


def fma_peak_flops(threads: int | None = None, seconds: float = 0.2, repeats: int = 3) -> float:
    """Best observed float32 FLOP/s of register-resident multiply-adds on `threads` threads
    (default torch's), at the engine's ISA level."""
    probe = _probe()
    threads = threads or torch.get_num_threads()
    iters = 1 << 20
    elapsed, _ = probe.fma_loop(iters, threads)
    while elapsed < seconds / 4:  # size one round to ~`seconds`
        iters *= 2
        elapsed, _ = probe.fma_loop(iters, threads)
    iters = int(iters * seconds / max(elapsed, 1e-9))
    best = 0.0
    for _ in range(repeats):
        elapsed, _ = probe.fma_loop(iters, threads)
        best = max(best, iters * threads * probe.flops_per_iter() / elapsed)
    return best


def mkl_matmul_flops(size: int = 1024, repeats: int = 10) -> float:
    """Best observed FLOP/s of a square float32 `torch.mm` (MKL on x86), now."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - t))
    return best


def main() -> int:
    target, _ = native.cpu_target()
    fma, mkl = fma_peak_flops(), mkl_matmul_flops()
    print(f"{native.cpu_identity()}, level {target}, "
          f"{torch.get_num_threads()} threads: FMA peak {fma / 1e9:.1f} GFLOP/s; torch.mm "
          f"1024^3 {mkl / 1e9:.1f} GFLOP/s ({mkl / fma:.2f} of the peak)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
