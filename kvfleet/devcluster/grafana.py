"""The chart's Grafana dashboard (helm/kvfleet/dashboards/kvfleet.json) as PromQL a test can
run: every panel query with the dashboard's variables given values."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "kvfleet" / "dashboards" / \
    "kvfleet.json"
# Series names as Prometheus stores them: kvfleet_*, and the vLLM-compatible vllm:* gauges.
METRIC_NAME = re.compile(r"\b(kvfleet_[a-z0-9_]+|vllm:[a-z_]+)\b")
# What holds label names, not series names: selectors and grouping clauses.
LABEL_PARTS = re.compile(r"\{[^}]*\}|\b(?:by|without)\s*\([^)]*\)")


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    expr: str

    def metrics(self) -> set[str]:
        return set(METRIC_NAME.findall(LABEL_PARTS.sub(" ", self.expr)))


def queries(pool: str = ".*", rate_interval: str = "1m", namespace: str = ".*"
            ) -> list[PanelQuery]:
    """Each panel's queries, `$namespace`, `$pool` and `$__rate_interval` replaced as Grafana
    would."""
    board = json.loads(DASHBOARD.read_text())
    found: list[PanelQuery] = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", rate_interval)
            expr = expr.replace("$namespace", namespace)
            found.append(PanelQuery(panel["title"], expr.replace("$pool", pool)))
    return found
