"""The weight-matmul path choice: picked from timings, cached per host, applied per row count;
and the kernel cache keyed by sources and ISA level."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_model_runner import ContiguousAttention
from test_packed_matmul import quant_matrix
from tiny_llama import random_weights, tiny_config

from kvfleet.engine import matmul_plan, native
from kvfleet.engine.matmul_plan import (
    MatmulPlan,
    ShapeChoice,
    ShapeSample,
    WeightShape,
    choose,
    plan_for,
)
from kvfleet.engine.model.llama import LlamaModel
from kvfleet.engine.packed_matmul import (
    PackedWeight,
    QuantKernel,
    QuantWeight,
    RowRoutedWeight,
    TorchWeight,
    load_packer,
    load_quant_kernel,
)

NO_LIMIT = 2**62


def test_one_path_within_the_margin_everywhere_serves_every_row_count() -> None:
    timings = {1: {"quant": 1.0, "mkl": 3.0, "torch": 3.0},
               64: {"quant": 1.1, "mkl": 1.0, "torch": 1.2}}  # quant 10 % behind at 64
    assert choose(timings) == ShapeChoice((NO_LIMIT,), ("quant",))


def test_paths_split_by_row_count_where_one_path_would_cost_too_much() -> None:
    timings = {1: {"quant": 1.0, "mkl": 3.0}, 4: {"quant": 1.0, "mkl": 2.0},
               16: {"quant": 3.0, "mkl": 1.0}, 64: {"quant": 9.0, "mkl": 1.0}}
    choice = choose(timings)
    # Limits at the geometric mean between measured counts; runs of one path merged.
    assert choice == ShapeChoice((8, NO_LIMIT), ("quant", "mkl"))
    assert [choice.path_for(rows) for rows in (1, 8, 9, 1000)] == ["quant", "quant", "mkl",
                                                                    "mkl"]


def test_a_near_tie_goes_to_the_path_that_reads_fewer_bytes() -> None:
    # torch 30 % faster at 1 row, mkl 5 % faster at 16: only the 1-row switch is worth it.
    timings = {1: {"quant": 1.3, "mkl": 3.0, "torch": 1.0},
               16: {"quant": 1.05, "mkl": 1.0, "torch": 3.0}}
    assert choose(timings) == ShapeChoice((4, NO_LIMIT), ("torch", "quant"))


def test_the_two_ways_of_one_stored_weight_split_by_row_count_at_no_memory_cost() -> None:
    # quant and quant_wide share the 4-bit blocks: no second representation to pay for, so
    # each row count takes the faster of the two (ties to quant_wide, the same code there).
    same = {"quant_wide": 1.0, "quant": 1.0, "mkl": 3.0}
    timings = {16: same, 32: {"quant_wide": 0.8, "quant": 1.0, "mkl": 2.0}, 256: same}
    assert choose(timings) == ShapeChoice((NO_LIMIT,), ("quant_wide",))
    # The panels 5 % faster at 32 rows: enough between two ways of one weight (no bytes at
    # stake), not between two stored weights (SWITCH_GAIN).
    timings[32] = {"quant_wide": 1.05, "quant": 1.0, "mkl": 2.0}
    # (Past WIDE_REGISTER_ROWS both run the same code: one segment.)
    assert choose(timings) == ShapeChoice((22, NO_LIMIT), ("quant_wide", "quant"))
    timings[256] = {"quant_wide": 0.9, "quant": 1.0, "mkl": 3.0}  # the same code: noise
    assert choose(timings) == ShapeChoice((22, NO_LIMIT), ("quant_wide", "quant"))
    assert choose({16: {"quant": 1.0, "mkl": 1.0}, 32: {"quant": 1.05, "mkl": 1.0}}
                  ) == ShapeChoice((NO_LIMIT,), ("quant",))
    # Neither way within SECOND_PATH_GAIN of MKL at 256 rows: every path competes.
    timings[256] = {"quant_wide": 2.0, "quant": 2.0, "mkl": 1.0}
    assert choose(timings).paths == ("quant_wide", "quant", "mkl")


def test_a_path_not_timed_at_every_row_count_is_not_chosen() -> None:
    assert choose({1: {"quant": 1.0, "torch": 2.0}, 4: {"torch": 2.0}}).paths == ("torch",)
    with pytest.raises(ValueError, match="no matmul path was timed at every row count"):
        choose({1: {"quant": 1.0}, 4: {"torch": 1.0}})


def test_a_routed_weight_sends_each_call_to_the_path_for_its_rows() -> None:
    calls: list[str] = []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def matmul(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(self.name)
            return x

    weight = RowRoutedWeight((2, 32, NO_LIMIT), (Recorder("a"), Recorder("b"), Recorder("c")))
    for rows in (1, 2, 3, 32, 33, 500):
        weight.matmul(torch.zeros(rows, 4))
    assert calls == ["a", "a", "b", "b", "c", "c"]


@pytest.fixture
def quant() -> QuantKernel:
    built = load_quant_kernel()
    assert built is not None, "the quantized matmul did not build (see the log)"
    return built


def sample(quant_type: str = "Q4_1", out_features: int = 64, in_features: int = 96
           ) -> ShapeSample:
    blocks, weight = quant_matrix(quant_type, out_features, in_features, seed=3)
    return ShapeSample(WeightShape("o", in_features, out_features, quant_type), weight.t(),
                       blocks)


def test_measured_plans_are_cached_per_host_and_logged(
    quant: QuantKernel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv(matmul_plan.PLAN_CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(matmul_plan, "ROW_COUNTS", (1, 8))
    monkeypatch.setattr(matmul_plan, "run_queue_wait", lambda: None)  # a busy CI host
    measured: list[int] = []
    real_measure = matmul_plan.measure

    def counting_measure(*args: object, **kwargs: object) -> MatmulPlan:
        measured.append(1)
        return real_measure(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(matmul_plan, "measure", counting_measure)
    samples = [sample()]
    with caplog.at_level(logging.INFO, logger=matmul_plan.__name__):
        first = plan_for(samples, None, quant)
        second = plan_for(samples, None, quant)
    assert measured == [1]  # the second start read the cache
    assert first == second and set(first.timings["o:96x64:Q4_1"]) == {1, 8}
    assert set(first.timings["o:96x64:Q4_1"][1]) == {"quant", "quant_wide", "torch"}
    assert len(list(tmp_path.glob("*.json"))) == 1
    tables = [r.getMessage() for r in caplog.records if "weight matmul paths for" in r.getMessage()]
    assert len(tables) == 2 and "o:96x64:Q4_1" in tables[0] and "1 rows" in tables[0]
    # Another set of paths (here: MKL available too) is another plan, measured anew.
    packer = load_packer()
    if packer is not None:
        plan_for(samples, packer, quant)
        assert measured == [1, 1]


def test_two_cpus_of_one_model_name_keep_separate_plans(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Under this workplace's hypervisor a Zen 4 and a Zen 5 both call themselves "AMD EPYC";
    # their family numbers (25, 26) tell them apart, and their measured speeds differ.
    monkeypatch.setenv(matmul_plan.PLAN_CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(native.TARGET_ENV, raising=False)  # the fake CPU runs only generic
    cpuinfo = tmp_path / "cpuinfo"
    real_open = open

    def fake_open(path: object, *args: object, **kwargs: object) -> object:
        return real_open(cpuinfo if path == "/proc/cpuinfo" else path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    files = []
    for family in (25, 26):
        cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: "
                           f"{family}\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nstepping\t: 1"
                           f"\nflags\t\t: fpu avx2\n\nprocessor\t: 1\ncpu family\t: 99\n")
        assert native.cpu_identity() == f"AMD EPYC, family {family} model 17 stepping 1"
        files.append(matmul_plan._cache_file([sample()], ["quant", "torch"]))
    assert files[0] != files[1]


def test_a_corrupt_cache_file_is_measured_again(
    quant: QuantKernel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(matmul_plan.PLAN_CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(matmul_plan, "ROW_COUNTS", (1,))
    monkeypatch.setattr(matmul_plan, "run_queue_wait", lambda: None)
    plan_for([sample()], None, quant)
    [cached] = tmp_path.glob("*.json")
    cached.write_text("{not json")
    plan = plan_for([sample()], None, quant)
    assert set(plan.timings["o:96x64:Q4_1"]) == {1}


def test_timings_taken_while_other_work_shared_the_cpus_are_neither_used_nor_cached(
    quant: QuantKernel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv(matmul_plan.PLAN_CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(matmul_plan, "ROW_COUNTS", (1,))
    readings = [0.0]  # then: the threads waited for a CPU the whole time (and more)
    monkeypatch.setattr(matmul_plan, "run_queue_wait",
                        lambda: readings.pop() if readings else 1e6)
    with caplog.at_level(logging.INFO, logger=matmul_plan.__name__):
        plan = plan_for([sample(), sample(out_features=32)], None, quant)
    # Timing stopped after the first shape, and nothing of it is used.
    assert plan.choices == {} and list(plan.timings) == ["o:96x64:Q4_1"]
    assert plan.choice(sample().shape) is None  # the model's fixed fewest-bytes order serves
    assert "fewest bytes (quant, mkl, torch)" in plan.table()
    assert list(tmp_path.glob("*.json")) == []
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "other work shared this process's CPUs" in warning and "not used or cached" in warning


def test_run_queue_wait_counts_the_time_a_thread_waits_for_a_busy_cpu() -> None:
    """The real kernel counter: this thread and a spinning process pinned to one CPU."""
    if matmul_plan.run_queue_wait() is None:
        pytest.skip("this kernel keeps no per-thread schedstat")
    cpu = min(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    own = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(spinner.pid, {cpu})
        os.sched_setaffinity(0, {cpu})  # this thread only (Linux: pid 0 is the caller)
        waited, started = matmul_plan.run_queue_wait(), time.monotonic()
        while time.monotonic() - started < 0.5:
            pass
        elapsed = time.monotonic() - started
        waited_for = (matmul_plan.run_queue_wait() or 0.0) - (waited or 0.0)
    finally:
        os.sched_setaffinity(0, own)
        spinner.kill()
        spinner.wait()
    # Sharing one CPU with a spinner, the thread waits for it about half the time.
    assert 0.2 * elapsed < waited_for < elapsed


def test_a_weight_is_timed_on_its_first_outputs_under_its_own_shape(quant: QuantKernel) -> None:
    whole = sample("Q8_0", out_features=64)
    part = whole.first_outputs(32)
    assert part.shape == whole.shape  # the plan's choice serves the whole weight
    assert part.weight_t.shape == (96, 32) and torch.equal(part.weight_t, whole.weight_t[:, :32])
    assert whole.blocks is not None and part.blocks is not None
    assert part.blocks.ggml_type == "Q8_0" and torch.equal(part.blocks.rows, whole.blocks.rows[:32])
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(2))
    # the part's 4-bit path computes the whole's first 32 outputs
    torch.testing.assert_close(
        QuantWeight.pack(part.blocks, 96, quant).matmul(x),
        QuantWeight.pack(whole.blocks, 96, quant).matmul(x)[:, :32], rtol=0, atol=0)
    for count in (0, 24, 80):
        with pytest.raises(ValueError, match="multiple of 16"):
            whole.first_outputs(count)


def test_the_lm_head_is_timed_on_half_its_outputs() -> None:
    config = tiny_config()
    model = LlamaModel(config, random_weights(config, seed=5)).eval()
    head = next(s for s in model.weight_samples() if s.shape.name == "lm_head")
    assert head.shape.out_features == config.vocab_size
    assert head.weight_t.shape[1] == config.vocab_size // 2 // 16 * 16


@torch.inference_mode()
def test_a_model_packed_by_a_plan_runs_each_weight_on_its_chosen_paths(
    quant: QuantKernel,
) -> None:
    packer = load_packer()
    if packer is None:
        pytest.skip("no MKL in this torch build or no C++ compiler")
    config = tiny_config()
    weights = random_weights(config, seed=5)
    plain = LlamaModel(config, weights).eval()
    routed = LlamaModel(config, weights).eval()
    keys = {s.shape.key for s in routed.weight_samples()}
    split = ShapeChoice((2, NO_LIMIT), ("torch", "mkl"))
    plan = MatmulPlan({}, {key: split if key.startswith("qkv") else
                           ShapeChoice((NO_LIMIT,), ("torch",)) for key in keys})
    routed.pack_weights(packer, quant, plan)
    qkv = routed._packed[0][0] if routed._packed else None
    assert isinstance(qkv, RowRoutedWeight)
    assert [type(w) for w in qkv.weights] == [TorchWeight, PackedWeight]
    assert isinstance(routed._packed[0][1] if routed._packed else None, TorchWeight)
    assert routed._lm_head_packed is None  # a torch head: compute_logits multiplies itself
    for ids in ([7], [3, 17, 5, 9, 30, 2, 11]):  # 1 row: torch; 7 rows: MKL
        tokens = torch.tensor(ids)
        positions = torch.arange(len(ids))
        want = plain.compute_logits(plain(tokens, positions, ContiguousAttention(plain)))
        got = routed.compute_logits(routed(tokens, positions, ContiguousAttention(routed)))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_without_a_plan_the_fewest_bytes_path_serves(quant: QuantKernel) -> None:
    choice = ShapeChoice((NO_LIMIT,), ("quant",))
    built = matmul_plan.routed(choice, matmul_plan.candidates(sample(), None, quant))
    assert isinstance(built, QuantWeight)
    both = matmul_plan.routed(ShapeChoice((32, NO_LIMIT), ("quant", "quant_wide")),
                              matmul_plan.candidates(sample(), None, quant))
    assert isinstance(both, RowRoutedWeight)
    narrow, wide = both.weights
    assert isinstance(narrow, QuantWeight) and isinstance(wide, QuantWeight)
    assert wide.packed is narrow.packed and wide.register_rows == matmul_plan.WIDE_REGISTER_ROWS
    no_quant = matmul_plan.routed(choice, matmul_plan.candidates(sample(), None, None))
    assert isinstance(no_quant, TorchWeight)  # falls back in the order quant, mkl, torch


def test_a_target_the_cpu_cannot_run_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.TARGET_ENV, "x86_64_v9")
    with pytest.raises(native.KernelTargetError, match="'x86_64_v9' is not a level"):
        native.cpu_target()
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma", "bmi2", "f16c", "movbe"})
    monkeypatch.setenv(native.TARGET_ENV, "x86_64_v4")
    with pytest.raises(native.KernelTargetError, match="cannot run it; it runs x86_64_v3, generic"):
        native.cpu_target()
    monkeypatch.setenv(native.TARGET_ENV, "generic")
    assert native.cpu_target() == ("generic", [])
    monkeypatch.delenv(native.TARGET_ENV)
    assert native.cpu_target()[0] == "x86_64_v3"


def test_kernel_builds_are_keyed_by_source_content_and_level(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for source in ("fused_ops.cpp", "vec.h"):
        (tmp_path / source).write_bytes((native.CSRC / source).read_bytes())
    monkeypatch.setattr(native, "CSRC", tmp_path)
    name = native.build_name("fused_ops", "generic")
    assert name.startswith("kvfleet_fused_ops_generic_")
    assert native.build_name("fused_ops", "x86_64_v3") != name
    assert native.build_name("fused_ops", "generic") == name  # same sources, same folder
    (tmp_path / "vec.h").write_text((tmp_path / "vec.h").read_text() + "\n// edited\n")
    assert native.build_name("fused_ops", "generic") != name  # a header is part of the key


def test_a_finished_build_loads_without_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    # Built (or found) once, then imported as it is, without the builder (which would take a
    # lock file in the folder: an image's prebuilt folder is read-only to the engine).
    monkeypatch.setattr(native, "_loaded", {})
    assert native.build("fused_ops", "fused ops", "torch ops", "X") is not None
    folder = native.cache_root() / native.build_name("fused_ops", native.cpu_target()[0])
    assert (folder / "complete").exists()

    def no_compiler(**_: object) -> None:
        raise AssertionError("a finished build must not be compiled again")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    monkeypatch.setattr(native, "_loaded", {})
    assert native.build("fused_ops", "fused ops", "torch ops", "X") is not None
