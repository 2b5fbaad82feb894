"""PodSettings: what a platform team sets on a pool's engine pods to fit its GPU node pools.

Real GPU nodes are tainted (`nvidia.com/gpu:NoSchedule`, often a team's own taint too) and
partitioned by labels; pods need a priority class, a service account (e.g. for S3 access),
CPU and memory requests, a model cache that may be a shared volume, a mirrored image with pull
secrets, and settings the team passes as env. The shapes follow the Kubernetes fields of the
same names (node selector, node affinity, tolerations, env with secret/ConfigMap refs), so a
manifest reads as a pod spec would; each is validated here, so the webhook rejects a mistake
at `kubectl apply` naming the field, never at scheduling.

What the operator owns is refused: the GPU product and region selectors (spec.gpu.product,
spec.region), kvfleet's own labels, env names the engine reads (KVFLEET_*, POD_IP).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from kvfleet.api.meta import QUANTITY_PATTERN, KubeModel

# Node labels the operator selects on from spec.gpu and spec.region (GPU feature discovery's
# product label, the well-known region label).
PRODUCT_LABEL = "nvidia.com/gpu.product"
MEMORY_LABEL = "nvidia.com/gpu.memory"
REGION_LABEL = "topology.kubernetes.io/region"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A CPU quantity: cores ("2", "0.5") or millicores ("500m").
CPU_PATTERN = r"^([0-9]+(\.[0-9]+)?|[0-9]+m)$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
RESERVED_ENV = ("POD_IP",)
RESERVED_ENV_PREFIX = "KVFLEET_"
# Label prefixes the operator's selectors and the router use on engine pods.
RESERVED_LABEL_PREFIXES = ("kvfleet.io/", "app.kubernetes.io/")


# The values of a string map, documented for the CRD schema (kubectl explain).
LabelValue = Annotated[str, Field(max_length=63, description="A label value.")]
AnnotationValue = Annotated[str, Field(description="An annotation value.")]


def _exactly_one(first: object, second: object, names: str) -> None:
    if (first is None) == (second is None):
        raise ValueError(f"set exactly one of {names}")


class Toleration(KubeModel):
    """A taint the pods tolerate (the GPU taint `nvidia.com/gpu` is always tolerated)."""

    key: str | None = Field(default=None, min_length=1, max_length=316,
                            description="Taint key; empty with operator Exists matches all.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, max_length=63, description="Taint value (Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect matched; empty matches all.")
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="With NoExecute: how long the pod stays after the taint.")

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("a toleration with operator Exists takes no value")
        if self.operator == "Equal" and not self.key:
            raise ValueError("a toleration with operator Equal needs a key")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds applies to effect NoExecute only")
        return self


class NodeSelectorRequirement(KubeModel):
    """One condition on a node label."""

    key: str = Field(min_length=1, max_length=316, description="Node label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(
        description="How the label's value is compared with `values`.")
    values: list[str] = Field(default_factory=list, max_length=64, description="Values.")

    @model_validator(mode="after")
    def _values_fit(self) -> NodeSelectorRequirement:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs at least one value")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values")
        if self.operator in ("Gt", "Lt") and (
                len(self.values) != 1 or not self.values[0].lstrip("-").isdigit()):
            raise ValueError(f"operator {self.operator} takes exactly one integer value")
        return self


class NodeSelectorTerm(KubeModel):
    """Conditions that must all hold (the terms of a selector are alternatives)."""

    match_expressions: list[NodeSelectorRequirement] = Field(
        min_length=1, max_length=32, description="Conditions on node labels, all required.")


class NodeSelector(KubeModel):
    """Alternatives: a node matching any term qualifies."""

    node_selector_terms: list[NodeSelectorTerm] = Field(
        min_length=1, max_length=16, description="Terms, any of which qualifies a node.")


class PreferredSchedulingTerm(KubeModel):
    """A term the scheduler favours by `weight`."""

    weight: int = Field(ge=1, le=100, description="Preference weight, 1-100.")
    preference: NodeSelectorTerm = Field(description="The nodes preferred.")


class NodeAffinity(KubeModel):
    """Which nodes the pods may (required) or should (preferred) run on."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = Field(
        default=None, description="Nodes outside these terms are never used (the GPU memory "
        "bound of spec.gpu.memory is added to every term).")
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, max_length=16, description="Nodes favoured, by weight.")


class Affinity(KubeModel):
    """Node affinity of the engine pods."""

    node_affinity: NodeAffinity | None = Field(default=None, description="Node affinity.")


class ResourceList(KubeModel):
    """CPU and memory."""

    cpu: str | None = Field(default=None, pattern=CPU_PATTERN, description="e.g. 4 or 500m.")
    memory: str | None = Field(default=None, pattern=QUANTITY_PATTERN, description="e.g. 32Gi.")


class Resources(KubeModel):
    """CPU and memory of the engine container (the GPUs come from spec.gpu)."""

    requests: ResourceList | None = Field(
        default=None, description="Reserved on the node (memory default: the weights plus "
        "1 GiB, from the capacity ledger).")
    limits: ResourceList | None = Field(default=None, description="Caps (none by default).")

    @model_validator(mode="after")
    def _limits_cover_requests(self) -> Resources:
        from kvfleet.api.quantity import parse_bytes, parse_cpu

        if self.requests is not None and self.limits is not None:
            if (self.requests.cpu and self.limits.cpu
                    and parse_cpu(self.requests.cpu) > parse_cpu(self.limits.cpu)):
                raise ValueError(f"requests.cpu {self.requests.cpu} exceeds limits.cpu "
                                 f"{self.limits.cpu}")
            if (self.requests.memory and self.limits.memory
                    and parse_bytes(self.requests.memory) > parse_bytes(self.limits.memory)):
                raise ValueError(f"requests.memory {self.requests.memory} exceeds "
                                 f"limits.memory {self.limits.memory}")
        return self


class EmptyDirCache(KubeModel):
    """A cache of the pod's own, gone with the pod."""

    size_limit: str | None = Field(default=None, pattern=QUANTITY_PATTERN, description=(
        "Size limit (default: the artifact's files plus a tenth)."))
    medium: Literal["Memory"] | None = Field(default=None,
                                             description="Memory: a tmpfs, counted as memory.")


class ClaimCache(KubeModel):
    """A PersistentVolumeClaim of the pool's namespace, shared by the pods that mount it
    (ReadWriteMany): each file is downloaded once for all of them."""

    claim_name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253,
                            description="PersistentVolumeClaim name.")


class ModelCache(KubeModel):
    """Where the model's files are fetched to: an emptyDir (default) or a claim."""

    empty_dir: EmptyDirCache | None = Field(default=None, description="A per-pod emptyDir.")
    persistent_volume_claim: ClaimCache | None = Field(default=None,
                                                       description="A shared claim.")

    @model_validator(mode="after")
    def _one(self) -> ModelCache:
        _exactly_one(self.empty_dir, self.persistent_volume_claim,
                     "emptyDir and persistentVolumeClaim")
        return self


class KeyRef(KubeModel):
    """One key of a Secret or ConfigMap in the pool's namespace."""

    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="Object name.")
    key: str = Field(min_length=1, max_length=253, description="Key in its data.")


class EnvSource(KubeModel):
    """A Secret or ConfigMap key as the value."""

    secret_key_ref: KeyRef | None = Field(default=None, description="A Secret's key.")
    config_map_key_ref: KeyRef | None = Field(default=None, description="A ConfigMap's key.")

    @model_validator(mode="after")
    def _one(self) -> EnvSource:
        _exactly_one(self.secret_key_ref, self.config_map_key_ref,
                     "secretKeyRef and configMapKeyRef")
        return self


class EnvVar(KubeModel):
    """An environment variable of the fetch and engine containers (e.g. AWS_ENDPOINT_URL)."""

    name: str = Field(pattern=ENV_NAME_PATTERN, max_length=128, description="Variable name.")
    value: str | None = Field(default=None, description="A literal value.")
    value_from: EnvSource | None = Field(default=None, description="A Secret or ConfigMap key.")

    @field_validator("name")
    @classmethod
    def _not_ours(cls, name: str) -> str:
        if name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIX):
            raise ValueError(f"{name} is set by the operator ({RESERVED_ENV_PREFIX}* and "
                             f"{', '.join(RESERVED_ENV)} are reserved); use spec.engine instead")
        return name

    @model_validator(mode="after")
    def _one(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name}: set value or valueFrom, not both")
        return self


class PodSettings(KubeModel):
    """Settings of the engine pods beyond what the operator derives from the pool."""

    node_selector: dict[str, LabelValue] = Field(
        default_factory=dict, description="Node labels required, besides the GPU product's.")
    affinity: Affinity | None = Field(default=None, description="Node affinity.")
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32,
        description="Taints tolerated, besides nvidia.com/gpu.")
    priority_class_name: str | None = Field(
        default=None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253,
        description="PriorityClass of the pods.")
    service_account_name: str | None = Field(
        default=None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253,
        description="ServiceAccount of the pods (e.g. one bound to object-store access).")
    resources: Resources | None = Field(default=None, description="CPU and memory.")
    model_cache: ModelCache | None = Field(
        default=None, description="Where the model is fetched to (default: an emptyDir).")
    image: str | None = Field(default=None, min_length=1, max_length=512,
                              description="Engine image (default: the operator's).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Image pull policy (default: the operator's).")
    image_pull_secrets: list[str] = Field(
        default_factory=list, max_length=16, description="Secrets for a private registry.")
    env: list[EnvVar] = Field(default_factory=list, max_length=64,
                              description="Extra environment of the fetch and engine containers.")
    labels: dict[str, LabelValue] = Field(default_factory=dict, description="Extra pod labels.")
    annotations: dict[str, AnnotationValue] = Field(default_factory=dict,
                                        description="Extra pod annotations.")

    @field_validator("node_selector")
    @classmethod
    def _not_the_gpu_selector(cls, selector: dict[str, str]) -> dict[str, str]:
        for key, field in ((PRODUCT_LABEL, "spec.gpu.product"), (REGION_LABEL, "spec.region")):
            if key in selector:
                raise ValueError(f"{key} is selected from {field}; set it there")
        return selector

    @field_validator("labels")
    @classmethod
    def _not_our_labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for key in labels:
            if key.startswith(RESERVED_LABEL_PREFIXES):
                raise ValueError(f"label {key}: the prefixes {', '.join(RESERVED_LABEL_PREFIXES)} "
                                 "are the operator's (its selectors use them)")
        return labels

    @field_validator("image_pull_secrets")
    @classmethod
    def _secret_names(cls, names: list[str]) -> list[str]:
        import re

        for name in names:
            if not re.match(DNS_SUBDOMAIN_PATTERN, name):
                raise ValueError(f"imagePullSecrets: {name!r} is not a Secret name")
        return names

    @field_validator("env")
    @classmethod
    def _unique(cls, env: list[EnvVar]) -> list[EnvVar]:
        names = [e.name for e in env]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"env names must be unique: {', '.join(twice)} appear twice")
        return env
