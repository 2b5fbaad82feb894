"""Shared pieces of the four kinds: the base model, object metadata, conditions, CRD naming.

Every API model derives from `KubeModel`: snake_case in Python, camelCase on the wire
(Kubernetes convention), unknown fields rejected (the apiserver prunes unknown fields before we
see an object, so an unknown field here is a typo in a file, never a newer server). Every field
carries a description because the CRD schema — and so `kubectl explain` — is generated from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

GROUP = "kvfleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

SHA256_PATTERN = r"^[a-f0-9]{64}$"
# Kubernetes resource quantity for bytes: plain integer or a binary/decimal suffix.
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    """One `x-kubernetes-validations` entry (a CEL rule the apiserver evaluates)."""
    entry: JsonDict = {"rule": rule, "message": message}
    if field_path is not None:
        entry["fieldPath"] = field_path
    return entry


class KubeModel(BaseModel):
    """Base of every API model: camelCase aliases, strict field names."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_enum_values=False,
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The object as Kubernetes would store it: camelCase, no nulls."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class ObjectMeta(BaseModel):
    """The subset of Kubernetes ObjectMeta kvfleet reads; the rest is ignored, not rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    name: str = Field(description="Object name, unique in its namespace.")
    namespace: str | None = Field(default=None, description="Namespace of the object.")
    uid: str | None = Field(default=None, description="Server-assigned unique id.")
    generation: int | None = Field(default=None, description="Spec generation, set by the server.")
    resource_version: str | None = Field(default=None, description="Server-side version.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations.")


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(KubeModel):
    """A standard Kubernetes condition (metav1.Condition): one observed aspect of the object."""

    type: str = Field(
        description="Condition type in CamelCase, e.g. Ready, Verified, Compatible, Progressing.",
        pattern=r"^[A-Z][A-Za-z0-9]*$",
        max_length=316,
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        description="Machine-readable CamelCase reason for the last transition.",
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        max_length=1024,
    )
    message: str = Field(
        default="", description="Human-readable details of the transition.", max_length=32768
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation the condition was computed from."
    )
    last_transition_time: datetime = Field(description="When the status last changed (RFC 3339).")


def conditions_field() -> Any:
    """The `conditions` list every status has, merged by `type` (list-map)."""
    return Field(
        default_factory=list,
        description="Standard conditions, one per type.",
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


@dataclass(frozen=True)
class PrinterColumn:
    """An `additionalPrinterColumns` entry of the CRD (what `kubectl get` shows)."""

    name: str
    json_path: str
    type: str = "string"
    description: str = ""
    priority: int = 0


@dataclass(frozen=True)
class CRDNames:
    """What a top-level kind needs beyond its schema to become a CRD."""

    plural: str
    short_names: tuple[str, ...]
    printer_columns: tuple[PrinterColumn, ...]
    categories: tuple[str, ...] = ("kvfleet",)
    # /scale subresource (kubectl scale, HorizontalPodAutoscaler) on spec/status.replicas.
    scale: bool = False
    # CEL rules placed on the root (they need both spec and status, or metadata).
    root_validations: tuple[JsonDict, ...] = field(default=())


def ready_column() -> PrinterColumn:
    return PrinterColumn(
        name="Ready",
        json_path='.status.conditions[?(@.type=="Ready")].status',
        description="The Ready condition.",
    )


def age_column() -> PrinterColumn:
    return PrinterColumn(name="Age", json_path=".metadata.creationTimestamp", type="date")
