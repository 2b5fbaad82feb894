"""Where a decode step's time goes: each weight matmul, the LM head, attention, the fused
elementwise ops, and the rest (Python glue, scheduling, sampling), per step.

    .venv/bin/python bench/step_breakdown.py [--running 1,8,32] [--prompt 300] [--steps 30]
        [--threads 2]

For each count of running requests, an engine core (the default settings: packed weights,
the compiled kernels) is given that many greedy requests with random --prompt-token prompts,
stepped until every prompt is prefilled and a few tokens decoded, and then --steps pure decode
steps are timed, every part wrapped in a timer (a few microseconds a call, ~300 calls a step).
Attention includes writing the step's K/V into the cache. The parts run one after another on
the engine thread, so they add up to the step.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from kvfleet.engine import model_runner
from kvfleet.engine.config import CacheConfig, SchedulerConfig
from kvfleet.engine.engine import build_engine_core
from kvfleet.engine.model.loader import LoadedModel, load_model
from kvfleet.engine.request import Request, SamplingParams

MATMULS = ("qkv", "o_proj", "gate_up", "down")


class Timers:
    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
        return timed


class _Timed:
    """A weight (or the fused-ops module) whose methods go through the timers."""

    def __init__(self, inner: Any, timers: Timers, prefix: str) -> None:
        self._inner, self._timers, self._prefix = inner, timers, prefix

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr
        label = self._prefix if self._prefix in MATMULS or self._prefix == "lm_head" else (
            f"{self._prefix}.{name}")
        return self._timers.wrap(label, attr)


def instrument(loaded: LoadedModel, timers: Timers) -> Callable[[], None]:
    """Wraps the model's parts in timers; returns what undoes the class-level one."""
    model: Any = loaded.model
    if model._packed is None:
        raise SystemExit("the weights are not packed here (no compiled kernel?): nothing to "
                         "break down")
    model._packed = [tuple(_Timed(w, timers, MATMULS[i]) for i, w in enumerate(layer))
                     for layer in model._packed]
    if model._lm_head_packed is not None:
        model._lm_head_packed = _Timed(model._lm_head_packed, timers, "lm_head")
    if model._fused is not None:
        model._fused = _Timed(model._fused, timers, "fused")
    attention: Any = model_runner._PagedAttention
    original = attention.__call__
    attention.__call__ = timers.wrap("attention", original)

    def undo() -> None:
        attention.__call__ = original
    return undo


def measure(loaded: LoadedModel, running: int, prompt: int, steps: int) -> None:
    max_tokens = steps + 64
    # A pool that holds every request to its last token: the default 512 MiB holds ~31 of 370
    # float32 tokens, and a request preempted or left waiting would make a step look cheap.
    block_size = CacheConfig().block_size
    cache = CacheConfig(num_blocks=running * -(-(prompt + max_tokens) // block_size) + 16)
    core = build_engine_core(loaded, cache, SchedulerConfig(max_num_running=running))
    rng = random.Random(running)
    vocab = loaded.model.config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [Request(f"r{i}", [rng.randrange(vocab) for _ in range(prompt)],
                        sampling_params=params) for i in range(running)]
    for request in requests:
        core.add_request(request)
    while not all(r.num_output_tokens >= 4 for r in requests):
        core.step()
    timers = Timers()
    undo = instrument(loaded, timers)
    try:
        before = sum(r.num_output_tokens for r in requests)
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        step = (time.perf_counter() - start) / steps
        generated = sum(r.num_output_tokens for r in requests) - before
    finally:
        undo()
    if generated != running * steps:
        raise SystemExit(f"{running} running: {generated} tokens in {steps} steps, not "
                         f"{running * steps}: not every request ran every step")
    context = sum(r.num_tokens for r in requests) / running
    print(f"{running} running, mean context {context:.0f}: step {step * 1e3:.2f} ms "
          f"({running / step:.1f} tok/s)")
    timed = sum(timers.seconds.values()) / steps
    for name, seconds in timers.seconds.most_common():
        print(f"  {name:24s} {seconds / steps * 1e3:7.2f} ms  ({timers.calls[name] // steps} "
              "calls)")
    print(f"  {'the rest (glue, schedule, sample)':24s} {(step - timed) * 1e3:7.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", default="1,8,32",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for running in args.running:
        # A fresh model per count: instrumenting wraps its weights in place.
        measure(load_model(None, show_progress=False), running, args.prompt, args.steps)


if __name__ == "__main__":
    main()
