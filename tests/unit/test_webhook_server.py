"""AdmissionReview v1 handling: the JSON the apiserver sends in, the JSON it expects back."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from kvfleet.api.builders import make_artifact, make_pool
from kvfleet.compat import default_matrix
from kvfleet.webhooks import FetchError
from kvfleet.webhooks.config import build_validating_webhook_configuration
from kvfleet.webhooks.server import make_app, review

MATRIX = default_matrix()


def _review(
    kind: str, obj: dict[str, Any], operation: str = "CREATE", old: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "0df28fbd-5f5f-4a1b-8f5e-111111111111",
            "kind": {"group": "kvfleet.io", "version": "v1alpha1", "kind": kind},
            "namespace": "default",
            "operation": operation,
            "object": obj,
            "oldObject": old,
        },
    }


async def _no_objects(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    return None


async def _artifact_only(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    return make_artifact().obj().to_wire() if kind == "ModelArtifact" else None


def _run(body: dict[str, Any], fetch: Any = _no_objects) -> dict[str, Any]:
    return asyncio.run(review(body, fetch=fetch, matrix=MATRIX))


def test_allowed_response_echoes_uid() -> None:
    answer = _run(_review("ServingPool", make_pool().data()), _artifact_only)
    assert answer == {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {"uid": "0df28fbd-5f5f-4a1b-8f5e-111111111111", "allowed": True},
    }


def test_denial_is_422_with_field_rule_and_matrix_version() -> None:
    pool = make_pool().set("spec.gpu.product", "Tesla-T4").data()
    response = _run(_review("ServingPool", pool), _artifact_only)["response"]
    assert response["allowed"] is False
    assert response["status"]["code"] == 422
    message = response["status"]["message"]
    assert message.startswith("ServingPool default/chat is invalid: spec.gpu.product:")
    assert f"compatibility matrix {MATRIX.version}" in message
    assert "[rule: compatibility]" in message


def test_warnings_are_passed_to_kubectl() -> None:
    async def no_params(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return make_artifact().delete("spec.architecture.numParameters").obj().to_wire()

    response = _run(_review("ServingPool", make_pool().data()), no_params)["response"]
    assert response["allowed"] is True
    assert "unknown params" in response["warnings"][0]


def test_delete_is_always_allowed() -> None:
    assert _run(_review("ServingPool", {}, operation="DELETE"))["response"]["allowed"] is True


def test_unreadable_reference_is_a_503_denial() -> None:
    async def down(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        raise FetchError("apiserver unreachable")

    response = _run(_review("ServingPool", make_pool().data()), down)["response"]
    assert response["allowed"] is False
    assert response["status"]["code"] == 503
    assert "apiserver unreachable; retry" in response["status"]["message"]


def test_http_endpoint_rejects_non_admission_bodies() -> None:
    async def scenario() -> tuple[int, int, str]:
        client = TestClient(TestServer(make_app(fetch=_no_objects, matrix=MATRIX)))
        await client.start_server()
        try:
            bad = await client.post("/validate", json={"hello": "world"})
            good = await client.post(
                "/validate",
                json=_review(
                    "TenantQuota",
                    {
                        "apiVersion": "kvfleet.io/v1alpha1",
                        "kind": "TenantQuota",
                        "metadata": {"name": "a"},
                        "spec": {"tenant": "a"},
                    },
                ),
            )
            health = await client.get("/healthz")
            return bad.status, good.status, await health.text()
        finally:
            await client.close()

    bad, good, health = asyncio.run(scenario())
    assert (bad, good) == (400, 200)
    assert health == f"ok matrix {MATRIX.version}\n"


def test_webhook_configuration_matches_only_kvfleet_main_resources() -> None:
    vwc = build_validating_webhook_configuration(
        ca_bundle_pem=b"PEM", url="https://127.0.0.1:9443/validate"
    )
    [hook] = vwc["webhooks"]
    assert hook["failurePolicy"] == "Fail"
    assert hook["clientConfig"] == {"caBundle": "UEVN", "url": "https://127.0.0.1:9443/validate"}
    [rule] = hook["rules"]
    assert rule["apiGroups"] == ["kvfleet.io"]
    # No "*/status": the operator keeps writing status while the webhook is down.
    assert rule["resources"] == ["modelartifacts", "rollouts", "servingpools", "tenantquotas"]
    assert hook["sideEffects"] == "None" and hook["admissionReviewVersions"] == ["v1"]
    in_cluster = build_validating_webhook_configuration(
        ca_bundle_pem=b"PEM",
        service=("kvfleet-system", "kvfleet-webhook", 443),
        failure_policy="Ignore",
    )
    assert in_cluster["webhooks"][0]["clientConfig"]["service"]["path"] == "/validate"
    assert in_cluster["webhooks"][0]["failurePolicy"] == "Ignore"
