"""kvfleet serve vs llama.cpp's own server on the same GGUF with the same threads, side by side
in one run, with guidellm (the vLLM project's benchmark client) as the neutral client.

    .venv/bin/python bench/vs_llama_cpp.py                    # ~25 min on 2 cores
        [--threads 2] [--streams 1,4,16,32] [--rates 0.25,0.5,1,2] [--seconds 40]
        [--output-tokens 96] [--slo-ttft 1] [--slo-tpot 0.1] [--out bench/out/vs_llama_cpp]
        [--only single_32,closed_loop,...] [--int8-activations] [--int16-activations]
        [--cpu-level x86_64_v3]

Both servers stay up; each workload goes to one and then the other (the order alternates
from workload to workload, so a drift of the host's speed does not always favour one side):

1. one stream: a 32-token and a 1,000-token cold prompt (TTFT), 96 output tokens (decode
   tok/s = 1 / TPOT);
2. closed loop at each of --streams concurrent streams, prompts 32-256 tokens, 96 output
   tokens, --seconds each: output tok/s (every token delivered in the window, including those
   of requests still running at its end), TTFT p50/p95 (every request sent in the window; one
   with no token by its close counts its wait so far) and TPOT p50/p95 (finished requests);
3. Poisson arrivals at each of --rates (guidellm through `guidellm_launch.py`, which makes its
   arrivals one Poisson process, the same for both servers): goodput at the serving bench's
   SLO (finished requests with TTFT <= --slo-ttft and TPOT <= --slo-tpot, per second of the
   window);
4. a 90 %-shared 1k-token prefix (900 shared + 100 own tokens), one at a time: TTFT p50 of the
   requests after the first.

Prints kvfleet / llama.cpp for each figure; writes the numbers to OUT.json and a plot to
OUT.png (output tok/s vs concurrency, TTFT distributions of both, goodput vs rate).
TTFT is first token time - request start; TPOT = (last - first token time) / (tokens - 1)
(guidellm's inter_token_latency_ms), as in the design's definitions.

guidellm runs from its own environment (`scripts/guidellm-env.sh`, installed on first use);
llama-server is built once (`bench/llama_server.py`). When it cannot be built the run says why
and measures kvfleet alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import llama_server
from serve_bench import ROOT, TOKEN_ID_RANGE, percentiles, server
from tokenizers import Tokenizer

from kvfleet.engine import native
from kvfleet.engine.model.loader import default_model_path

# guidellm's own interpreter, on a launcher that fixes the start of its Poisson arrivals.
GUIDELLM = [str(ROOT / ".venv-guidellm" / "bin" / "python"),
            str(ROOT / "bench" / "guidellm_launch.py")]
SHARED_PREFIX_TOKENS, OWN_TOKENS = 900, 100


@dataclass
class Run:
    """One guidellm benchmark of one server: its requests as guidellm measured them."""

    duration: float
    ttft: list[float] = field(default_factory=list)  # seconds, successful requests
    tpot: list[float] = field(default_factory=list)
    # Every request sent in the window: its TTFT, or where no token came before the window
    # closed, how long it had waited (a lower bound). The TTFT percentiles come from these:
    # counting the finished requests alone counts, in a closed loop whose requests outlast half
    # the window, mostly the first wave, and of it the requests that started soonest.
    ttft_sent: list[float] = field(default_factory=list)
    completed: int = 0
    failed: int = 0
    unfinished: int = 0  # still running when the window closed (guidellm's "incomplete")
    output_tokens: int = 0  # delivered in the window, finished requests or not

    def goodput(self, slo_ttft: float, slo_tpot: float) -> float:
        good = sum(1 for t, p in zip(self.ttft, self.tpot, strict=True)
                   if t <= slo_ttft and p <= slo_tpot)
        return good / self.duration

    def summary(self, slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
        return {"completed": self.completed, "failed": self.failed,
                "unfinished": self.unfinished, "duration": self.duration,
                "output_tok_s": self.output_tokens / self.duration,
                "ttft": percentiles(self.ttft_sent), "tpot": percentiles(self.tpot),
                "goodput": self.goodput(slo_ttft, slo_tpot), "ttft_values": self.ttft_sent}


def runs_of(report: dict[str, Any]) -> list[Run]:
    runs = []
    for bench in report["benchmarks"]:
        requests = bench["requests"]
        run = Run(duration=float(bench["duration"]), failed=len(requests["errored"]))
        for r in requests["successful"]:
            run.completed += 1
            run.output_tokens += r["output_tokens"] or 0
            run.ttft.append(r["time_to_first_token_ms"] / 1e3)
            run.tpot.append((r["inter_token_latency_ms"] or 0.0) / 1e3)
        run.ttft_sent.extend(run.ttft)
        for r in requests["incomplete"]:
            run.output_tokens += r["output_tokens"] or 0
            first, start = r["time_to_first_token_ms"], r["request_start_time"]
            if first is not None:
                run.ttft_sent.append(first / 1e3)
            elif start is not None:  # sent, no token yet
                run.ttft_sent.append(max(0.0, bench["end_time"] - start))
        run.unfinished = len(requests["incomplete"])
        runs.append(run)
    return runs


class Guidellm:
    """Runs guidellm scenarios against a server, on prompt files written beforehand: guidellm's
    own synthetic prompts are made by a data worker that took 50-100 % of a core while the
    benchmark ran (measured with top), which on 2 cores slowed the server it measured by half
    (llama.cpp's 1k-token prefill: ~100 tok/s beside it, ~200 without)."""

    def __init__(self, workdir: Path, tokenizer: Path) -> None:
        self.workdir, self.tokenizer, self.count = workdir, tokenizer, 0

    def run(self, url: str, profile: dict[str, Any], dataset: Path,
            constraint: dict[str, Any], sweep: list[dict[str, Any]] | None = None) -> list[Run]:
        self.count += 1
        scenario = self.workdir / f"scenario-{self.count}.json"
        out = self.workdir / f"report-{self.count}.json"
        scenario.write_text(json.dumps({
            "spec": {"backend": {"kind": "openai_http", "target": url,
                                 "request_format": "/v1/completions"},
                     "profile": profile,
                     "tokenizer": {"kind": "huggingface_auto", "model": str(self.tokenizer)},
                     "data": [{"kind": "json_file", "path": str(dataset)}],
                     "constraints": [constraint],
                     "outputs": [{"kind": "json", "path": str(out)}]},
            **({"benchmarks": sweep} if sweep else {})}))
        done = subprocess.run([*GUIDELLM, "run", "--scenario", str(scenario),
                               "--disable-console-interactive"],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"guidellm failed on {url}:\n{done.stdout[-2000:]}"
                               f"{done.stderr[-2000:]}")
        return runs_of(json.loads(out.read_text()))


def tokenizer_dir(kvfleet_url: str, folder: Path) -> Path:
    """The served model's tokenizer as a folder AutoTokenizer loads (no hub look-up)."""
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_bytes(
        httpx.get(kvfleet_url + "/tokenizer.json", timeout=30).content)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


class Prompts:
    """Text prompts of about a given number of tokens: random ordinary-vocabulary tokens,
    decoded, so no two prompts share a prefix by accident; the same files go to both servers."""

    def __init__(self, tokenizer: Path, seed: int) -> None:
        self.tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
        self.rng = random.Random(seed)

    def text(self, num_tokens: int) -> tuple[str, int]:
        ids = [self.rng.randrange(*TOKEN_ID_RANGE) for _ in range(num_tokens)]
        # Decoding merges some tokens into others' pieces: cut the re-encoded text to size.
        again = self.tok.encode(self.tok.decode(ids), add_special_tokens=False).ids
        text = self.tok.decode(again[:num_tokens])
        return text, len(self.tok.encode(text, add_special_tokens=False).ids)

    def write(self, path: Path, lengths: Sequence[int], output_tokens: int,
              prefix_tokens: int = 0) -> Path:
        prefix = self.text(prefix_tokens)[0] if prefix_tokens else None
        with path.open("w") as f:
            for n in lengths:
                text, count = self.text(n)
                row: dict[str, Any] = {"prompt": text, "prompt_tokens_count": count,
                                       "output_tokens_count": output_tokens}
                if prefix is not None:
                    row["prefix"] = prefix
                f.write(json.dumps(row) + "\n")
        return path


def workloads(args: argparse.Namespace, prompts: Prompts, folder: Path
              ) -> list[tuple[str, dict[str, Any]]]:
    """(name, guidellm arguments) for every figure of the comparison."""
    out = args.output_tokens
    rng = random.Random(args.seed)
    # 32-256 tokens, log-uniform; more prompts than the busiest window can use.
    mixed = prompts.write(folder / "mixed.jsonl",
                          [round(math.exp(rng.uniform(math.log(32), math.log(256))))
                           for _ in range(args.num_prompts)], out)
    window = {"kind": "max_duration", "seconds": args.seconds}
    return [
        ("single_32", {"profile": {"kind": "synchronous"},
                       "data": prompts.write(folder / "single_32.jsonl", [32] * 5, out),
                       "constraint": {"kind": "max_requests", "count": 5}}),
        ("single_1000", {"profile": {"kind": "synchronous"},
                         "data": prompts.write(folder / "single_1000.jsonl", [1000] * 5, 16),
                         "constraint": {"kind": "max_requests", "count": 5}}),
        ("closed_loop", {"profile": {"kind": "concurrent", "streams": args.streams},
                         "data": mixed, "constraint": window,
                         "sweep": [{"profile.streams": s} for s in args.streams]}),
        ("poisson", {"profile": {"kind": "poisson", "rate": args.rates},
                     "data": mixed, "constraint": window,
                     "sweep": [{"profile.rate": r} for r in args.rates]}),
        ("shared_prefix", {"profile": {"kind": "synchronous"},
                           "data": prompts.write(folder / "shared_prefix.jsonl",
                                                 [OWN_TOKENS] * 12, 16, SHARED_PREFIX_TOKENS),
                           "constraint": {"kind": "max_requests", "count": 12}}),
    ]


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "n/a"


def report_lines(results: dict[str, dict[str, list[dict[str, Any]]]],
                 args: argparse.Namespace) -> list[str]:
    """The comparison as printed: each figure of each side and kvfleet / llama.cpp, for the
    workloads that ran (`--only` leaves the others out)."""
    names = list(results)
    lines: list[str] = []

    def ran(*keys: str) -> bool:
        return any(results[n].get(key) for n in names for key in keys)

    def row(label: str, key: str, index: int, pick: Any, unit: str, better: str) -> None:
        values = [pick(results[n][key][index]) if results[n].get(key) else math.nan
                  for n in names]
        cells = "  ".join(f"{n} {v:9.3f}" for n, v in zip(names, values, strict=True))
        rel = ratio(values[0], values[1]) if len(values) == 2 else ""
        lines.append(f"  {label:<34} {cells} {unit:<6} kvfleet/llama.cpp {rel} ({better})")

    if ran("single_32", "single_1000"):
        lines.append("== one stream")
        row("TTFT, 32-token cold prompt", "single_32", 0, lambda s: s["ttft"]["p50"], "s",
            "lower is better")
        row("decode (1 / TPOT p50)", "single_32", 0, lambda s: 1 / s["tpot"]["p50"], "tok/s",
            "higher is better")
        row("TTFT, 1,000-token cold prompt", "single_1000", 0, lambda s: s["ttft"]["p50"],
            "s", "lower is better")
    if ran("closed_loop"):
        lines.append("== closed loop")
        for i, streams in enumerate(args.streams):
            row(f"{streams:2d} streams: output", "closed_loop", i, lambda s: s["output_tok_s"],
                "tok/s", "higher is better")
            for stat in ("ttft", "tpot"):
                for p in ("p50", "p95"):
                    row(f"{streams:2d} streams: {stat.upper()} {p}", "closed_loop", i,
                        lambda s, stat=stat, p=p: s[stat][p], "s", "lower is better")
    if ran("poisson"):
        lines.append(f"== Poisson arrivals: goodput at TTFT <= {args.slo_ttft:g} s, "
                     f"TPOT <= {args.slo_tpot * 1e3:g} ms")
        for i, rate in enumerate(args.rates):
            row(f"{rate:g} req/s: goodput", "poisson", i, lambda s: s["goodput"], "req/s",
                "higher is better")
            row(f"{rate:g} req/s: output", "poisson", i, lambda s: s["output_tok_s"],
                "tok/s", "higher is better")
            # Sent = completed + failed + unfinished; about rate x window unless the client
            # fell behind its schedule and caught up in a burst (then the goodput says little).
            row(f"{rate:g} req/s: requests sent", "poisson", i,
                lambda s: s["completed"] + s["failed"] + s.get("unfinished", 0), "req",
                f"~{rate * args.seconds:.0f} expected")
            row(f"{rate:g} req/s: failed", "poisson", i, lambda s: s["failed"], "req",
                "lower is better")
    if ran("shared_prefix"):
        lines.append(f"== {SHARED_PREFIX_TOKENS + OWN_TOKENS}-token prompts, "
                     f"{SHARED_PREFIX_TOKENS} shared")
        row("TTFT p50 after the first", "shared_prefix", 0, lambda s: s["ttft"]["p50"], "s",
            "lower is better")
    return lines


def plot(results: dict[str, dict[str, list[dict[str, Any]]]], args: argparse.Namespace,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for name, res in results.items():
        loop = res.get("closed_loop", [])
        axes[0].plot(args.streams[:len(loop)], [s["output_tok_s"] for s in loop], "o-",
                     label=name)
        for streams, s in zip(args.streams, loop, strict=False):
            values = sorted(s["ttft_values"])
            if values:
                axes[1].plot(values, [(i + 1) / len(values) for i in range(len(values))],
                             label=f"{name}, {streams} streams",
                             linestyle="-" if name == "kvfleet" else "--")
        rates = res.get("poisson", [])
        axes[2].plot(args.rates[:len(rates)], [s["goodput"] for s in rates], "o-", label=name)
    axes[0].set(title="closed loop: output throughput", xlabel="concurrent streams",
                ylabel="output tokens/s", xscale="log", xticks=args.streams)
    axes[0].set_xticklabels([str(s) for s in args.streams])
    axes[1].set(title="closed loop: TTFT distribution", xlabel="TTFT (s)", ylabel="CDF",
                xscale="log")
    axes[2].set(title=f"Poisson arrivals: goodput (TTFT <= {args.slo_ttft:g} s, "
                      f"TPOT <= {args.slo_tpot * 1e3:g} ms)",
                xlabel="offered rate (req/s)", ylabel="good requests/s")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a panel of a workload not run stays empty
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save(results: dict[str, Any], args: argparse.Namespace, lines: list[str] | None = None
         ) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
         "results": results, "report": lines or []}, indent=1))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    def ints(value: str) -> list[int]:
        return [int(v) for v in value.split(",")]

    def floats(value: str) -> list[float]:
        return [float(v) for v in value.split(",")]

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=ints, default=[1, 4, 16, 32])
    p.add_argument("--rates", type=floats, default=[0.25, 0.5, 1.0, 2.0])
    p.add_argument("--seconds", type=float, default=40.0, help="window of each loaded point")
    p.add_argument("--output-tokens", type=int, default=96)
    p.add_argument("--slo-ttft", type=float, default=1.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--num-prompts", type=int, default=600,
                   help="prompts in the closed-loop and Poisson file (each window starts over)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated workload names to run")
    p.add_argument("--int8-activations", action="store_true",
                   help="kvfleet serve --int8-activations (llama.cpp's numerics at 1-2 rows)")
    p.add_argument("--int16-activations", action="store_true",
                   help="kvfleet serve --int16-activations (4-bit matmuls in integers)")
    p.add_argument("--cpu-level", choices=sorted(llama_server.LEVELS), default="native",
                   help="ISA level of both servers: the host's widest (native), or x86_64_v3 "
                        "(AVX2 builds of both, which an AVX-512 host runs too)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "vs_llama_cpp")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_level != "native":
        # kvfleet serve inherits the level through the environment; checked here, so a CPU
        # that cannot run it stops the run before anything starts.
        os.environ[native.TARGET_ENV] = args.cpu_level
        try:
            native.cpu_target()
        except native.KernelTargetError as exc:
            print(f"--cpu-level {args.cpu_level}: {exc}", file=sys.stderr)
            return 2
    subprocess.run([str(ROOT / "scripts" / "guidellm-env.sh")], check=True)
    gguf = default_model_path()
    max_seqs = max(args.streams)
    commands = {"kvfleet": (["-m", "kvfleet", "serve", "--max-num-seqs", str(max_seqs),
                             *(["--int8-activations"] if args.int8_activations else []),
                             *(["--int16-activations"] if args.int16_activations else [])],
                            "/ready")}
    try:
        binary = llama_server.build(args.cpu_level)
        commands["llama.cpp"] = (llama_server.server_argv(
            binary, gguf, args.threads, parallel=max_seqs,
            ctx_per_slot=SHARED_PREFIX_TOKENS + OWN_TOKENS + 2 * args.output_tokens),
            "/health")
    except llama_server.BuildUnavailable as exc:
        print(f"[llama.cpp] skipped, kvfleet measured alone: {exc}", flush=True)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in commands}
    print(f"CPU: {native.cpu_identity()}, {os.cpu_count()} cores; level {args.cpu_level}; "
          f"{args.threads} threads per server; model {gguf.name}", flush=True)
    with tempfile.TemporaryDirectory(prefix="vs-llama-cpp-") as tmp, ExitStack() as stack:
        urls = {name: stack.enter_context(server(argv, name, args.threads, ready_path=ready))
                for name, (argv, ready) in commands.items()}
        tokenizer = tokenizer_dir(urls["kvfleet"], Path(tmp) / "tokenizer")
        guidellm = Guidellm(Path(tmp), tokenizer)
        chosen = [w for w in workloads(args, Prompts(tokenizer, args.seed), Path(tmp))
                  if not args.only or w[0] in args.only.split(",")]
        for index, (name, spec) in enumerate(chosen):
            for side in list(urls) if index % 2 == 0 else list(reversed(urls)):
                print(f"[{name}] {side} ...", flush=True)
                runs = guidellm.run(urls[side], spec["profile"], spec["data"],
                                    spec["constraint"], spec.get("sweep"))
                results[side][name] = [r.summary(args.slo_ttft, args.slo_tpot) for r in runs]
                save(results, args)  # a run that fails later keeps what it measured
    lines = report_lines(results, args)
    print("\n".join(lines), flush=True)
    save(results, args, lines)
    plot(results, args, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
