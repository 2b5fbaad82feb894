"""Argo CD's verdict on live kvfleet objects, asserted in the e2e scenarios.

`ArgoHealth.expect(obj, "Degraded", fixture="rolled-back")` asks Argo CD's own code (the
pinned argocd binary with the chart's argocd-cm patch) for the health of an object as the
apiserver returned it, and asserts the status. With KVFLEET_CAPTURE_ARGOCD_FIXTURES=1 the
object is also written to helm/kvfleet/argocd/kvfleet.io/<Kind>/testdata/<fixture>.yaml: the
fixtures the health_test.yaml files list are real objects captured this way, in each state.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from kvfleet.devcluster.argocd import CUSTOMIZATIONS, ArgoCDSettings, Health

CAPTURE_ENV = "KVFLEET_CAPTURE_ARGOCD_FIXTURES"


def fixture_object(obj: dict[str, Any]) -> dict[str, Any]:
    """The object without what only clutters a fixture (managed fields, last-applied)."""
    clean = dict(obj)
    meta = {k: v for k, v in obj.get("metadata", {}).items() if k != "managedFields"}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items()
                   if k != "kubectl.kubernetes.io/last-applied-configuration"}
    if annotations:
        meta["annotations"] = annotations
    else:
        meta.pop("annotations", None)
    clean["metadata"] = meta
    return clean


class ArgoHealth:
    def __init__(self, settings: ArgoCDSettings) -> None:
        self.settings = settings

    def expect(self, obj: dict[str, Any], status: str, fixture: str | None = None) -> Health:
        health = self.settings.health(obj)
        if fixture is not None and os.environ.get(CAPTURE_ENV) == "1":
            folder = CUSTOMIZATIONS / obj["kind"] / "testdata"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{fixture}.yaml").write_text(
                yaml.safe_dump(fixture_object(obj), sort_keys=False))
        assert health.status == status, (
            f"Argo CD says {obj['kind']} {obj['metadata']['name']} is {health}, expected "
            f"{status}; status:\n{yaml.safe_dump(obj.get('status'))}")
        return health
