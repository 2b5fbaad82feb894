"""What the per-ISA-level benchmarks share: their command line, and one child process per
level (and setting) that builds and runs that level's kernels and prints `RESULT <json>`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any


def parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default=None,
                   help="comma-separated levels (default: every level this CPU runs)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def targets(args: argparse.Namespace) -> list[str]:
    from kvfleet.engine import native

    print(f"CPU: {native.cpu_identity()}; levels it runs: {', '.join(native.supported_targets())}")
    return args.targets.split(",") if args.targets else native.supported_targets()


def run_child(script: str, target: str, threads: int | None,
              env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """`script --child` at ISA level `target`; its RESULT, or None (said) if it failed."""
    from kvfleet.engine import native

    cmd = [sys.executable, script, "--child"] + (["--threads", str(threads)] if threads else [])
    full_env = dict(os.environ, **{native.TARGET_ENV: target}, **(env or {}))
    done = subprocess.run(cmd, env=full_env, stdout=subprocess.PIPE, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(f"  {target}: the measurement failed (exit {done.returncode})")
        return None
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    return result


def result_line(result: dict[str, Any]) -> str:
    return "RESULT " + json.dumps(result)
