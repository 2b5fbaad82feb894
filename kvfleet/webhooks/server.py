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

import asyncio
import json
import logging
import ssl
import tempfile
from pathlib import Path
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


def server_ssl_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


class ServingCertificate:
    """The serving certificate, reloaded into the same SSL context when its files change:
    cert-manager renews the Secret and the kubelet swaps the mounted files in place, so new
    connections get the new certificate without a restart (open ones keep theirs)."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = cert, key
        self.context = server_ssl_context(cert, key)
        self._seen = self._stamp()

    def _stamp(self) -> tuple[tuple[int, int], ...]:
        # stat follows the kubelet's ..data symlink, so a swapped Secret changes the stamp.
        return tuple((s.st_mtime_ns, s.st_size) for s in (self.cert.stat(), self.key.stat()))

    def reload_if_changed(self) -> bool:
        """True when a changed pair was loaded; a pair caught mid-write (key not matching the
        certificate) is left for the next look, the old one serving meanwhile."""
        try:
            stamp = self._stamp()
        except OSError as exc:
            LOG.warning("serving certificate: cannot stat %s or %s (%s)", self.cert, self.key,
                        exc)
            return False
        if stamp == self._seen:
            return False
        try:
            self._load_checked()
        except (OSError, ssl.SSLError) as exc:
            LOG.warning("serving certificate: %s changed but does not load yet (%s)",
                        self.cert, exc)
            return False
        self._seen = stamp
        LOG.info("serving certificate reloaded from %s", self.cert)
        return True

    def _load_checked(self) -> None:
        """Load a snapshot of the pair that a scratch context accepted: a failed
        load_cert_chain leaves a context with the new certificate and the old key, so the
        live context is only ever given a pair known to match."""
        with tempfile.TemporaryDirectory(prefix="kvfleet-webhook-cert-") as tmp:
            cert, key = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
            cert.write_bytes(self.cert.read_bytes())
            key.touch(mode=0o600)
            key.write_bytes(self.key.read_bytes())
            server_ssl_context(cert, key)  # raises when they do not match
            self.context.load_cert_chain(cert, key)

    async def watch(self, interval: float = 10.0) -> None:
        while True:
            await asyncio.sleep(interval)
            self.reload_if_changed()


async def start(
    app: web.Application, host: str, port: int, context: ssl.SSLContext
) -> web.AppRunner:
    """Start serving; the caller awaits `runner.cleanup()` to stop."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=context).start()
    return runner
