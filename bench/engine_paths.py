"""The engine's compute paths side by side, on every ISA level this CPU runs.

    .venv/bin/python bench/engine_paths.py [--targets x86_64_v3,generic] [--threads N]

The workload of the AVX2 report that started this benchmark: the embedded SmolLM2, prefix
cache off, `LLM.generate` in one process per setting: a cold 158-token prompt for one output
token (prefill), then 1 and 16 sequences x 96 tokens (decode, eos ignored). Settings, each a
fresh process with `KVFLEET_CPU_TARGET` set to the level:

- `default`: what the engine runs (weight-matmul paths chosen by measurement, the attention
  kernel, the fused ops);
- `KVFLEET_MATMUL=mkl` / `=torch`: weights on MKL-packed float32 / `torch.mm` only;
- `KVFLEET_ATTENTION=sdpa`: torch's SDPA instead of the attention kernel;
- `KVFLEET_FUSED_OPS=torch`: torch's ops instead of the fused norms, RoPE and SiLU.

Prints each figure and its ratio to `default` in the same run (above 1.00x: that setting is
faster than the default, so the default is not choosing well). A setting's first start on a
level builds its kernels (and times the matmul paths) before anything is measured.
"""

from __future__ import annotations

import time

import isa_levels

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "matmul=mkl": {"KVFLEET_MATMUL": "mkl"},
    "matmul=torch": {"KVFLEET_MATMUL": "torch"},
    "attention=sdpa": {"KVFLEET_ATTENTION": "sdpa"},
    "fused_ops=torch": {"KVFLEET_FUSED_OPS": "torch"},
}
PROMPT_TOKENS = 158
OUTPUT_TOKENS = 96


def child(threads: int | None) -> None:
    import torch

    from kvfleet.engine.llm import LLM
    from kvfleet.engine.request import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(enable_prefix_caching=False, show_progress=False)
    vocab = llm.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return torch.randint(100, vocab - 100, (n, length), generator=gen).tolist()

    def run(ids: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
        return time.perf_counter() - started

    run(prompts(2, 32), 4)  # warm up
    prefill = min(run(prompts(1, PROMPT_TOKENS), 1) for _ in range(3))
    result = {"prefill_ms": prefill * 1e3}
    for n in (1, 16):
        # Decode rate: the tokens after the first over the time after a 1-token run's.
        ids = prompts(n, 32)
        first = run(ids, 1)
        total = run(ids, OUTPUT_TOKENS)
        result[f"decode_{n}_tok_s"] = n * (OUTPUT_TOKENS - 1) / max(total - first, 1e-9)
    print(isa_levels.result_line(result))


def main() -> int:
    parser = isa_levels.parser(__doc__)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    if args.child:
        child(args.threads)
        return 0
    for target in isa_levels.targets(args):
        print(f"\n== {target}: cold prefill of {PROMPT_TOKENS} tokens (ms, lower is better); "
              f"decode of {OUTPUT_TOKENS} tokens (tok/s, higher is better)", flush=True)
        results: dict[str, dict[str, float]] = {}
        for name in args.settings.split(","):
            result = isa_levels.run_child(__file__, target, args.threads, SETTINGS[name])
            if result is None:
                continue
            results[name] = result
            base = results.get("default", results[name])
            r = results[name]
            print(f"  {name:16s} prefill {r['prefill_ms']:8.1f} ms "
                  f"({base['prefill_ms'] / r['prefill_ms']:4.2f}x)   "
                  f"decode x1 {r['decode_1_tok_s']:6.1f} tok/s "
                  f"({r['decode_1_tok_s'] / base['decode_1_tok_s']:4.2f}x)   "
                  f"decode x16 {r['decode_16_tok_s']:6.1f} tok/s "
                  f"({r['decode_16_tok_s'] / base['decode_16_tok_s']:4.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
