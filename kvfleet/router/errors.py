"""What the router refuses, as types; each maps to an HTTP status and an OpenAI error body.

    RouterError
    ├── Unauthorized        401: no API key, or one no Secret holds
    ├── PoolNotAllowed      403: the tenant's TenantQuota does not list the pool
    ├── NoTenantQuota       403: the tenant has no TenantQuota (and the router no default)
    ├── TenantRefused       403: the tenant's TenantQuota cannot be read: refused, not unlimited
    ├── UnknownPool         404: `model` names no ServingPool the key may use
    ├── BadRequest          400: a body the router cannot read
    ├── BodyTimeout         408: a body that did not arrive within 30 s of its headers
    ├── BodyTooLarge        413: a body over the router's limit (refused while reading it)
    ├── QuotaExceeded       429: over one of the TenantQuota's limits (with Retry-After)
    ├── IntakeFull          429: too many request bodies in flight, for the tenant or the
    │                            router (with Retry-After; kvfleet.router.intake)
    ├── UpstreamFailed      502: the replica went away while sending its answer
    ├── NoEndpoint          503: the revision has no Ready replica, or every one failed
    └── PoolWaking          503: a pool at zero did not wake in time, or its hold is full
                                 (with Retry-After)
"""

from __future__ import annotations

import math


class RouterError(Exception):
    status = 500
    code = "router_error"
    kind = "server_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def headers(self) -> dict[str, str]:
        return {}

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class Unauthorized(RouterError):
    status = 401
    code = "invalid_api_key"
    kind = "invalid_request_error"

    def headers(self) -> dict[str, str]:
        return {"www-authenticate": 'Bearer realm="kvfleet"'}


class PoolNotAllowed(RouterError):
    status = 403
    code = "model_not_allowed"
    kind = "invalid_request_error"


class NoTenantQuota(RouterError):
    status = 403
    code = "no_tenant_quota"
    kind = "permission_error"


class TenantRefused(RouterError):
    status = 403
    code = "tenant_quota_unreadable"
    kind = "permission_error"


class UnknownPool(RouterError):
    status = 404
    code = "model_not_found"
    kind = "invalid_request_error"


class BadRequest(RouterError):
    status = 400
    code = "invalid_request"
    kind = "invalid_request_error"


class BodyTimeout(RouterError):
    """The body did not arrive in time (a client holding its tenant's intake budget)."""

    status = 408
    code = "body_timeout"
    kind = "invalid_request_error"


class IntakeFull(RouterError):
    """Too many request bodies in flight for a tenant (or the router) to read another now."""

    status = 429
    code = "too_many_bodies_in_flight"
    kind = "rate_limit_error"

    def headers(self) -> dict[str, str]:
        return {"retry-after": "1"}


class BodyTooLarge(RouterError):
    status = 413
    code = "request_too_large"
    kind = "invalid_request_error"


class QuotaExceeded(RouterError):
    status = 429
    code = "rate_limit_exceeded"
    kind = "rate_limit_error"

    def __init__(self, message: str, retry_after: float, limit: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.limit = limit

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(max(1, math.ceil(self.retry_after)))}


class UpstreamFailed(RouterError):
    status = 502
    code = "upstream_failed"
    kind = "server_error"


class NoEndpoint(RouterError):
    status = 503
    code = "no_ready_replica"
    kind = "server_error"

    def headers(self) -> dict[str, str]:
        return {"retry-after": "1"}


class PoolWaking(RouterError):
    status = 503
    code = "pool_waking"
    kind = "server_error"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(max(1, math.ceil(self.retry_after)))}
