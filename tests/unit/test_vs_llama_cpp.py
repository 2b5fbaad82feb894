"""How `bench/vs_llama_cpp.py` reads guidellm's report: which requests its TTFT percentiles
and its goodput count. A report is written here by hand; no server runs.

Budget: well under a second.
"""

from __future__ import annotations

from typing import Any

from bench_modules import load_bench

vs_llama_cpp = load_bench("vs_llama_cpp")


def _request(start: float, ttft_ms: float | None, itl_ms: float | None = 50.0,
             output_tokens: int = 96) -> dict[str, Any]:
    return {"request_start_time": start, "time_to_first_token_ms": ttft_ms,
            "inter_token_latency_ms": itl_ms, "output_tokens": output_tokens}


def test_ttft_counts_every_request_sent_and_goodput_the_finished_ones() -> None:
    report = {"benchmarks": [{
        "duration": 30.0, "start_time": 1000.0, "end_time": 1030.0,
        "requests": {
            # The first wave: finished, two of its three slow to start.
            "successful": [_request(1000.0, 200.0), _request(1000.0, 5000.0),
                           _request(1000.0, 6000.0, itl_ms=150.0)],
            # Later arrivals still decoding, and one with no token when the window closed.
            "incomplete": [_request(1020.0, 300.0, itl_ms=None, output_tokens=40),
                           _request(1021.0, 400.0, itl_ms=None, output_tokens=30),
                           _request(1029.5, None, itl_ms=None, output_tokens=0)],
            "errored": [_request(1001.0, None)]}}]}
    (run,) = vs_llama_cpp.runs_of(report)
    assert (run.completed, run.unfinished, run.failed) == (3, 3, 1)
    assert run.output_tokens == 3 * 96 + 40 + 30
    # Finished requests alone would put the p50 at 5 s; every request sent puts it at 0.4.
    assert sorted(run.ttft_sent) == [0.2, 0.3, 0.4, 0.5, 5.0, 6.0]
    summary = run.summary(slo_ttft=1.0, slo_tpot=0.1)
    assert summary["ttft"]["p50"] < 1.0 < summary["ttft"]["p95"]
    # Goodput: finished within both SLOs (only the first request), per second of window.
    assert summary["goodput"] == 1 / 30.0


def test_the_report_leaves_out_the_workloads_that_did_not_run() -> None:
    # `--only closed_loop`: the other sections once printed as rows of nan.
    figures = {"output_tok_s": 200.0, "ttft": {"p50": 0.3, "p95": 1.0},
               "tpot": {"p50": 0.1, "p95": 0.12}}
    results = {"kvfleet": {"closed_loop": [figures]},
               "llama.cpp": {"closed_loop": [dict(figures, output_tok_s=100.0)]}}
    args = vs_llama_cpp.parse_args(["--only", "closed_loop", "--streams", "4"])
    lines = vs_llama_cpp.report_lines(results, args)
    assert [line for line in lines if line.startswith("==")] == ["== closed loop"]
    assert "kvfleet/llama.cpp 2.00x" in lines[1] and not any("nan" in line for line in lines)
