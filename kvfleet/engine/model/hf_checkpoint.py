"""Read an HF-layout Llama checkpoint directory (config.json + *.safetensors + tokenizer files)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvfleet.engine.errors import ModelLoadError, UnsupportedModelError
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.gguf_file import ProgressCallback

_PREFIX = "model."
_LAYER_RENAMES = {
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "o_proj",
    "mlp.gate_proj": "gate_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "down_proj",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
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


def _config(raw: dict[str, Any], directory: Path) -> ModelConfig:
    arch = raw.get("model_type")
    if arch != "llama":
        raise UnsupportedModelError(
            directory,
            f"config.json model_type is {arch!r}",
            "Use a Llama-family checkpoint (model_type 'llama')",
        )
    rope_theta = raw.get(
        "rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    )
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        return ModelConfig(
            architecture="llama",
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_context=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            name=str(raw.get("_name_or_path", directory.name)),
            quantization=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
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
    if not hf_name.endswith(".weight"):
        return None
    name = hf_name.removesuffix(".weight")
    if name == "lm_head":
        return "lm_head"
    name = name.removeprefix(_PREFIX)
    if name in ("embed_tokens", "norm"):
        return name
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
                        weights[name] = handle.get_tensor(key).float()
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
