"""Read an HF-layout checkpoint directory (config.json + *.safetensors + tokenizer files) of the
Llama family: `model_type` llama, mistral, qwen2 or qwen3 (see `ModelConfig` for what differs).

Refused with UnsupportedModelError rather than served wrong: RoPE scaling other than the
default, MLP biases, activations other than SiLU, and a sliding window on only some layers.
A sliding window on every layer (Mistral v0.1) caps the context at the window: a sequence
that never outgrows the window attends exactly as full attention does.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvfleet.engine.errors import ModelLoadError, UnsupportedModelError
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.gguf_file import ProgressCallback

log = logging.getLogger(__name__)

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_PREFIX = "model."
# HF tensor name (after `model.layers.N.`) -> the engine's name (after `layers.N.`).
_LAYER_RENAMES = {
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.bias": "o_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
}


@dataclass(frozen=True, slots=True)
class HFCheckpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer_json: Path
    tokenizer_config: dict[str, Any]


def _read_json(path: Path, directory: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelLoadError(
            directory,
            f"{path.name} is missing",
            "An HF checkpoint directory needs config.json, *.safetensors, "
            "tokenizer.json and tokenizer_config.json",
        ) from exc
    except (OSError, ValueError) as exc:
        raise ModelLoadError(path, f"unreadable JSON ({exc})", "Re-export the checkpoint") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object", "Re-export the checkpoint")
    return data


def _unsupported(directory: Path, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(directory / "config.json", what,
                                 "Serve a checkpoint without it, or file an issue naming the model")


def _rope_theta(raw: dict[str, Any], directory: Path) -> float:
    # transformers >= 5 writes `rope_parameters` ({rope_type, rope_theta}); older versions
    # write `rope_theta` and `rope_scaling` (null unless the model scales RoPE).
    parameters = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    kind = parameters.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if kind not in (None, "default"):
        raise _unsupported(directory, f"RoPE scaling {kind!r} is not implemented")
    return float(raw.get("rope_theta") or parameters.get("rope_theta") or 10000.0)


def _sliding_window(raw: dict[str, Any], arch: str, directory: Path) -> int | None:
    """The window every layer uses, or None for full attention everywhere."""
    window = int(raw["sliding_window"]) if raw.get("sliding_window") else None
    if arch not in ("qwen2", "qwen3"):  # Mistral's window, when set, is every layer's
        return window
    # Qwen carries a window that applies where `layer_types` (or, in older configs, the
    # `use_sliding_window` switch) says so.
    sliding = ({t == "sliding_attention" for t in raw["layer_types"]} if raw.get("layer_types")
               else {bool(raw.get("use_sliding_window"))})
    if sliding == {True}:
        return window
    if True in sliding:
        raise _unsupported(directory, "a sliding window on some layers only")
    return None


def _config(raw: dict[str, Any], directory: Path) -> ModelConfig:
    arch = raw.get("model_type")
    if arch not in MODEL_TYPES:
        raise UnsupportedModelError(
            directory,
            f"config.json model_type is {arch!r}",
            f"Use a checkpoint of model_type {', '.join(MODEL_TYPES)}",
        )
    if raw.get("mlp_bias"):
        raise _unsupported(directory, "mlp_bias (biases on the MLP projections)")
    if raw.get("hidden_act", "silu") != "silu":
        raise _unsupported(directory, f"hidden_act {raw['hidden_act']!r} (SwiGLU needs silu)")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        max_context = int(raw.get("max_position_embeddings", 2048))
        window = _sliding_window(raw, arch, directory)
        if window is not None and window < max_context:
            log.warning("%s: every layer attends over a sliding window of %d tokens; the "
                        "context is capped at %d (max_position_embeddings %d)", directory.name,
                        window, window, max_context)
            max_context = window
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=_rope_theta(raw, directory),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_context=max_context,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            name=str(raw.get("_name_or_path", directory.name)),
            quantization=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            # Qwen2's attention always has q/k/v biases and never an output one (its config has
            # no switch); elsewhere `attention_bias` puts a bias on all four projections.
            attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            output_bias=arch != "qwen2" and bool(raw.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
        )
    except KeyError as exc:
        raise ModelLoadError(
            directory / "config.json",
            f"key {exc.args[0]!r} is missing",
            "Re-export the checkpoint with transformers' save_pretrained",
        ) from exc
    except ValueError as exc:
        raise ModelLoadError(
            directory / "config.json", f"invalid hyperparameters ({exc})", "Fix config.json"
        ) from exc


def _internal_name(hf_name: str) -> str | None:
    if hf_name == "lm_head.weight":
        return "lm_head"
    name = hf_name.removeprefix(_PREFIX)
    if name in ("embed_tokens.weight", "norm.weight"):
        return name.removesuffix(".weight")
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER_RENAMES:
        return f"layers.{int(parts[1])}.{_LAYER_RENAMES[parts[2]]}"
    return None


def read_hf_checkpoint(directory: Path, progress: ProgressCallback | None = None) -> HFCheckpoint:
    from safetensors import SafetensorError, safe_open

    config = _config(_read_json(directory / "config.json", directory), directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            directory,
            "no *.safetensors weight files",
            "Save the checkpoint with safe_serialization=True",
        )
    weights: dict[str, torch.Tensor] = {}
    for index, file in enumerate(files):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    name = _internal_name(key)
                    if name is not None:
                        # As stored: the model casts each to its dtype on its device.
                        weights[name] = handle.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(
                file,
                f"unreadable safetensors file ({exc})",
                "The file is truncated or corrupt; re-download it",
            ) from exc
        if progress is not None:
            progress(index + 1, len(files))
    tokenizer_config = _read_json(directory / "tokenizer_config.json", directory)
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ModelLoadError(
            directory,
            "tokenizer.json is missing",
            "Save the tokenizer next to the weights (tokenizer.save_pretrained)",
        )
    return HFCheckpoint(
        config=config,
        weights=weights,
        tokenizer_json=tokenizer_json,
        tokenizer_config=tokenizer_config,
    )
