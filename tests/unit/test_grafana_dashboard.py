"""The chart's Grafana dashboard asks only for series the code exports, in valid PromQL
(checked by the pinned promtool when the e2e tools are built). Its queries also run against
the real Prometheus in the rollout e2e test."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY as OPERATOR_REGISTRY
from prometheus_client import CollectorRegistry

import kvfleet.operator.metrics  # noqa: F401 (its metrics register in the default registry)
from kvfleet.devcluster import toolchain
from kvfleet.devcluster.errors import ToolsMissingError
from kvfleet.devcluster.grafana import queries
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.router.metrics import RouterMetrics

SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _series(registry: CollectorRegistry) -> set[str]:
    """The series names a registry exposes (a histogram's _bucket/_sum/_count and so on)."""
    return {family.name + suffix for family in registry.collect()
            for suffix in SUFFIXES.get(family.type, ("",))}


def test_every_query_names_a_series_the_code_exports() -> None:
    exported = (_series(EngineMetrics("m", "r").registry) | _series(RouterMetrics().registry)
                | _series(OPERATOR_REGISTRY))
    found = queries()
    assert len(found) >= 20
    for query in found:
        assert query.metrics(), f"panel {query.panel!r} queries no kvfleet series"
        unknown = query.metrics() - exported
        assert not unknown, f"panel {query.panel!r} asks for {sorted(unknown)}, not exported"
    # Each component is on the board: the router, the engines, the rollouts.
    names = set().union(*(q.metrics() for q in found))
    for prefix in ("kvfleet_router_", "kvfleet_engine_", "kvfleet_operator_rollout_"):
        assert any(n.startswith(prefix) for n in names), prefix


@pytest.mark.tools
def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    try:
        promtool = toolchain.locate()["promtool"]
    except ToolsMissingError as exc:
        pytest.skip(f"promtool not built: {exc}")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": q.expr} for i, q in enumerate(queries())]}]}
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run([str(promtool), "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
