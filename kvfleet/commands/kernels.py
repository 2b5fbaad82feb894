"""`kvfleet kernels build|list`: the engine's compiled kernels, built ahead of time.

    kvfleet kernels build                  # every kernel for the level this CPU runs
    kvfleet kernels build --all-targets    # ... for every level the engine ships (the image)
    kvfleet kernels list                   # what is built, per kernel and level

Kernels are cached by a digest of their sources and the ISA level (see
`kvfleet.engine.native`, `$KVFLEET_KERNEL_CACHE`), so an engine start that finds them built
loads them without a compiler. Building a level this CPU cannot run only compiles it. The
kernels compile side by side, one per core.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "kernels", help="build or list the engine's compiled kernels", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = actions.add_parser("build", help="build the kernels (once per source and level)")
    build.add_argument("--all-targets", action="store_true",
                       help="every level the engine ships, not only this CPU's")
    build.set_defaults(func=_build)
    listing = actions.add_parser("list", help="which kernels are built, per level")
    listing.set_defaults(func=_list)


def _targets(all_targets: bool) -> list[str]:
    from kvfleet.engine import native

    return list(native.TARGETS) if all_targets else [native.cpu_target()[0]]


def _build(args: argparse.Namespace) -> int:
    from kvfleet.engine import native

    runnable = set(native.supported_targets())
    jobs = [(stem, target) for target in _targets(args.all_targets) for stem in native.STEMS]
    # Each kernel is one C++ file compiled by one compiler process, so building them one after
    # another leaves every core but one idle: four kernels took ~4 min in a row on a 2-core
    # Zen 3. The compiles run in ninja subprocesses; threads only wait on them.
    workers = max(1, min(len(jobs), len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda job: _build_one(*job, load=job[1] in runnable), jobs))
    return 0 if all(results) else 1


def _build_one(stem: str, target: str, *, load: bool) -> bool:
    """Builds one kernel unless it is built, saying what it does; False when it failed."""
    from kvfleet.engine import native

    started = time.monotonic()
    name = native.build_name(stem, target)
    if not (native.cache_root() / name / "complete").exists():
        print(f"kernels: building {stem} for {target} (new sources or a new machine: "
              "about a minute on one core) ...", file=sys.stderr, flush=True)
    try:
        native.compile_library(stem, target, load=load)
    except Exception as exc:  # report every failure, then exit non-zero
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        print(f"kernels: {stem} for {target} failed: {type(exc).__name__}: {last}",
              file=sys.stderr, flush=True)
        return False
    print(f"kernels: {stem} for {target} ready in {time.monotonic() - started:.1f} s "
          f"in {native.cache_root() / name}", file=sys.stderr, flush=True)
    return True


def _list(args: argparse.Namespace) -> int:
    from kvfleet.engine import native

    print(f"cache: {native.cache_root()}; this CPU ({native.cpu_identity()}) runs "
          f"{', '.join(native.supported_targets())}")
    for target in native.TARGETS:
        for stem in native.STEMS:
            name = native.build_name(stem, target)
            state = "built" if (native.cache_root() / name / "complete").exists() else "missing"
            print(f"{target:10s} {stem:16s} {state:8s} {name}")
    return 0
