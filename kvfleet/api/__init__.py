"""kvfleet.api: the four resources (group kvfleet.io, version v1alpha1) as pydantic models.

The single source of truth for the CRD schemas (kvfleet.api.crdgen), the webhook, the operator
and the CLI. Imports nothing else of kvfleet.
"""

from kvfleet.api.documents import (
    KINDS,
    DocumentError,
    KvfleetObject,
    load_objects,
    load_yaml_documents,
    parse_object,
)
from kvfleet.api.manifest import base_hash, canonical_json, manifest_hash
from kvfleet.api.meta import API_VERSION, GROUP, VERSION, Condition, ConditionStatus, ObjectMeta
from kvfleet.api.modelartifact import DType, ModelArtifact, ModelArtifactSpec
from kvfleet.api.rollout import Rollout, RolloutSpec
from kvfleet.api.servingpool import ServingPool, ServingPoolSpec
from kvfleet.api.tenantquota import TenantQuota, TenantQuotaSpec

__all__ = [
    "API_VERSION",
    "GROUP",
    "KINDS",
    "VERSION",
    "Condition",
    "ConditionStatus",
    "DType",
    "DocumentError",
    "KvfleetObject",
    "ModelArtifact",
    "ModelArtifactSpec",
    "ObjectMeta",
    "Rollout",
    "RolloutSpec",
    "ServingPool",
    "ServingPoolSpec",
    "TenantQuota",
    "TenantQuotaSpec",
    "base_hash",
    "canonical_json",
    "load_objects",
    "load_yaml_documents",
    "manifest_hash",
    "parse_object",
]
