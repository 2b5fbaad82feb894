"""Which weight-matmul path serves each weight shape and row count, chosen by timing on this host.

A path that is fastest on one CPU can be many times slower on another (the 4-bit kernel was
15x slower than MKL at prefill on an AVX2 host, while ahead on the AVX-512 host it was tuned
on), so the engine does not assume: at its first start on a host it times every path it has
(`quant`: the 4-bit/8-bit kernel; `quant_wide`: the same kernel taking its register path up to
`WIDE_REGISTER_ROWS` rows; `mkl`: MKL-packed float32; `torch`: `torch.mm`) on the
model's real weight shapes at a few row counts, in this process with its threads, and each
weight then uses the fastest path for the row count of each call. The timings are cached per
CPU (model name, family, model and stepping), ISA level, thread count, kernel sources and torch
version
(`plan_cache_root()`), so later starts read them, and the table chosen is
logged. A weight keeps a second representation (e.g. MKL's float32 beside its 4-bit blocks,
~4x the bytes) only where the single best path would be more than `SECOND_PATH_GAIN` slower at
some measured row count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet.engine import native
from kvfleet.engine.packed_matmul import (
    PackedWeight,
    Packer,
    QuantBlocks,
    QuantKernel,
    QuantWeight,
    RowRoutedWeight,
    TorchWeight,
    WeightMatmul,
)

log = logging.getLogger(__name__)

# Row counts timed: a decode step at 1-64 running, prefill chunks up to the step's budget.
# 32 because the quantized kernel's two ways of multiplying many rows cross between 16 and 64.
ROW_COUNTS = (1, 4, 16, 32, 64, 256, 1024)
# The LM head multiplies only the rows that are sampled: at most the running requests.
LM_HEAD_ROW_COUNTS = (1, 4, 16, 32, 64, 256)
# `quant_wide`: the 4-bit kernel's register path (each weight dequantized in registers once per 16
# rows, 12 on AVX2) up to this many rows, where `quant` switches to a panel buffer from 17 rows
# (AVX2: from 13). On a Zen 5 (2 threads, every layer's weights streamed in turn) the register path
# took SmolLM2's layer matmuls / LM head at 20 rows 1.28-1.33x / 1.49-1.58x faster, 32 rows
# 1.17-1.22x / 1.38-1.40x, 64 rows 1.03-1.06x / 1.19-1.21x; its AVX2 build (8 rows a pass then) at
# 12 rows 1.38x / 1.43x, 32 rows 1.09x / 1.15x, but 64 rows 0.93x / 0.97x. The kernel's built-in
# limits were measured on older hosts: which is faster is a measurement per host and shape, as for
# the other paths.
WIDE_REGISTER_ROWS = 64
# A second representation of a weight must save more than this fraction somewhere.
SECOND_PATH_GAIN = 0.15
# Paths from the fewest bytes a call streams to the most: a tie (within SWITCH_GAIN) goes to
# the earlier one, so timing noise does not move a weight onto a path that reads more. Of the
# two 4-bit ones (the same code up to 16 and past WIDE_REGISTER_ROWS rows), `quant_wide` first:
# timed alone, a shape's weights stay in cache, where the panels lose less than in a step that
# streams every layer (gate_up at 32 rows: 8 % slower alone, 17-22 % in the whole pass).
PREFERENCE = ("quant_wide", "quant", "mkl", "torch")
# Paths that multiply by one stored weight, so choosing between them costs no memory: the
# path that stores it.
STORED_BY = {"quant_wide": "quant"}
# Between two paths of one stored weight the margin is only for timing noise: no bytes at stake.
SAME_WEIGHT_GAIN = 0.03
# Without a measured choice (or where the chosen path cannot be built): the first of these
# that can be built, the fewest bytes first, with the kernel's built-in row limits.
FALLBACK = ("quant", "mkl", "torch")
SWITCH_GAIN = 0.10
PLAN_VERSION = 3
PLAN_CACHE_ENV = "KVFLEET_PLAN_CACHE"
# Timings are distrusted when this process's threads spent more than this share of the
# timing's wall time runnable but without a CPU (other work on the same CPUs). Quiet, the
# share measured ~0.2 %; beside one other busy 2-thread process on 2 cores, ~50 %.
CONTENDED_WAIT = 0.10

Timings = dict[int, dict[str, float]]  # rows -> path -> seconds per call


@dataclass(frozen=True, slots=True)
class WeightShape:
    """One kind of weight of the model: e.g. "qkv", 576 -> 960, stored as Q4_1."""

    name: str
    in_features: int
    out_features: int
    ggml_type: str | None  # None: float weights only

    @property
    def key(self) -> str:
        return f"{self.name}:{self.in_features}x{self.out_features}:{self.ggml_type or 'f32'}"


@dataclass(frozen=True, slots=True)
class ShapeSample:
    """A weight of one shape: float32 [in, out] (a transposed view is fine) and its raw
    blocks, if the file stored it quantized."""

    shape: WeightShape
    weight_t: torch.Tensor
    blocks: QuantBlocks | None

    def first_outputs(self, count: int) -> ShapeSample:
        """The weight's first `count` output features (a multiple of 16, the 4-bit kernel's
        group), under the same shape: to time a large weight's paths with less memory, since
        each path's copy of it lives while they are timed."""
        if count % 16 or not 0 < count <= self.shape.out_features:
            raise ValueError(f"first_outputs: {count} must be a multiple of 16 in "
                             f"(0, {self.shape.out_features}]")
        blocks = (None if self.blocks is None
                  else QuantBlocks(self.blocks.ggml_type, self.blocks.rows[:count]))
        return ShapeSample(self.shape, self.weight_t[:, :count], blocks)


@dataclass(frozen=True, slots=True)
class ShapeChoice:
    """The paths one shape uses: `paths[i]` for calls of up to `max_rows[i]` rows (the last
    entry has no limit)."""

    max_rows: tuple[int, ...]
    paths: tuple[str, ...]

    def path_for(self, rows: int) -> str:
        for limit, path in zip(self.max_rows, self.paths, strict=True):
            if rows <= limit:
                return path
        return self.paths[-1]


def choose(timings: Timings) -> ShapeChoice:
    """The first stored weight (in PREFERENCE order) whose paths are never more than
    SECOND_PATH_GAIN slower than the best at any row count, else every path; then per row count
    the fastest of those paths (`fastest_at`), with the limit between two measured counts at
    their geometric mean."""
    counts = sorted(timings)
    timed = set.intersection(*(set(timings[r]) for r in counts))
    paths = [p for p in PREFERENCE if p in timed] + sorted(timed - set(PREFERENCE))
    if not paths:
        raise ValueError("no matmul path was timed at every row count")
    best = {r: min(timings[r][p] for p in paths) for r in counts}

    def storing(stored: str) -> list[str]:
        return [p for p in paths if _stored(p) == stored]

    single = [stored for stored in dict.fromkeys(map(_stored, paths))
              if all(min(timings[r][p] for p in storing(stored))
                     <= best[r] * (1 + SECOND_PATH_GAIN) for r in counts)]
    allowed = storing(single[0]) if single else paths
    fastest = [fastest_at(timings[r], allowed) for r in counts]
    # Past WIDE_REGISTER_ROWS the two ways of the 4-bit weight run the same code: one segment.
    for i in range(1, len(counts)):
        if counts[i] > WIDE_REGISTER_ROWS and _stored(fastest[i]) == _stored(fastest[i - 1]):
            fastest[i] = fastest[i - 1]
    limits: list[int] = []
    chosen: list[str] = []
    for i, path in enumerate(fastest):
        limit = int((counts[i] * counts[i + 1]) ** 0.5) if i + 1 < len(counts) else 2**62
        if chosen and chosen[-1] == path:
            limits[-1] = limit
        else:
            chosen.append(path)
            limits.append(limit)
    return ShapeChoice(tuple(limits), tuple(chosen))


def _stored(path: str) -> str:
    """The path that stores the weight `path` multiplies by."""
    return STORED_BY.get(path, path)


def fastest_at(by_path: Mapping[str, float], paths: Sequence[str]) -> str:
    """The fastest of `paths` (in preference order), unless the most preferred one is within
    SWITCH_GAIN of it (SAME_WEIGHT_GAIN where both read the same stored weight)."""
    fastest, preferred = min(paths, key=by_path.__getitem__), paths[0]
    gain = SAME_WEIGHT_GAIN if _stored(fastest) == _stored(preferred) else SWITCH_GAIN
    return preferred if by_path[preferred] <= by_path[fastest] * (1 + gain) else fastest


def candidates(sample: ShapeSample, packer: Packer | None, quant: QuantKernel | None
               ) -> dict[str, Callable[[], WeightMatmul]]:
    """Builders of every path this weight can take here."""
    weight_t = sample.weight_t
    built: dict[str, Callable[[], WeightMatmul]] = {"torch": lambda: TorchWeight(weight_t)}
    if packer is not None:
        built["mkl"] = lambda: PackedWeight.pack(weight_t, packer)
    blocks = sample.blocks
    if quant is not None and blocks is not None and blocks.fits(sample.shape.in_features):
        packed: list[QuantWeight] = []

        def quant_weight() -> QuantWeight:  # packed once: both quant paths share the tensor
            if not packed:
                packed.append(QuantWeight.pack(blocks, sample.shape.in_features, quant))
            return packed[0]

        built["quant"] = quant_weight
        built["quant_wide"] = lambda: quant_weight().with_register_rows(WIDE_REGISTER_ROWS)
    return built


def time_paths(weights: Mapping[str, WeightMatmul], rows: int, in_features: int,
               repeats: int = 5, min_seconds: float = 0.004) -> dict[str, float]:
    """Seconds per call of each path at `rows` rows: the paths take turns (so a slow phase of
    the host hits all alike), each turn long enough to time, and each path's fastest turn
    counts (other work on the host only ever adds time)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    calls: dict[str, int] = {}
    for name, weight in weights.items():  # warm up, and size each turn
        weight.matmul(x)
        started = time.perf_counter()
        weight.matmul(x)
        once = max(time.perf_counter() - started, 1e-6)
        calls[name] = max(1, min(200, int(min_seconds / once)))
    samples: dict[str, list[float]] = {name: [] for name in weights}
    for _ in range(repeats):
        for name, weight in weights.items():
            started = time.perf_counter()
            for _ in range(calls[name]):
                weight.matmul(x)
            samples[name].append((time.perf_counter() - started) / calls[name])
    return {name: min(times) for name, times in samples.items()}


@dataclass(frozen=True, slots=True)
class MatmulPlan:
    """Timings and choices for every weight shape of one model on this host."""

    timings: dict[str, Timings]  # shape key -> timings
    choices: dict[str, ShapeChoice]

    def choice(self, shape: WeightShape) -> ShapeChoice | None:
        return self.choices.get(shape.key)

    def table(self) -> str:
        """The timings and the choice per shape, for a log or a terminal."""
        lines = []
        for key, timings in self.timings.items():
            choice = self.choices.get(key)
            lines.append(f"{key}: " + (" | ".join(
                f"{choice.paths[i]} up to {limit} rows" if limit < 2**62 else
                f"{choice.paths[i]}" for i, limit in enumerate(choice.max_rows))
                if choice is not None else "fewest bytes (" + ", ".join(FALLBACK) + ")"))
            for rows, by_path in sorted(timings.items()):
                cells = "  ".join(f"{p} {t * 1e3:8.3f} ms" for p, t in sorted(by_path.items()))
                lines.append(f"    {rows:5d} rows: {cells}")
        return "\n".join(lines)


def measure(samples: Sequence[ShapeSample], packer: Packer | None, quant: QuantKernel | None,
            after_shape: Callable[[str], bool] | None = None) -> MatmulPlan:
    """Every path's timings per shape. `after_shape(key)` is called as each shape is done;
    when it returns False the measurement stops there (the plan covers the shapes so far)."""
    timings: dict[str, Timings] = {}
    for sample in samples:
        weights = {name: build() for name, build in candidates(sample, packer, quant).items()}
        counts = LM_HEAD_ROW_COUNTS if sample.shape.name == "lm_head" else ROW_COUNTS
        shape_timings = {
            rows: time_paths(weights, rows, sample.shape.in_features) for rows in counts}
        # A row count where another path beat the preferred one is timed once more and each
        # path keeps its better time: a move off the preferred path needs two measurements.
        order = [p for p in PREFERENCE if p in weights]
        for rows, by_path in shape_timings.items():
            if fastest_at(by_path, order) != order[0]:
                again = time_paths(weights, rows, sample.shape.in_features)
                shape_timings[rows] = {p: min(t, again[p]) for p, t in by_path.items()}
        timings[sample.shape.key] = shape_timings
        del weights
        if after_shape is not None and not after_shape(sample.shape.key):
            break
    return MatmulPlan(timings, {key: choose(t) for key, t in timings.items()})


def run_queue_wait() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU, summed over
    its threads (Linux's /proc/self/task/*/schedstat); None where the kernel does not say."""
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        return None
    total, known = 0, False
    for tid in threads:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
            known = True
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total / 1e9 if known else None


def contention(waited_before: float | None, started: float) -> float | None:
    """The share of the engine threads' time since `started` (time.monotonic()) that they
    waited for a CPU, given run_queue_wait() at that moment; None if unknown."""
    waited_after = run_queue_wait()
    elapsed = time.monotonic() - started
    if waited_before is None or waited_after is None or elapsed <= 0:
        return None
    return max(0.0, waited_after - waited_before) / (elapsed * torch.get_num_threads())


def _cache_file(samples: Sequence[ShapeSample], paths: Sequence[str]) -> Path:
    target, _ = native.cpu_target()
    kernels = [native.build_name(stem, target) for stem in ("quant_matmul", "packed_matmul")]
    identity = json.dumps({
        "version": PLAN_VERSION, "cpu": native.cpu_identity(), "target": target,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "kernels": kernels,
        "shapes": [s.shape.key for s in samples], "paths": sorted(paths),
        "rows": [ROW_COUNTS, LM_HEAD_ROW_COUNTS], "gain": SECOND_PATH_GAIN,
    }, sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return plan_cache_root() / f"{target}-{digest}.json"


def plan_cache_root() -> Path:
    """Where measured plans are kept: `$KVFLEET_PLAN_CACHE`, default
    `~/.cache/kvfleet/matmul-plans` (writable by the engine; the kernel folder of an image is
    not)."""
    return Path(os.environ.get(PLAN_CACHE_ENV) or
                Path.home() / ".cache" / "kvfleet" / "matmul-plans")


def _read(path: Path) -> MatmulPlan | None:
    try:
        data = json.loads(path.read_text())
        timings = {key: {int(rows): {p: float(t) for p, t in by_path.items()}
                         for rows, by_path in shape.items()}
                   for key, shape in data["timings"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return MatmulPlan(timings, {key: choose(t) for key, t in timings.items()})


def _write(path: Path, plan: MatmulPlan) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"timings": plan.timings}, indent=1))
        tmp.replace(path)
    except OSError as exc:  # a read-only cache: measure again next start
        log.warning("matmul plan not cached (%s); the next start measures again", exc)


def plan_for(samples: Sequence[ShapeSample], packer: Packer | None, quant: QuantKernel | None
             ) -> MatmulPlan:
    """The cached plan for these shapes on this host, or a fresh measurement (then cached).
    The chosen table is logged either way.

    A measurement taken while other work shared this process's CPUs is neither used nor
    cached: its threads then wait for a CPU at every thread barrier, which the paths suffer
    unequally (an engine that timed its paths beside another one starting picked float32
    `torch.mm` for its 1-row calls, 6x the bytes, and decoded ~4x slower on every later start
    that read the cached plan). The share is checked after each shape, so such a start stops
    timing after the first one; every weight then takes its fewest-bytes path for this start,
    and the next start times the paths again."""
    paths = ["torch"] + (["mkl"] if packer is not None else []) + (
        ["quant", "quant_wide"] if quant is not None else [])
    path = _cache_file(samples, paths)
    plan = _read(path)
    if plan is None:
        started, waited = time.monotonic(), run_queue_wait()
        log.info("timing the weight matmul paths (%s) on %d weight shapes at up to %d rows; "
                 "the first start on this host does this once", ", ".join(paths), len(samples),
                 max(ROW_COUNTS))
        for sample in samples:
            if sample.weight_t.shape[1] < sample.shape.out_features:
                log.info("%s is timed on its first %d of %d output features", sample.shape.key,
                         sample.weight_t.shape[1], sample.shape.out_features)
        worst = 0.0  # the largest share of time waited for a CPU, checked after each shape

        def quiet_so_far(key: str) -> bool:
            nonlocal worst
            log.info("timed the matmul paths of %s", key)
            worst = max(worst, contention(waited, started) or 0.0)
            return worst <= CONTENDED_WAIT

        plan = measure(samples, packer, quant, quiet_so_far)
        if worst > CONTENDED_WAIT:
            log.warning("the matmul paths were timed while other work shared this process's "
                        "CPUs (its threads waited for a CPU %.0f%% of the time): the timings "
                        "are not used or cached; every weight takes its fewest-bytes path "
                        "(%s) for this start and the next start times them again",
                        worst * 100, ", ".join(FALLBACK))
            plan = MatmulPlan(plan.timings, {})
        else:
            _write(path, plan)
            log.info("matmul paths timed in %.1f s (cached in %s)", time.monotonic() - started,
                     path)
    log.info("weight matmul paths for %s, %s, %d threads:\n%s", native.cpu_identity(),
             native.cpu_target()[0], torch.get_num_threads(), plan.table())
    return plan


def routed(choice: ShapeChoice, build: Mapping[str, Callable[[], WeightMatmul]]
           ) -> WeightMatmul:
    """One weight on the paths `choice` names (a path not buildable here falls back to the
    first one that is, in the order quant, mkl, torch)."""
    def make(path: str) -> WeightMatmul:
        for name in (path, _stored(path), *FALLBACK):
            if name in build:
                return build[name]()
        raise ValueError("no matmul path can be built for this weight")

    if len(choice.paths) == 1:
        return make(choice.paths[0])
    made: dict[str, WeightMatmul] = {}
    weights = []
    for path in choice.paths:
        if path not in made:
            made[path] = make(path)
        weights.append(made[path])
    return RowRoutedWeight(choice.max_rows, tuple(weights))
