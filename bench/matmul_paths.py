"""Weight-matmul paths side by side, on every ISA level this CPU runs.

    .venv/bin/python bench/matmul_paths.py [--targets x86_64_v3,generic] [--threads N]

For each level (a subprocess with KVFLEET_CPU_TARGET set, so each builds and runs that level's
kernels), the 4-bit/8-bit kernel (`quant`), MKL-packed float32 (`mkl`) and `torch.mm` are timed
on the embedded SmolLM2's real weights (each distinct weight shape, the paths taking turns) at
the row counts the engine's path choice times (`kvfleet.engine.matmul_plan`). Prints, per level,
the per-shape table the engine would log, then one forward pass's weight matmuls (every layer
and the LM head) per path and row count, as milliseconds and as a ratio to `torch.mm` in the
same run, with `plan` = the measured choice per shape (what the engine runs).
"""

from __future__ import annotations

import sys
from collections import Counter

import isa_levels


def child(threads: int | None) -> None:
    import torch

    from kvfleet.engine import native
    from kvfleet.engine.matmul_plan import measure
    from kvfleet.engine.model import load_model
    from kvfleet.engine.packed_matmul import load_packer, load_quant_kernel

    if threads:
        torch.set_num_threads(threads)
    model = load_model(None, show_progress=False).model
    samples = model.weight_samples()
    # How many weights of each shape one forward pass multiplies by.
    uses = Counter(model.layer_shape(layer, index).key
                   for layer in range(model.config.num_layers) for index in range(4))
    uses[model._lm_head_sample().shape.key] += 1
    packer, quant = load_packer(), load_quant_kernel()

    def timed(key: str) -> bool:
        print(f"  timed {key}", file=sys.stderr, flush=True)
        return True  # time every shape

    plan = measure(samples, packer, quant, timed)
    print(plan.table(), file=sys.stderr, flush=True)
    result = {"target": native.cpu_target()[0], "threads": torch.get_num_threads(),
              "uses": dict(uses), "timings": plan.timings,
              "choices": {k: [c.max_rows, c.paths] for k, c in plan.choices.items()}}
    print(isa_levels.result_line(result))


def forward_pass(result: dict) -> dict[int, dict[str, float]]:
    """Seconds of one forward pass's weight matmuls per row count and path (+ "plan")."""
    totals: dict[int, dict[str, float]] = {}
    for key, timings in result["timings"].items():
        uses = result["uses"][key]
        limits, paths = result["choices"][key]
        for rows_text, by_path in timings.items():
            rows = int(rows_text)
            chosen = next((p for limit, p in zip(limits, paths, strict=True) if rows <= limit),
                          paths[-1])
            row = totals.setdefault(rows, {})
            for path, seconds in [*by_path.items(), ("plan", by_path[chosen])]:
                row[path] = row.get(path, 0.0) + uses * seconds
    # Row counts the LM head was not timed at leave it out of every path alike.
    return totals


def main() -> int:
    args = isa_levels.parser(__doc__).parse_args()
    if args.child:
        child(args.threads)
        return 0
    for target in isa_levels.targets(args):
        print(f"\n== {target}", flush=True)
        result = isa_levels.run_child(__file__, target, args.threads)
        if result is None:
            continue
        print(f"one forward pass's weight matmuls, {result['threads']} threads "
              "(ms; ratio to torch.mm in this run):")
        for rows, by_path in sorted(forward_pass(result).items()):
            torch_s = by_path["torch"]
            cells = "  ".join(f"{p} {by_path[p] * 1e3:8.2f} ({by_path[p] / torch_s:4.2f}x)"
                              for p in ("quant", "mkl", "torch", "plan") if p in by_path)
            print(f"  {rows:5d} rows: {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
