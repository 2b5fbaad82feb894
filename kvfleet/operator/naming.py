"""Names, labels and annotations of the objects the operator owns.

The manifest hash (64 hex digits) goes into an annotation in full and into labels only as a
12-digit short revision. Object names derived from a pool name stay valid DNS labels (63
characters): a long pool name is cut and suffixed with a digest of the full name, so two long
names never collide (`bounded_name`, shared with the router in `kvfleet.api.labels`).
"""

from __future__ import annotations

from typing import Any

# Shared with the router (see `kvfleet.api.labels`); re-exported here for the operator's code.
from kvfleet.api.labels import (
    ENGINE_COMPONENT as ENGINE_COMPONENT,
)
from kvfleet.api.labels import (
    MAX_NAME as MAX_NAME,
)
from kvfleet.api.labels import (
    POOL_LABEL as POOL_LABEL,
)
from kvfleet.api.labels import (
    REVISION_LABEL as REVISION_LABEL,
)
from kvfleet.api.labels import (
    REVISION_LENGTH as REVISION_LENGTH,
)
from kvfleet.api.labels import (
    ROUTER_APP as ROUTER_APP,
)
from kvfleet.api.labels import (
    ROUTER_TOKEN_LABEL as ROUTER_TOKEN_LABEL,
)
from kvfleet.api.labels import (
    bounded_name as bounded_name,
)
from kvfleet.api.labels import (
    label_value as label_value,
)
from kvfleet.api.labels import (
    short_revision as short_revision,
)
from kvfleet.api.meta import GROUP

MODEL_LABEL = f"{GROUP}/model"
MANIFEST_HASH_ANNOTATION = f"{GROUP}/manifest-hash"
# The revision's id (kvfleet.operator.revisions); a Deployment without it is an older
# operator's, whose revision was its manifest hash.
REVISION_ANNOTATION = f"{GROUP}/revision"
MANAGED_BY = "kvfleet-operator"
FIELD_MANAGER = "kvfleet-operator"


def deployment_name(pool: str, revision: str) -> str:
    return bounded_name(pool, short_revision(revision))


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


def revision_labels(pool: str, artifact: str, revision: str) -> dict[str, str]:
    return {
        **pool_labels(pool),
        MODEL_LABEL: label_value(artifact),
        REVISION_LABEL: short_revision(revision),
    }


def revision_selector(pool: str, revision: str) -> dict[str, str]:
    return {**pool_selector(pool), REVISION_LABEL: short_revision(revision)}


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
