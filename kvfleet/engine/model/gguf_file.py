"""Read a llama.cpp GGUF file: hyperparameters, dequantized float32 weights, tokenizer metadata.

GGUF stores each tensor with its shape reversed (ggml order); `gguf.quants.dequantize`
returns numpy arrays already in row-major [out, in] order, which is what `torch.nn.functional
.linear` wants. llama.cpp's converter permutes the rows of the Q and K projections so its
RoPE can rotate adjacent pairs; we undo that permutation (as HF's GGUF loader does) so the
model uses the rotate-half RoPE of the original checkpoint and matches HF numerically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvfleet.engine.errors import ModelLoadError, UnsupportedModelError
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.gguf_reader import GGUFFile, TensorInfo
from kvfleet.engine.packed_matmul import QUANT_BLOCK_BYTES, QuantBlocks
from kvfleet.engine.tokenizer import GGUFTokenizerSpec

SUPPORTED_ARCHITECTURES = frozenset({"llama"})
# Types we dequantize. The required set is F32/F16/BF16/Q4_0/Q4_1/Q8_0; the K-quants are
# dequantized by the same `gguf` routine and are common in published files.
SUPPORTED_TENSOR_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
)

_CORRUPT_REMEDY = "The file is truncated or corrupt; re-download it and check its sha256"

# GGUF tensor name (within a block) -> internal weight name (see `LlamaWeights`).
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}

ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class GGUFContents:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer_spec: GGUFTokenizerSpec
    chat_template: str | None
    # The matrices stored as Q4_1 or Q8_0 (layer matrices, embedding, LM head), as their raw
    # blocks (Q/K rows unpermuted like `weights`), for the engine's quantized matmul (see
    # `packed_matmul`).
    quant_blocks: dict[str, QuantBlocks]


def _field(metadata: dict[str, Any], key: str, path: Path, default: Any = ...) -> Any:
    if key not in metadata:
        if default is ...:
            raise ModelLoadError(
                path,
                f"metadata key {key!r} is missing",
                "Re-convert the model with a current llama.cpp convert_hf_to_gguf.py",
            )
        return default
    return metadata[key]


def _read_config(
    meta: dict[str, Any], path: Path, has_output: bool, quantization: str
) -> ModelConfig:
    arch = _field(meta, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            path,
            f"architecture {arch!r} is not supported",
            f"Use a model of architecture {sorted(SUPPORTED_ARCHITECTURES)}",
        )
    hidden = int(_field(meta, f"{arch}.embedding_length", path))
    num_heads = int(_field(meta, f"{arch}.attention.head_count", path))
    tokens = _field(meta, "tokenizer.ggml.tokens", path, [])
    vocab = int(_field(meta, f"{arch}.vocab_size", path, len(tokens)))
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(_field(meta, f"{arch}.feed_forward_length", path)),
            num_layers=int(_field(meta, f"{arch}.block_count", path)),
            num_heads=num_heads,
            num_kv_heads=int(_field(meta, f"{arch}.attention.head_count_kv", path, num_heads)),
            head_dim=int(_field(meta, f"{arch}.attention.key_length", path, hidden // num_heads)),
            rope_theta=float(_field(meta, f"{arch}.rope.freq_base", path, 10000.0)),
            rms_norm_eps=float(
                _field(meta, f"{arch}.attention.layer_norm_rms_epsilon", path, 1e-5)
            ),
            max_context=int(_field(meta, f"{arch}.context_length", path)),
            tie_word_embeddings=not has_output,
            name=str(_field(meta, "general.name", path, "")),
            quantization=quantization,
        )
    except (ValueError, ZeroDivisionError) as exc:
        raise ModelLoadError(
            path, f"inconsistent hyperparameters ({exc})", _CORRUPT_REMEDY
        ) from exc


def _internal_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[1] == "weight" and parts[0] in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[parts[0]]
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[3] == "weight"
        and parts[2] in _BLOCK_TENSORS
    ):
        return f"layers.{int(parts[1])}.{_BLOCK_TENSORS[parts[2]]}"
    return None  # e.g. rope_freqs: derived from the metadata instead


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K row permutation (pairs -> halves within each head)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )


def _dequantize(file: GGUFFile, tensor: TensorInfo) -> torch.Tensor:
    from gguf.quants import dequantize

    type_name = tensor.ggml_type.name
    if type_name not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedModelError(
            file.path,
            f"tensor {tensor.name!r} has type {type_name}",
            f"Use a file quantized as one of {sorted(SUPPORTED_TENSOR_TYPES)}",
        )
    try:
        array = dequantize(file.raw(tensor), tensor.ggml_type)
    except (ValueError, NotImplementedError) as exc:
        raise ModelLoadError(
            file.path, f"cannot dequantize tensor {tensor.name!r} ({exc})", _CORRUPT_REMEDY
        ) from exc
    # np.array copies out of the read-only memory map; torch warns on non-writable buffers.
    return torch.from_numpy(np.array(array, dtype=np.float32).reshape(tensor.shape))


def _iter_weights(
    file: GGUFFile, config: ModelConfig, progress: ProgressCallback | None
) -> Iterator[tuple[str, torch.Tensor, QuantBlocks | None]]:
    """(name, float32 weight, raw blocks of a matrix the quantized matmul takes, or None)."""
    for index, tensor in enumerate(file.tensors):
        name = _internal_name(tensor.name)
        if name is not None:
            weight = _dequantize(file, tensor)
            raw = None
            if weight.dim() == 2 and tensor.ggml_type.name in QUANT_BLOCK_BYTES:
                rows = torch.from_numpy(np.array(file.raw(tensor), dtype=np.uint8))
                raw = QuantBlocks(tensor.ggml_type.name, rows.reshape(weight.shape[0], -1))
            if name.endswith((".q_proj", ".k_proj")):
                heads = config.num_heads if name.endswith(".q_proj") else config.num_kv_heads
                weight = _unpermute_rope_rows(weight, heads)
                if raw is not None:
                    raw = QuantBlocks(raw.ggml_type, _unpermute_rope_rows(raw.rows, heads))
            yield name, weight, raw
        if progress is not None:
            progress(index + 1, len(file.tensors))


def read_gguf(path: Path, progress: ProgressCallback | None = None) -> GGUFContents:
    """Everything needed to run the model in `path`; ModelLoadError if anything is off."""
    file = GGUFFile(path)
    meta = file.metadata
    names = {t.name for t in file.tensors}
    type_counts: dict[str, int] = {}
    for tensor in file.tensors:
        type_counts[tensor.ggml_type.name] = type_counts.get(tensor.ggml_type.name, 0) + 1
    quantization = max(type_counts, key=lambda k: type_counts[k]) if type_counts else "none"
    config = _read_config(
        meta, path, has_output="output.weight" in names, quantization=quantization
    )
    weights: dict[str, torch.Tensor] = {}
    quant_blocks: dict[str, QuantBlocks] = {}
    for name, weight, raw in _iter_weights(file, config, progress):
        weights[name] = weight
        if raw is not None:
            quant_blocks[name] = raw
    tokenizer_spec = read_tokenizer_spec(meta, path)
    template = _field(meta, "tokenizer.chat_template", path, None)
    return GGUFContents(
        config=config,
        weights=weights,
        tokenizer_spec=tokenizer_spec,
        chat_template=str(template) if template is not None else None,
        quant_blocks=quant_blocks,
    )


def read_tokenizer_spec(meta: dict[str, Any], path: Path) -> GGUFTokenizerSpec:
    """The tokenizer in a GGUF file's metadata (no tensor is read)."""
    return GGUFTokenizerSpec(
        model=str(_field(meta, "tokenizer.ggml.model", path)),
        tokens=list(_field(meta, "tokenizer.ggml.tokens", path)),
        token_types=list(_field(meta, "tokenizer.ggml.token_type", path, [])),
        merges=list(_field(meta, "tokenizer.ggml.merges", path, [])),
        bos_token_id=_optional_int(_field(meta, "tokenizer.ggml.bos_token_id", path, None)),
        eos_token_id=_optional_int(_field(meta, "tokenizer.ggml.eos_token_id", path, None)),
        add_bos_token=bool(_field(meta, "tokenizer.ggml.add_bos_token", path, False)),
        pre=_field(meta, "tokenizer.ggml.pre", path, None),
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
