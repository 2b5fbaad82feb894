"""Tenant API keys: Secrets labelled `kvfleet.io/tenant=<tenant>`, key in `data.key`.

Only SHA-256 digests of the keys are kept. A presented key is hashed and looked up by digest:
the time a lookup takes depends on the digest, which tells nothing about any stored key, so no
timing reveals a key prefix (what a byte-by-byte comparison of keys would). Keys are never
logged; a Secret that cannot be used is logged by name with the reason.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from kvfleet.api.labels import TENANT_LABEL
from kvfleet.router.errors import Unauthorized

log = logging.getLogger(__name__)

KEY_FIELD = "key"


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """Key digest -> tenant."""

    def __init__(self, tenants: Mapping[bytes, str] | None = None) -> None:
        self._tenants = dict(tenants or {})

    def __len__(self) -> int:
        return len(self._tenants)

    @classmethod
    def from_keys(cls, keys: Mapping[str, str]) -> KeyRing:
        """From plain key -> tenant (tests, a local config file)."""
        return cls({digest(key): tenant for key, tenant in keys.items()})

    @classmethod
    def from_secrets(cls, secrets: Iterable[Mapping[str, Any]]) -> KeyRing:
        tenants: dict[bytes, str] = {}
        for secret in secrets:
            meta = secret.get("metadata") or {}
            where = f"Secret {meta.get('namespace', '')}/{meta.get('name', '')}"
            tenant = (meta.get("labels") or {}).get(TENANT_LABEL)
            encoded = (secret.get("data") or {}).get(KEY_FIELD)
            if not tenant or not encoded:
                log.warning("%s: skipped, it needs the label %s and a data field %r",
                            where, TENANT_LABEL, KEY_FIELD)
                continue
            try:
                key = base64.b64decode(encoded, validate=True).decode().strip()
            except (binascii.Error, UnicodeDecodeError):
                log.warning("%s: skipped, data.%s is not base64 UTF-8 text", where, KEY_FIELD)
                continue
            if len(key) < 16:
                log.warning("%s: skipped, an API key needs at least 16 characters", where)
                continue
            tenants[digest(key)] = tenant
        return cls(tenants)

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant of an `Authorization: Bearer <key>` header; Unauthorized otherwise."""
        if not authorization:
            raise Unauthorized("no API key: send 'Authorization: Bearer <key>' with a key from "
                               f"a Secret labelled {TENANT_LABEL}")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("the Authorization header must be 'Bearer <key>'")
        tenant = self._tenants.get(digest(key.strip()))
        if tenant is None:
            raise Unauthorized("invalid API key")
        return tenant
