"""Labels and names that kvfleet components agree on through the API server: the operator
writes them on the objects it makes, the router selects by them. One definition, so the two
cannot drift apart.

Label values are limited to 63 characters: a long value is cut and suffixed with a digest of
the whole (`label_value`), so two long names never collide; the manifest hash (64 hex digits)
goes into labels as a 12-digit short revision.
"""

from __future__ import annotations

import hashlib

from kvfleet.api.meta import GROUP

POOL_LABEL = f"{GROUP}/pool"  # on engine pods: the pool's name (label_value)
REVISION_LABEL = f"{GROUP}/revision"  # on engine pods: the short revision
TENANT_LABEL = f"{GROUP}/tenant"  # on API-key Secrets: the tenant
# On the Secret holding a pool's router token (key ROUTER_TOKEN_KEY): the pool's name.
ROUTER_TOKEN_LABEL = f"{GROUP}/router-token-for"
ROUTER_TOKEN_KEY = "token"
# With engine TLS (the operator's --engine-tls), the same Secret holds the engines' certificate
# and key, and the certificate they had before a renewal (the router trusts both meanwhile).
ENGINE_CERT_KEY, ENGINE_KEY_KEY, ENGINE_PREVIOUS_CERT_KEY = "tls.crt", "tls.key", "previous.crt"


def engine_server_name(pool: str, namespace: str) -> str:
    """The name a pool's engine certificate is issued for and the router checks: engines are
    reached by pod IP, which no certificate can name in advance."""
    return f"{pool}.{namespace}.engines.kvfleet.io"
ENGINE_COMPONENT = "engine"  # app.kubernetes.io/component of engine pods
ROUTER_APP = "kvfleet-router"  # app.kubernetes.io/name of router pods
ENGINE_PORT = 8000  # the engine container's `http` port

REVISION_LENGTH = 12
MAX_NAME = 63


def short_revision(manifest_hash: str) -> str:
    return manifest_hash[:REVISION_LENGTH]


def bounded_name(base: str, suffix: str = "") -> str:
    """`base` + `-suffix`, cut to a 63-character DNS label with a digest when too long."""
    full = f"{base}-{suffix}" if suffix else base
    if len(full) <= MAX_NAME:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:8]
    tail = f"-{digest}-{suffix}" if suffix else f"-{digest}"
    return base[: MAX_NAME - len(tail)].rstrip("-") + tail


def label_value(text: str) -> str:
    """A label value (≤ 63 characters) that stays unique for long inputs."""
    return bounded_name(text)
