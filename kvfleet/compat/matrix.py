"""Loading the compatibility matrix: YAML data validated by its JSON Schema, then typed.

The data lives in `compat_matrix/matrix.yaml` at the repository root (or wherever
`$KVFLEET_COMPAT_MATRIX` points); its schema in `compat_matrix/schema.json` next to it.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from kvfleet.api import load_yaml_documents
from kvfleet.api.quantity import parse_bytes

MATRIX_ENV = "KVFLEET_COMPAT_MATRIX"
DEFAULT_MATRIX_PATH = Path(__file__).resolve().parents[2] / "compat_matrix" / "matrix.yaml"
SCHEMA_PATH = DEFAULT_MATRIX_PATH.with_name("schema.json")

Version = tuple[int, ...]


class MatrixError(ValueError):
    """The matrix file is missing or does not match its JSON Schema; names the file and path."""


def parse_version(text: str) -> Version:
    """'12.1' → (12, 1); versions compare as tuples, missing parts as 0."""
    parts = tuple(int(p) for p in text.split("."))
    return parts + (0,) * (3 - len(parts))


@dataclass(frozen=True)
class EngineRow:
    min_version: str
    max_version: str | None
    architectures: frozenset[str]
    weight_formats: frozenset[str]
    dtypes: frozenset[str]
    quantizations: frozenset[str]
    kv_cache_dtypes: frozenset[str]
    max_tensor_parallel: int
    gpu_architectures: frozenset[str]
    min_cuda: str
    min_driver: str

    def covers(self, version: str) -> bool:
        low_ok = parse_version(version) >= parse_version(self.min_version)
        high_ok = self.max_version is None or parse_version(version) < parse_version(
            self.max_version
        )
        return low_ok and high_ok

    @property
    def label(self) -> str:
        return f">={self.min_version}" + (f",<{self.max_version}" if self.max_version else "")


@dataclass(frozen=True)
class GPUArchitecture:
    name: str
    compute_capability: str
    generation: str
    min_cuda: str
    min_driver: str


@dataclass(frozen=True)
class Requirement:
    kind: str
    name: str
    min_compute_capability: str
    min_cuda: str | None
    min_driver: str | None
    why: str | None


@dataclass(frozen=True)
class GPUProduct:
    label: str
    architecture: str
    memory_bytes: int


@dataclass(frozen=True)
class ModelFamily:
    family: str
    tokenizer_sha256: frozenset[str]
    chat_template_sha256: frozenset[str]


@dataclass(frozen=True)
class Matrix:
    """The typed matrix. Lookups return None for unknown keys; the checker decides what to do."""

    version: str
    engines: tuple[EngineRow, ...]
    gpu_architectures: dict[str, GPUArchitecture]
    requirements: dict[tuple[str, str], Requirement]
    gpu_products: dict[str, GPUProduct]
    model_families: dict[str, ModelFamily]
    adapter_bases: dict[str, str]
    source: str

    def engine(self, version: str) -> EngineRow | None:
        return next((row for row in self.engines if row.covers(version)), None)


def _build(data: dict[str, Any], source: str) -> Matrix:
    engines = tuple(
        EngineRow(
            min_version=row["versions"]["min"],
            max_version=row["versions"].get("max"),
            architectures=frozenset(row["architectures"]),
            weight_formats=frozenset(row["weightFormats"]),
            dtypes=frozenset(row["dtypes"]),
            quantizations=frozenset(row["quantizations"]),
            kv_cache_dtypes=frozenset(row["kvCacheDtypes"]),
            max_tensor_parallel=row["maxTensorParallel"],
            gpu_architectures=frozenset(row["gpuArchitectures"]),
            min_cuda=row["minCuda"],
            min_driver=row["minDriver"],
        )
        for row in data["engines"]
    )
    archs = {
        a["name"]: GPUArchitecture(
            a["name"], a["computeCapability"], a["generation"], a["minCuda"], a["minDriver"]
        )
        for a in data["gpuArchitectures"]
    }
    requirements = {
        (r["kind"], r["name"]): Requirement(
            r["kind"],
            r["name"],
            r["minComputeCapability"],
            r.get("minCuda"),
            r.get("minDriver"),
            r.get("why"),
        )
        for r in data["requirements"]
    }
    products = {
        p["label"]: GPUProduct(p["label"], p["architecture"], parse_bytes(p["memory"]))
        for p in data["gpuProducts"]
    }
    for product in products.values():
        if product.architecture not in archs:
            raise MatrixError(
                f"{source}: gpuProducts {product.label}: architecture {product.architecture} "
                "is not listed under gpuArchitectures"
            )
    families = {
        f["family"]: ModelFamily(
            f["family"], frozenset(f["tokenizerSha256"]), frozenset(f.get("chatTemplateSha256", []))
        )
        for f in data["modelFamilies"]
    }
    adapters = {a["sha256"]: a["baseHash"] for a in data["adapters"]}
    return Matrix(
        data["version"], engines, archs, requirements, products, families, adapters, source
    )


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return schema


def matrix_from_dict(data: dict[str, Any], source: str = "<dict>") -> Matrix:
    """Validate `data` against the JSON Schema and type it."""
    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [
            f"  {'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
            for e in errors
        ]
        raise MatrixError(f"{source}: does not match {SCHEMA_PATH.name}:\n" + "\n".join(lines))
    return _build(data, source)


def load_matrix(path: Path | None = None) -> Matrix:
    """Load and validate the matrix file (default: $KVFLEET_COMPAT_MATRIX or the repo's)."""
    if path is None:
        env = os.environ.get(MATRIX_ENV)
        path = Path(env) if env else DEFAULT_MATRIX_PATH
    if not path.is_file():
        raise MatrixError(f"{path}: compatibility matrix not found; set ${MATRIX_ENV}")
    documents = load_yaml_documents(path.read_text(encoding="utf-8"), str(path))
    if len(documents) != 1:
        raise MatrixError(f"{path}: expected one YAML document, found {len(documents)}")
    return matrix_from_dict(documents[0], str(path))


@functools.cache
def default_matrix() -> Matrix:
    """The default matrix, loaded once per process."""
    return load_matrix()
