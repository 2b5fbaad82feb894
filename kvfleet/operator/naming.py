"""Names, labels and annotations of the objects the operator owns.

Label values are limited to 63 characters, so the manifest hash (64 hex digits) goes into an
annotation in full and into labels only as a 12-digit short revision. Object names derived from
a pool name stay valid DNS labels (63 characters): a long pool name is cut and suffixed with a
digest of the full name, so two long names never collide.
"""

from __future__ import annotations

import hashlib
from typing import Any

GROUP = "kvfleet.io"
POOL_LABEL = f"{GROUP}/pool"
MODEL_LABEL = f"{GROUP}/model"
REVISION_LABEL = f"{GROUP}/revision"
MANIFEST_HASH_ANNOTATION = f"{GROUP}/manifest-hash"
ENGINE_CONFIG_HASH_ANNOTATION = f"{GROUP}/engine-config-hash"
MANAGED_BY = "kvfleet-operator"
FIELD_MANAGER = "kvfleet-operator"
ENGINE_COMPONENT = "engine"
# The Secret holding a pool's router token carries this label, valued with the pool's name:
# the router finds each pool's token by it.
ROUTER_TOKEN_LABEL = f"{GROUP}/router-token-for"
ROUTER_APP = "kvfleet-router"  # app.kubernetes.io/name of router pods

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


def deployment_name(pool: str, manifest_hash: str) -> str:
    return bounded_name(pool, short_revision(manifest_hash))


def config_map_name(pool: str) -> str:
    return bounded_name(pool, "engine")


def service_name(pool: str) -> str:
    return bounded_name(pool)


def pdb_name(pool: str) -> str:
    return bounded_name(pool)


def network_policy_name(pool: str) -> str:
    return bounded_name(pool)


def router_secret_name(pool: str) -> str:
    return bounded_name(pool, "router-token")


def pool_labels(pool: str) -> dict[str, str]:
    """Labels every object of a pool carries; also the Service's and PDB's pod selector."""
    return {
        "app.kubernetes.io/name": "kvfleet-engine",
        "app.kubernetes.io/instance": label_value(pool),
        "app.kubernetes.io/component": ENGINE_COMPONENT,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        POOL_LABEL: label_value(pool),
    }


def pool_selector(pool: str) -> dict[str, str]:
    return {POOL_LABEL: label_value(pool), "app.kubernetes.io/component": ENGINE_COMPONENT}


def revision_labels(pool: str, artifact: str, manifest_hash: str) -> dict[str, str]:
    return {
        **pool_labels(pool),
        MODEL_LABEL: label_value(artifact),
        REVISION_LABEL: short_revision(manifest_hash),
    }


def revision_selector(pool: str, manifest_hash: str) -> dict[str, str]:
    return {**pool_selector(pool), REVISION_LABEL: short_revision(manifest_hash)}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def owner_reference(api_version: str, kind: str, name: str, uid: str) -> dict[str, Any]:
    """A controller reference: the child is deleted with its owner (foreground or background)."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
