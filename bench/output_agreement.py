"""How much greedy answers agree: two replicas of the same artifact batched differently, with
and without `batch_invariant`, and a same-shaped perturbed artifact (one norm tensor scaled).
This sets the default threshold of the Rollout's `OutputAgreement` gate.

    .venv/bin/python bench/output_agreement.py [--probes 48] [--max-tokens 32]

Each prompt is answered greedily (the router's probe: `temperature: 0`, capped tokens) once
alone (one replica, batch of 1) and once batched with all the others (the other replica under
load). A probe's score is its common prefix over the longer answer (`kvfleet.router.probes
.agreement`); a window's score is the sum over its probes. Printed per setting: the mean, and
the lowest and 5th percentile of the score over 2,000 windows of `--window` probes drawn from
the prompts (the spread a rollout's analysis windows would see).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from kvfleet.api.gguf_artifact import embedded_gguf_path
from kvfleet.devcluster.demo import ASKS, TOPICS
from kvfleet.devcluster.perturb import DEFAULT_SCALE, DEFAULT_TENSOR, scale_norm
from kvfleet.engine.llm import LLM
from kvfleet.engine.request import SamplingParams
from kvfleet.router.probes import agreement


def prompts(count: int) -> list[list[dict[str, str]]]:
    """The demo traffic's chats (kvfleet.devcluster.demo), each once."""
    texts = [ask.format(topic) for ask in ASKS for topic in TOPICS]
    return [[{"role": "user", "content": text}] for text in texts[:count]]


def answers(llm: LLM, chats: list[list[dict[str, str]]], greedy: SamplingParams,
            batched: bool) -> list[tuple[int, ...]]:
    if batched:
        return [o.token_ids for o in llm.generate(chats, greedy, use_tqdm=False)]
    return [llm.generate([chat], greedy, use_tqdm=False)[0].token_ids for chat in chats]


def windows(pairs: list[tuple[int, int]], size: int, rng: random.Random) -> list[float]:
    scores = []
    for _ in range(2000):
        sample = rng.sample(pairs, min(size, len(pairs)))
        compared = sum(c for _, c in sample)
        scores.append(sum(a for a, _ in sample) / compared if compared else 1.0)
    return sorted(scores)


def report(name: str, left: list[tuple[int, ...]], right: list[tuple[int, ...]],
           size: int) -> None:
    pairs = [agreement(a, b) for a, b in zip(left, right, strict=True)]
    scores = windows(pairs, size, random.Random(0))
    identical = sum(a == c for a, c in pairs)
    mean = sum(a for a, _ in pairs) / max(1, sum(c for _, c in pairs))
    print(f"{name:<44} mean {mean:.3f}  min {scores[0]:.3f}  p5 "
          f"{scores[len(scores) // 20]:.3f}  identical probes {identical}/{len(pairs)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--window", type=int, default=20, help="probes per analysis window")
    parser.add_argument("--scales", default=f"{DEFAULT_SCALE},1.1,0.9")
    args = parser.parse_args()
    chats = prompts(args.probes)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print(f"{len(chats)} probes, {args.max_tokens} greedy tokens, windows of {args.window}",
          flush=True)
    started = time.perf_counter()
    runs: dict[str, list[tuple[int, ...]]] = {}
    for invariant in (False, True):
        llm = LLM(show_progress=False, batch_invariant=invariant)
        for batched in (False, True):
            runs[f"invariant={invariant} batched={batched}"] = answers(llm, chats, greedy,
                                                                       batched)
            print(f"  answered: invariant={invariant} batched={batched} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    report("same artifact, alone vs batched", runs["invariant=False batched=False"],
           runs["invariant=False batched=True"], args.window)
    report("same artifact, batch-invariant, alone vs batched",
           runs["invariant=True batched=False"], runs["invariant=True batched=True"],
           args.window)
    report("same artifact, invariant vs not (batched)", runs["invariant=True batched=True"],
           runs["invariant=False batched=True"], args.window)
    with tempfile.TemporaryDirectory() as folder:
        for scale in (float(s) for s in args.scales.split(",")):
            path = scale_norm(embedded_gguf_path(), Path(folder) / f"x{scale}.gguf",
                              DEFAULT_TENSOR, scale)
            perturbed = answers(LLM(path, show_progress=False), chats, greedy, batched=True)
            report(f"{DEFAULT_TENSOR} x{scale} vs original (batched)", perturbed,
                   runs["invariant=False batched=False"], args.window)
            path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
