"""Builders of valid objects for tests and tools: `make_pool("a").set("spec.gpu.count", 2).obj()`.

Each builder starts from a realistic, valid object and changes one thing at a time, so a test
says only what matters to it instead of copying YAML blobs.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any, Generic, TypeVar

from kvfleet.api.meta import API_VERSION
from kvfleet.api.modelartifact import ModelArtifact
from kvfleet.api.rollout import Rollout
from kvfleet.api.servingpool import ServingPool
from kvfleet.api.tenantquota import TenantQuota

T = TypeVar("T", ModelArtifact, ServingPool, TenantQuota, Rollout)


def fake_sha256(label: str) -> str:
    """A well-formed digest derived from a label (for shapes whose real files are not here)."""
    return hashlib.sha256(label.encode()).hexdigest()


class Builder(Generic[T]):
    """A wire-format dict plus the model that parses it."""

    def __init__(self, cls: type[T], data: dict[str, Any]) -> None:
        self._cls: type[T] = cls
        self._data = data

    def set(self, path: str, value: Any) -> Builder[T]:
        """Set a dotted camelCase path (`spec.gpu.count`, `spec.steps.1.weight`)."""
        node: Any = self._data
        parts = path.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        last = parts[-1]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return self

    def delete(self, path: str) -> Builder[T]:
        node: Any = self._data
        parts = path.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        del node[parts[-1]]
        return self

    def data(self) -> dict[str, Any]:
        return copy.deepcopy(self._data)

    def obj(self) -> T:
        return self._cls.model_validate(self.data())


def _meta(name: str, namespace: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace}


def make_artifact(name: str = "qwen3-8b", namespace: str = "default") -> Builder[ModelArtifact]:
    """A Qwen3-8B-shaped bf16 safetensors artifact (digests are placeholders)."""
    files = [
        {
            "uri": f"s3://models/qwen3-8b/model-{i:05d}-of-00005.safetensors",
            "sha256": fake_sha256(f"qwen3-8b-{i}"),
            "sizeBytes": 3_300_000_000,
        }
        for i in range(1, 6)
    ]
    return Builder(
        ModelArtifact,
        {
            "apiVersion": API_VERSION,
            "kind": "ModelArtifact",
            "metadata": _meta(name, namespace),
            "spec": {
                "family": "qwen3",
                "weights": {"format": "safetensors", "files": files},
                "tokenizer": {"type": "gpt2", "sha256": fake_sha256("qwen3-tokenizer")},
                "chatTemplate": {"sha256": fake_sha256("qwen3-template")},
                "specialTokens": {"eosTokenId": 151645, "stopTokenIds": [151643]},
                "architecture": {
                    "name": "qwen3",
                    "numLayers": 36,
                    "hiddenSize": 4096,
                    "numQueryHeads": 32,
                    "numKVHeads": 8,
                    "headDim": 128,
                    "vocabSize": 151936,
                    "maxContextLength": 32768,
                    "numParameters": 8_000_000_000,
                    "intermediateSize": 12288,
                },
                "dtype": "bfloat16",
                "engineVersions": {"min": "0.1"},
            },
        },
    )


def make_pool(
    name: str = "chat", artifact: str = "qwen3-8b", namespace: str = "default"
) -> Builder[ServingPool]:
    """One replica on one L4, planning for 8,192-token sequences."""
    return Builder(
        ServingPool,
        {
            "apiVersion": API_VERSION,
            "kind": "ServingPool",
            "metadata": _meta(name, namespace),
            "spec": {
                "artifactRef": {"name": artifact},
                "replicas": 1,
                "gpu": {"product": "NVIDIA-L4", "count": 1},
                "engine": {"maxModelLength": 8192, "workspace": "2Gi", "safetyMargin": "1Gi"},
            },
        },
    )


def make_quota(name: str = "team-a", namespace: str = "default") -> Builder[TenantQuota]:
    return Builder(
        TenantQuota,
        {
            "apiVersion": API_VERSION,
            "kind": "TenantQuota",
            "metadata": _meta(name, namespace),
            "spec": {"tenant": name, "limits": {"requestsPerMinute": 600}},
        },
    )


def make_rollout(
    name: str = "chat",
    pool: str = "chat",
    namespace: str = "default",
) -> Builder[Rollout]:
    return Builder(
        Rollout,
        {
            "apiVersion": API_VERSION,
            "kind": "Rollout",
            "metadata": _meta(name, namespace),
            "spec": {
                "poolRef": {"name": pool},
                "steps": [{"weight": 10}, {"weight": 50}, {"weight": 100}],
                "analysis": {
                    "metrics": [
                        {
                            "name": "ttft-p95",
                            "slo": "TTFTP95",
                            "threshold": 0.5,
                        }
                    ]
                },
            },
        },
    )
