"""`kvfleet generate`: offline generation from the command line (the README's `make run`).

    kvfleet generate "Write a haiku about Kubernetes."
    kvfleet generate --chat --max-tokens 64 "What is a ServingPool?" "And a Rollout?"

Each prompt's completion is printed in order; model-load and generation progress go to
stderr, so stdout carries only the completions.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvfleet.engine.errors import KvfleetEngineError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate", help="generate completions with the engine (offline, no server)",
        description="Generate completions for PROMPTs with the kvfleet engine.")
    p.add_argument("prompts", nargs="*", metavar="PROMPT",
                   help="prompt text (default: read one prompt from stdin)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a .gguf file or HF Llama checkpoint directory "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=128, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message in the model's chat template")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    p.add_argument("--batch-invariant", action="store_true",
                   help="output bits independent of the other prompts in the batch")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfleet.engine.request import SamplingParams

    try:
        # Validate the flags before importing torch and loading the model: fail fast.
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop=tuple(args.stop))
        prompts: list[str] = list(args.prompts) or [sys.stdin.read()]
        from kvfleet.engine.llm import LLM

        llm = LLM(args.model, batch_invariant=args.batch_invariant,
                  show_progress=not args.no_progress)
        inputs: list[Any] = ([[{"role": "user", "content": p}] for p in prompts] if args.chat
                             else prompts)
        outputs = llm.generate(inputs, params, use_tqdm=not args.no_progress)
    except KvfleetEngineError as exc:
        print(f"kvfleet generate: {exc}", file=sys.stderr)
        return 2
    for i, output in enumerate(outputs):
        if len(outputs) > 1:
            print(f"--- [{i}] finish_reason={output.finish_reason}")
        print(output.text.strip() if args.chat else output.text)
    return 0
