"""Every package the code imports is declared in pyproject.toml, not only present because
another dependency pulled it in (aiohttp once came only through kopf)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_top_level_modules() -> dict[str, str]:
    """Top-level module -> one file importing it, over the kvfleet package."""
    found: dict[str, str] = {}
    for path in (ROOT / "kvfleet").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and \
                node.level == 0 else []
            for name in names:
                found.setdefault(name.partition(".")[0], str(path.relative_to(ROOT)))
    return found


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_package_is_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_normalise(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0])
                for d in project["dependencies"]}
    distributions = packages_distributions()
    missing = {}
    for module, where in _imported_top_level_modules().items():
        if module == "kvfleet" or module in sys.stdlib_module_names:
            continue
        owners = {_normalise(d) for d in distributions.get(module, [])}
        assert owners, f"{module} (imported by {where}) is not installed"
        if not owners & declared:
            missing[module] = (sorted(owners), where)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
