"""The ModelArtifact reconciler: `reconcile_artifact(artifact) -> dict` (the status), pure.

`Verified` says the manifest is complete and self-consistent and records its hash: every file
is pinned by sha256 and size, no file is listed twice, adapters name this artifact's base hash.
The bytes themselves are checked where they are read — by each engine at load, against the
sha256 values the operator passes it — because the operator never downloads weights.
`Compatible` is the compatibility matrix's verdict for the engine this release deploys.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kvfleet.api import ModelArtifact, base_hash, manifest_hash
from kvfleet.compat import ENGINE_VERSION, Matrix, check
from kvfleet.operator.conditions import Cond, merge_conditions


def _verify(artifact: ModelArtifact, digest: str) -> Cond:
    spec = artifact.spec
    files = spec.weights.files
    seen: set[str] = set()
    for index, weight in enumerate(files):
        if weight.uri in seen:
            return Cond(
                "Verified",
                False,
                "DuplicateFile",
                f"spec.weights.files[{index}].uri {weight.uri} is listed twice",
            )
        seen.add(weight.uri)
    own_base = base_hash(spec)
    for index, adapter in enumerate(spec.adapters):
        if adapter.base_hash != own_base:
            return Cond(
                "Verified",
                False,
                "AdapterBaseMismatch",
                f"spec.adapters[{index}].baseHash {adapter.base_hash[:12]}… is not this "
                f"artifact's base hash {own_base[:12]}…",
            )
    total = sum(w.size_bytes for w in files)
    return Cond(
        "Verified",
        True,
        "ManifestHashed",
        f"manifest hash {digest}; {len(files)} {spec.weights.format.value} file(s), "
        f"{total:,} bytes, each pinned by sha256 (engines verify the bytes at load)",
    )


def reconcile_artifact(artifact: ModelArtifact, *, matrix: Matrix, now: datetime) -> dict[str, Any]:
    """The status the artifact should have."""
    previous = artifact.status.to_wire() if artifact.status is not None else {}
    digest = manifest_hash(artifact.spec)
    verified = _verify(artifact, digest)
    problems = check(artifact.spec, matrix=matrix)
    if problems:
        compatible = Cond("Compatible", False, "Incompatible", "; ".join(str(p) for p in problems))
    else:
        compatible = Cond(
            "Compatible",
            True,
            "MatrixAllows",
            f"engine {ENGINE_VERSION} supports this artifact "
            f"(compatibility matrix {matrix.version})",
        )
    both = verified.status is True and compatible.status is True
    failed = verified if verified.status is not True else compatible
    ready = Cond(
        "Ready", both, "Verified" if both else failed.reason, "" if both else failed.message
    )
    generation = artifact.metadata.generation
    status: dict[str, Any] = {
        "manifestHash": digest,
        "matrixVersion": matrix.version,
        "conditions": merge_conditions(
            previous.get("conditions", []), [verified, compatible, ready], generation, now
        ),
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status
