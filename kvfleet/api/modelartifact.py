"""ModelArtifact: an immutable, hashed manifest of everything that makes a model servable.

The spec is immutable once created (a CEL rule on `spec`), so a new model version is a new
object and `status.manifestHash` (see kvfleet.api.manifest) identifies exactly what is served.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from kvfleet.api.meta import (
    SHA256_PATTERN,
    Condition,
    CRDNames,
    KubeModel,
    ObjectMeta,
    PrinterColumn,
    age_column,
    cel,
    conditions_field,
    ready_column,
)


class WeightFormat(StrEnum):
    GGUF = "gguf"
    SAFETENSORS = "safetensors"


class DType(StrEnum):
    """Element types of weights, activations and KV cache."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FP8 = "fp8"


DTYPE_BYTES: dict[DType, float] = {
    DType.FLOAT32: 4,
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.FP8: 1,
}


class QuantizationMethod(StrEnum):
    GGUF_Q4_0 = "gguf-q4_0"
    GGUF_Q4_1 = "gguf-q4_1"
    GGUF_Q8_0 = "gguf-q8_0"
    AWQ = "awq"
    GPTQ = "gptq"
    FP8 = "fp8"


class WeightFile(KubeModel):
    """One weight file, pinned by content."""

    uri: str = Field(
        min_length=1,
        description="Where the file is fetched from: file://, s3://, https://, or "
        "pkg://PACKAGE/FILE for a file shipped inside an installed Python package.",
    )
    sha256: str = Field(pattern=SHA256_PATTERN, description="Lower-case hex sha256 of the file.")
    size_bytes: int = Field(ge=1, description="File size in bytes; checked before hashing.")


class Weights(KubeModel):
    """The weight files and their container format."""

    format: WeightFormat = Field(description="File format of the weights.")
    files: list[WeightFile] = Field(
        min_length=1, max_length=256, description="Weight files, in load order."
    )


class Tokenizer(KubeModel):
    """The tokenizer, pinned by the hash of its canonical content."""

    type: str = Field(
        min_length=1, max_length=64, description="Tokenizer model, e.g. gpt2 (BPE), llama (SPM)."
    )
    sha256: str = Field(
        pattern=SHA256_PATTERN,
        description="sha256 of the tokenizer content (vocabulary, merges, token types).",
    )
    uri: str | None = Field(
        default=None, description="Separate tokenizer file, if not embedded in the weights."
    )


class ChatTemplate(KubeModel):
    """The chat template (Jinja) the server renders messages with."""

    sha256: str = Field(pattern=SHA256_PATTERN, description="sha256 of the template text (UTF-8).")
    uri: str | None = Field(
        default=None, description="Separate template file, if not embedded in the weights."
    )


class SpecialTokens(KubeModel):
    """Ids of the special tokens and the tokens that end generation."""

    bos_token_id: int | None = Field(default=None, ge=0, description="Beginning of sequence.")
    eos_token_id: int = Field(ge=0, description="End of sequence.")
    pad_token_id: int | None = Field(default=None, ge=0, description="Padding.")
    unk_token_id: int | None = Field(default=None, ge=0, description="Unknown token.")
    stop_token_ids: list[int] = Field(
        default_factory=list,
        max_length=64,
        description="Extra token ids that end generation (besides eos), e.g. <|im_end|>.",
    )


class Architecture(KubeModel):
    """Transformer shape: what the engine builds and what the capacity planner needs."""

    name: str = Field(
        min_length=1, max_length=64, description="Architecture family, e.g. llama, qwen3."
    )
    num_layers: int = Field(ge=1, le=1024, description="Number of transformer blocks.")
    hidden_size: int = Field(ge=1, description="Model (residual stream) width.")
    num_query_heads: int = Field(ge=1, description="Attention query heads.")
    num_kv_heads: int = Field(
        ge=1,
        alias="numKVHeads",
        description="Key/value heads (fewer than query heads under grouped-query attention).",
    )
    head_dim: int = Field(ge=1, description="Width of one attention head.")
    vocab_size: int = Field(ge=1, description="Vocabulary size.")
    max_context_length: int = Field(ge=1, description="Longest sequence the model was trained for.")
    num_parameters: int | None = Field(
        default=None, ge=1, description="Total parameter count (for the weight-memory ledger)."
    )
    intermediate_size: int | None = Field(default=None, ge=1, description="MLP width.")

    @model_validator(mode="after")
    def _heads_group(self) -> Architecture:
        if self.num_query_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"numQueryHeads ({self.num_query_heads}) must be a multiple of numKVHeads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        return self


class Quantization(KubeModel):
    """How the weights were quantized, when they were."""

    method: QuantizationMethod = Field(description="Quantization method.")
    bits: int | None = Field(default=None, ge=1, le=16, description="Bits per quantized weight.")
    group_size: int | None = Field(
        default=None, ge=1, description="Weights sharing one scale (and zero point)."
    )
    calibration_set_id: str | None = Field(
        default=None, description="Id of the calibration data set used (AWQ, GPTQ, FP8)."
    )


class Adapter(KubeModel):
    """A LoRA adapter served on top of this artifact's base weights."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="Adapter name.")
    uri: str = Field(min_length=1, description="Where the adapter is fetched from.")
    sha256: str = Field(pattern=SHA256_PATTERN, description="sha256 of the adapter file.")
    base_hash: str = Field(
        pattern=SHA256_PATTERN,
        description="Base manifest hash (manifest hash of this spec without adapters) the "
        "adapter was trained on; it must match.",
    )
    rank: int | None = Field(default=None, ge=1, le=1024, description="LoRA rank.")


class SamplingDefaults(KubeModel):
    """Sampling parameters used when a request does not set them."""

    temperature: float | None = Field(default=None, ge=0, le=2, description="Temperature.")
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int | None = Field(default=None, ge=0, description="Top-k (0 disables).")
    max_tokens: int | None = Field(default=None, ge=1, description="Default output cap.")


class Capabilities(KubeModel):
    """What the model can do, as advertised to clients."""

    json_mode: bool = Field(default=False, alias="json", description="Structured JSON output.")
    tools: bool = Field(default=False, description="Tool / function calling.")
    max_context_length: int | None = Field(
        default=None, ge=1, description="Longest context served (defaults to the architecture's)."
    )


class EngineVersionRange(KubeModel):
    """Engine versions this artifact is known to run on: min inclusive, max exclusive."""

    min: str = Field(pattern=r"^[0-9]+\.[0-9]+(\.[0-9]+)?$", description="Lowest engine version.")
    max: str | None = Field(
        default=None,
        pattern=r"^[0-9]+\.[0-9]+(\.[0-9]+)?$",
        description="First engine version no longer supported (exclusive).",
    )


class ModelArtifactSpec(KubeModel):
    """Everything that makes a model servable. Immutable: a new version is a new object."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self == oldSelf", "spec is immutable; create a new ModelArtifact instead"),
            ]
        }
    )

    family: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        max_length=63,
        description="Model family (e.g. smollm2, qwen3): selects the expected tokenizer and "
        "chat-template hashes in the compatibility matrix.",
    )
    weights: Weights = Field(description="Weight files.")
    tokenizer: Tokenizer = Field(description="Tokenizer.")
    chat_template: ChatTemplate | None = Field(default=None, description="Chat template.")
    special_tokens: SpecialTokens = Field(description="Special and stop tokens.")
    architecture: Architecture = Field(description="Transformer shape.")
    dtype: DType = Field(description="Compute dtype (and weight dtype when not quantized).")
    quantization: Quantization | None = Field(default=None, description="Weight quantization.")
    adapters: list[Adapter] = Field(default_factory=list, max_length=64, description="Adapters.")
    sampling_defaults: SamplingDefaults | None = Field(
        default=None, description="Default sampling."
    )
    capabilities: Capabilities | None = Field(default=None, description="Advertised capabilities.")
    engine_versions: EngineVersionRange = Field(description="Required engine versions.")
    gpu_architectures: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="GPU architectures the artifact is qualified on (e.g. sm89, sm90); empty "
        "means any the compatibility matrix allows for its dtype and quantization.",
        json_schema_extra={"items": {"type": "string", "pattern": r"^sm[0-9]{2,3}$"}},
    )


class ModelArtifactStatus(KubeModel):
    """What the operator verified about the artifact."""

    manifest_hash: str | None = Field(
        default=None, pattern=SHA256_PATTERN, description="sha256 of the canonical spec JSON."
    )
    matrix_version: str | None = Field(
        default=None, description="Compatibility matrix version of the last check."
    )
    observed_generation: int | None = Field(default=None, ge=0, description="Generation seen.")
    conditions: list[Condition] = conditions_field()


class ModelArtifact(KubeModel):
    """An immutable, hashed manifest of everything that makes a model servable: weight files,
    tokenizer, chat template, architecture, dtype, quantization, adapters. A new model version
    is a new ModelArtifact; status.manifestHash identifies exactly what is served."""

    crd: ClassVar[CRDNames] = CRDNames(
        plural="modelartifacts",
        short_names=("ma", "artifact"),
        printer_columns=(
            PrinterColumn("Family", ".spec.family"),
            PrinterColumn("Arch", ".spec.architecture.name"),
            PrinterColumn("DType", ".spec.dtype"),
            PrinterColumn("Hash", ".status.manifestHash", priority=1),
            ready_column(),
            age_column(),
        ),
    )

    api_version: Literal["kvfleet.io/v1alpha1"] = Field(
        default="kvfleet.io/v1alpha1", description="kvfleet.io/v1alpha1"
    )
    kind: Literal["ModelArtifact"] = Field(default="ModelArtifact", description="ModelArtifact")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: ModelArtifactSpec = Field(description="The artifact manifest.")
    status: ModelArtifactStatus | None = Field(default=None, description="Observed state.")
