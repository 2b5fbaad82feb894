"""KV cache and weight dtypes, and 8- and 16-bit activations, on the embedded SmolLM2: greedy
agreement with float32.

    .venv/bin/python bench/kv_dtype.py

The same 8 prompts, 48 greedy tokens each (eos ignored), through `LLM` with a float32 model
and cache, then a bfloat16 and a float16 KV cache, then bfloat16 weights and cache (a GPU's
default), then `int8_activations` (each prompt alone, so every decode step has the one row
that path serves; the time is then not comparable with the batches'), then
`int16_activations` (the prompts batched, like the others). Printed per setting:
the wall time, how many continuations are token-identical to float32's, the mean share of
positions that agree, and where each first differs.
"""

from __future__ import annotations

import time

from kvfleet.engine.llm import LLM
from kvfleet.engine.request import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Kubernetes operators watch",
           "Once upon a time,", "1, 2, 3, 4,", "The GPU is a", "Write a haiku about rain.",
           "SQL joins are"]
SETTINGS: dict[str, dict[str, str | bool]] = {
    "float32": {}, "kv-bfloat16": {"kv_cache_dtype": "bfloat16"},
    "kv-float16": {"kv_cache_dtype": "float16"}, "weights+kv-bfloat16": {"dtype": "bfloat16"},
    "int8-activations": {"int8_activations": True},
    "int16-activations": {"int16_activations": True},
}


def main() -> int:
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    results: dict[str, list[list[int]]] = {}
    for name, options in SETTINGS.items():
        llm = LLM(show_progress=False, **options)  # type: ignore[arg-type]
        started = time.perf_counter()
        outputs = ([llm.generate([p], greedy, use_tqdm=False)[0] for p in PROMPTS]
                   if options.get("int8_activations") else
                   llm.generate(PROMPTS, greedy, use_tqdm=False))
        took = time.perf_counter() - started
        results[name] = [list(o.token_ids) for o in outputs]
        base = results["float32"]
        identical = sum(a == b for a, b in zip(base, results[name], strict=True))
        agreement = sum(sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
                        for a, b in zip(base, results[name], strict=True)) / len(base)
        first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                 for a, b in zip(base, results[name], strict=True)]
        print(f"{name:22s} {took:5.2f} s  identical {identical}/{len(PROMPTS)}  "
              f"positional agreement {agreement:.3f}  first difference {first}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
