"""The suite's budget at a glance: each tier's wall time and the slowest tests of the run.

    python scripts/suite_report.py TIERS.tsv REPORT.xml...

TIERS.tsv has one `name<TAB>seconds<TAB>exit code` line per tier (scripts/test.sh writes it);
each REPORT.xml is a pytest `--junitxml` file. A test's time there is its setup, call and
teardown together, so the first test of a module also carries the module's fixtures (a cluster
start, a model load): the cost that moving or sharing the test would change. The last line is
the plain `suite: N passed, N failed, N skipped` over every tier. Standard library only.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SLOWEST = 15
BUDGET_WARM_S = 45 * 60  # `make test` with the tools cached, on 2 cores (README)


def _tests(report: Path) -> list[tuple[float, str, str]]:
    """(seconds, test id, outcome) of every test case in a junit file."""
    cases = []
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append((float(case.get("time") or 0), name, outcome))
    return cases


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    tiers_file, reports = Path(argv[0]), [Path(p) for p in argv[1:] if Path(p).is_file()]
    print("\n== suite budget")
    total = None
    for line in tiers_file.read_text().splitlines():
        name, seconds, rc = line.split("\t")
        mark = "" if rc == "0" else f"  (exit {rc})"
        print(f"{name:>20s}  {int(seconds) / 60:6.1f} min{mark}")
        if name == "whole suite":
            total = int(seconds)
    if total is not None:
        print(f"{'':>20s}  budget with the tools cached: {BUDGET_WARM_S / 60:.0f} min")
    cases = [case for report in reports for case in _tests(report)]
    print(f"\n== the {SLOWEST} slowest tests (setup + call + teardown)")
    for seconds, name, outcome in sorted(cases, reverse=True)[:SLOWEST]:
        print(f"{seconds:8.1f} s  {name}{'' if outcome == 'passed' else f'  [{outcome}]'}")
    counts = {k: sum(1 for c in cases if c[2] == k) for k in ("passed", "failed", "skipped")}
    print(f"suite: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
