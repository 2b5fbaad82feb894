"""The validating webhook over HTTPS: AdmissionReview v1 in, a decision out.

A plain aiohttp server rather than kopf's `@kopf.on.validate` + WebhookServer, because:
- the webhook must stay independent of the operator: it runs as its own Deployment with its
  own replicas and failure policy, and keeps answering while the operator restarts;
- kopf's server is started by the operator's event loop and manages the
  ValidatingWebhookConfiguration itself; we generate that object (kvfleet.webhooks.config)
  so the chart and the e2e tests control URL, caBundle, failurePolicy and timeouts;
- the protocol is one JSON POST; ~100 lines keep every status code and message under test.

Answers: 200 with `allowed` for any well-formed review (errors become a denial whose message
lists `field: message [rule: ...]`, warnings become AdmissionReview warnings); 400 for a
request that is not an AdmissionReview v1; a referenced object that cannot be read (the
apiserver is unreachable) is a denial with code 503 — fail closed, like failurePolicy: Fail.
"""

from __future__ import annotations

import json
import logging
import ssl
from typing import Any

from aiohttp import web

from kvfleet.compat import Matrix
from kvfleet.webhooks.admission import Fetch, FetchError, List, admit

VALIDATE_PATH = "/validate"
HEALTH_PATH = "/healthz"
LOG = logging.getLogger("kvfleet.webhook")


def _response(
    uid: str,
    allowed: bool,
    *,
    code: int = 200,
    message: str = "",
    warnings: list[str] | None = None,
) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if not allowed:
        reason = "Invalid" if code == 422 else "ServiceUnavailable"
        response["status"] = {"code": code, "reason": reason, "message": message}
    if warnings:
        response["warnings"] = warnings
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


async def review(body: dict[str, Any], *, fetch: Fetch, matrix: Matrix,
                 list_objects: List | None = None) -> dict[str, Any]:
    """The AdmissionReview answer for one request (the whole webhook, minus HTTP)."""
    request = body["request"]
    uid = str(request["uid"])
    if request.get("operation") not in ("CREATE", "UPDATE"):
        return _response(uid, True)
    kind = request["kind"]["kind"]
    obj = request["object"]
    name = f"{request.get('namespace') or ''}/{obj.get('metadata', {}).get('name', '?')}"
    try:
        decision = await admit(
            kind,
            obj,
            request.get("oldObject"),
            fetch=fetch,
            matrix=matrix,
            namespace=request.get("namespace"),
            list_objects=list_objects,
        )
    except FetchError as error:
        message = f"{kind} {name}: cannot check references: {error}; retry"
        return _response(uid, False, code=503, message=message)
    warnings = [str(w) for w in decision.warnings]
    LOG.info(
        "%s %s %s: %s",
        request["operation"],
        kind,
        name,
        "allowed" if decision.allowed else decision.message(kind, name),
    )
    if decision.allowed:
        return _response(uid, True, warnings=warnings)
    return _response(uid, False, code=422, message=decision.message(kind, name), warnings=warnings)


def make_app(*, fetch: Fetch, matrix: Matrix,
             list_objects: List | None = None) -> web.Application:
    async def validate(http_request: web.Request) -> web.Response:
        try:
            body = await http_request.json()
            if body.get("apiVersion") != "admission.k8s.io/v1" or "request" not in body:
                raise ValueError("expected an admission.k8s.io/v1 AdmissionReview with a request")
        except (ValueError, json.JSONDecodeError, AttributeError) as error:
            return web.json_response({"error": str(error)}, status=400)
        return web.json_response(await review(body, fetch=fetch, matrix=matrix,
                                                      list_objects=list_objects))

    async def health(_: web.Request) -> web.Response:
        return web.Response(text=f"ok matrix {matrix.version}\n")

    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.router.add_post(VALIDATE_PATH, validate)
    app.router.add_get(HEALTH_PATH, health)
    return app


async def start(
    app: web.Application, host: str, port: int, context: ssl.SSLContext
) -> web.AppRunner:
    """Start serving; the caller awaits `runner.cleanup()` to stop."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=context).start()
    return runner
