"""The ValidatingWebhookConfiguration that sends kvfleet objects to the webhook.

Failure policy: **Fail** (the default here). If the webhook is down or times out, creating or
changing ModelArtifacts, ServingPools, TenantQuotas and Rollouts is refused with an error that
says the webhook could not be called; `kubectl apply` / Argo CD retry later. Chosen over Ignore
because an unchecked artifact or pool is admitted for good: the operator would then schedule
GPU pods that cannot load the model or do not fit. The blast radius stays small:
- only kvfleet.io resources are matched, never Pods or core objects;
- `*/status` subresources are not matched, so the operator keeps writing status while the
  webhook is down; metadata-only updates (finalizers) are allowed by the webhook itself;
- CRD CEL rules (spec immutability, canary weights) hold even with failurePolicy Ignore.
`failure_policy="Ignore"` exists for clusters that prefer availability; the e2e test shows both.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from kvfleet.api import GROUP, KINDS, VERSION
from kvfleet.webhooks.server import VALIDATE_PATH

WEBHOOK_NAME = "validate.kvfleet.io"


def build_validating_webhook_configuration(
    *,
    ca_bundle_pem: bytes,
    url: str | None = None,
    service: tuple[str, str, int] | None = None,
    name: str = "kvfleet",
    failure_policy: Literal["Fail", "Ignore"] = "Fail",
    timeout_seconds: int = 5,
) -> dict[str, Any]:
    """The object for a webhook at `url` (e.g. https://127.0.0.1:9443/validate) or at the
    in-cluster `service` (namespace, name, port)."""
    if (url is None) == (service is None):
        raise ValueError("give exactly one of url or service")
    client: dict[str, Any] = {"caBundle": base64.b64encode(ca_bundle_pem).decode()}
    if url is not None:
        client["url"] = url
    elif service is not None:
        namespace, service_name, port = service
        client["service"] = {
            "namespace": namespace,
            "name": service_name,
            "port": port,
            "path": VALIDATE_PATH,
        }
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": WEBHOOK_NAME,
                "clientConfig": client,
                "rules": [
                    {
                        "apiGroups": [GROUP],
                        "apiVersions": [VERSION],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": sorted(cls.crd.plural for cls in KINDS.values()),
                        "scope": "Namespaced",
                    }
                ],
                "failurePolicy": failure_policy,
                "matchPolicy": "Equivalent",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": timeout_seconds,
            }
        ],
    }
