"""`kvfleet crds generate [--check]`: write crds/ from kvfleet.api (or verify it is current)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvfleet.api.crdgen import stale_crds, write_crds

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "crds"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("crds", help="CustomResourceDefinitions of the four kinds")
    sub = parser.add_subparsers(dest="crds_command", metavar="ACTION", required=True)
    generate = sub.add_parser("generate", help="regenerate the CRD YAML from the models")
    generate.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="output folder")
    generate.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a file is stale"
    )
    generate.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    if args.check:
        stale = stale_crds(args.dir)
        for name in stale:
            print(f"stale: {args.dir / name}", file=sys.stderr)
        if stale:
            print("run `kvfleet crds generate` and commit the result", file=sys.stderr)
        return 1 if stale else 0
    for path in write_crds(args.dir):
        print(path)
    return 0
