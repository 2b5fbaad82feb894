"""kvfleet.webhooks: validating admission for the four kinds.

    validate   pure rules, validate_<kind>(new, old, ...) -> list[FieldError]
    admission  parse + resolve references + rules -> Decision (shared with `kvfleet check`)
    server     AdmissionReview v1 over HTTPS (aiohttp)
    config     the ValidatingWebhookConfiguration (failure policy documented there)
    kube       reads referenced objects from the apiserver
    certs      CA + serving certificate

Errors: FetchError (a referenced object could not be read) → a 503 denial.
"""

from kvfleet.webhooks.admission import Decision, FetchError, admit
from kvfleet.webhooks.config import build_validating_webhook_configuration
from kvfleet.webhooks.validate import (
    FieldError,
    validate_modelartifact,
    validate_rollout,
    validate_servingpool,
    validate_tenantquota,
)

__all__ = [
    "Decision",
    "FetchError",
    "FieldError",
    "admit",
    "build_validating_webhook_configuration",
    "validate_modelartifact",
    "validate_rollout",
    "validate_servingpool",
    "validate_tenantquota",
]
