"""The `kvfleet` command line.

Each area registers its subcommands from its own module under `kvfleet.commands`, so this file
only assembles them. A command module exposes `register(subparsers)`; the parser it adds sets
`func`, which receives the parsed namespace and returns the process exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvfleet import __version__

# Modules under kvfleet.commands, in the order their commands appear in --help.
COMMAND_MODULES: tuple[str, ...] = (
    "engine",
    "kernels",
    "devcluster",
    "operator",
    "serve",
    "router",
    "rollout",
    "artifact", "check", "capacity", "crds", "webhook",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfleet",
        description="LLM serving fleets on Kubernetes: engine, operator, admission and tools.",
    )
    parser.add_argument("--version", action="version", version=f"kvfleet {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"kvfleet.commands.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    code: int = func(args)
    return code
