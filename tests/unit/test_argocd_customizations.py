"""Argo CD's health checks for the four kinds and the Rollout's actions (helm/kvfleet/argocd,
in Argo CD's own layout), run by Argo CD's own code: the pinned argocd binary's
`admin settings resource-overrides` over the argocd-cm patch the chart renders.

The fixtures under each kind's testdata/ are real objects captured from the dev cluster by
the e2e tests (KVFLEET_CAPTURE_ARGOCD_FIXTURES=1, see e2e/argocd_health.py); health_test.yaml
and actions/action_test.yaml say what Argo CD must make of each, as upstream's do. Without the
built tools (e2e/tools/build.sh; CI builds them first) the binary tests skip; the layout and
fixture checks always run.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.api import ModelArtifact, Rollout, ServingPool, TenantQuota
from kvfleet.api.crdgen import RESOURCES
from kvfleet.api.rollout import RequestAction, RolloutRequest
from kvfleet.devcluster import toolchain
from kvfleet.devcluster.argocd import CUSTOMIZATIONS, ArgoCDSettings
from kvfleet.devcluster.errors import ToolsMissingError

MODELS = {m.__name__: m for m in (ModelArtifact, ServingPool, TenantQuota, Rollout)}
ACTIONS = CUSTOMIZATIONS / "Rollout" / "actions"


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _health_cases() -> list[tuple[str, dict[str, Any]]]:
    return [(kind, case) for kind in sorted(MODELS)
            for case in _load(CUSTOMIZATIONS / kind / "health_test.yaml")["tests"]]


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> ArgoCDSettings:
    try:
        tools = toolchain.locate()
    except ToolsMissingError as exc:
        if os.environ.get("KVFLEET_E2E_REQUIRED") == "1":
            pytest.fail(f"argocd not built although KVFLEET_E2E_REQUIRED=1: {exc}")
        pytest.skip(f"argocd not built: {exc}")
    return ArgoCDSettings.from_chart(tools["argocd"], tools["helm"],
                                     tmp_path_factory.mktemp("argocd"))


def test_every_kind_has_a_health_check_and_every_fixture_a_test() -> None:
    assert sorted(p.name for p in CUSTOMIZATIONS.iterdir()) == sorted(
        r.__name__ for r in RESOURCES)
    for kind, model in MODELS.items():
        folder = CUSTOMIZATIONS / kind
        assert (folder / "health.lua").is_file()
        used = {case["inputPath"] for case in _load(folder / "health_test.yaml")["tests"]}
        if kind == "Rollout":
            tests = _load(ACTIONS / "action_test.yaml")
            # actions/action_test.yaml names the kind's fixtures from actions/: ../testdata/
            used |= {c["inputPath"] for c in tests["discoveryTests"] + tests["actionTests"]}
        fixtures = {f"testdata/{p.name}" for p in (folder / "testdata").glob("*.yaml")}
        assert fixtures == {u.removeprefix("../") for u in used}, (
            f"{kind}: fixtures without a test, or tests without a fixture")
        for name in fixtures:
            obj = _load(folder / name)
            # Real objects as the apiserver returned them: they parse as the API says.
            model.model_validate(obj)
            assert obj["metadata"].get("managedFields") is None


def test_the_scripts_use_only_the_libraries_argo_cd_opens() -> None:
    """Argo CD's gopher-lua opens base, table and os (its safe part, through `require`), not
    string or math."""
    for script in CUSTOMIZATIONS.rglob("*.lua"):
        text = re.sub(r"--[^\n]*", "", script.read_text()).replace('require("os")', "")
        used = set(re.findall(r"\b(string|math|io|debug|require|load|dofile)\b\s*[.(]", text))
        assert not used, f"{script.relative_to(CUSTOMIZATIONS)} uses {sorted(used)}"


@pytest.mark.tools
@pytest.mark.parametrize(("kind", "case"), _health_cases(),
                         ids=lambda v: v if isinstance(v, str) else v["inputPath"])
def test_argo_cd_health_is_what_the_test_expects(
    settings: ArgoCDSettings, kind: str, case: dict[str, Any]
) -> None:
    obj = _load(CUSTOMIZATIONS / kind / case["inputPath"])
    health = settings.health(obj)
    expected = case["healthStatus"]
    assert (health.status, health.message) == (expected["status"], expected["message"])


@pytest.mark.tools
def test_rollout_actions_are_offered_only_where_they_apply(settings: ArgoCDSettings) -> None:
    for case in _load(ACTIONS / "action_test.yaml")["discoveryTests"]:
        obj = _load(ACTIONS / case["inputPath"])
        expected = {a["name"]: a["disabled"] for a in case["result"]}
        assert settings.actions(obj) == expected, case["inputPath"]


@pytest.mark.tools
def test_each_rollout_action_writes_the_request_the_operator_reads(
    settings: ArgoCDSettings
) -> None:
    cases = _load(ACTIONS / "action_test.yaml")["actionTests"]
    assert {c["action"] for c in cases} == {a.value for a in RequestAction}
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("argocd-*"))
    for case in cases:
        obj = _load(ACTIONS / case["inputPath"])
        request = RolloutRequest.model_validate(settings.run_action(obj, case["action"]))
        assert request.action.value == case["action"]
        assert request.id.startswith(f"argocd-{case['action']}-")
        # A promote is for the step the rollout is at, so a second click never skips one.
        expected_step = obj["status"]["currentStep"] if case["action"] == "promote" else None
        assert request.step == expected_step
    assert set(temp.glob("argocd-*")) <= before  # argocd's diff folders went with the call
