"""A ModelArtifact from an HF checkpoint folder: architecture, every file's digest, tokenizer
and chat-template hashes, special tokens.

Reads config.json, tokenizer_config.json, tokenizer.json and the safetensors headers as plain
JSON (the control plane never imports the engine, nor torch). The files listed are everything
the engine reads from the folder (weights, config, tokenizer, template), so `kvfleet artifact
fetch` brings all of them and the engine verifies each.

Hash definitions (what the engine compares at load, see kvfleet/engine/model/verify.py):
- tokenizer sha256 = sha256 of the tokenizer.json file's bytes;
- chat template sha256 = sha256 of the template text as UTF-8 (chat_template.jinja, else the
  `chat_template` string of tokenizer_config.json), as for GGUF files.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from kvfleet.api.gguf_artifact import file_sha256
from kvfleet.api.meta import API_VERSION
from kvfleet.api.modelartifact import ModelArtifact

# What the engine reads from a checkpoint folder (kvfleet/engine/model/hf_checkpoint.py,
# loader.py), besides the *.safetensors shards.
_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "chat_template.jinja", "special_tokens_map.json")
_DTYPES = ("float32", "float16", "bfloat16")
_TOKENIZER_TYPES = {"BPE": "gpt2", "Unigram": "unigram", "WordPiece": "wordpiece"}


class HFArtifactError(ValueError):
    """The folder lacks what a ModelArtifact needs; the message names the file and field."""


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFArtifactError(f"{path}: missing (an HF checkpoint folder needs config.json, "
                              "tokenizer.json, tokenizer_config.json and *.safetensors)") from None
    except (OSError, ValueError) as error:
        raise HFArtifactError(f"{path}: unreadable JSON ({error})") from None
    if not isinstance(data, dict):
        raise HFArtifactError(f"{path}: expected a JSON object")
    return data


def safetensors_parameters(path: Path) -> int:
    """Elements of every tensor in a safetensors file, from its header (8-byte length + JSON)."""
    with path.open("rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        header = json.loads(stream.read(length))
    total = 0
    for name, tensor in header.items():
        if name != "__metadata__":
            count = 1
            for size in tensor["shape"]:
                count *= int(size)
            total += count
    return total


def _token_id(token: Any, added: dict[str, int], vocab: dict[str, int]) -> int | None:
    text = token.get("content") if isinstance(token, dict) else token
    if not isinstance(text, str):
        return None
    return added.get(text, vocab.get(text))


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value] if isinstance(value, list) else []


def artifact_from_hf(directory: Path, *, name: str, family: str | None = None,
                     uri_base: str | None = None, engine_min_version: str = "0.1"
                     ) -> ModelArtifact:
    """Describe the checkpoint folder `directory` as a ModelArtifact named `name`; each file's
    URI is `uri_base`/NAME (default: its file:// URI)."""
    config = _json(directory / "config.json")
    tokenizer_config = _json(directory / "tokenizer_config.json")
    tokenizer = _json(directory / "tokenizer.json")
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise HFArtifactError(f"{directory}: no *.safetensors files")
    files = [*shards, *(directory / f for f in _FILES if (directory / f).is_file())]

    def uri(path: Path) -> str:
        return f"{uri_base.rstrip('/')}/{path.name}" if uri_base else path.resolve().as_uri()

    model = tokenizer.get("model") or {}
    raw_vocab = model.get("vocab")
    vocab: dict[str, int] = raw_vocab if isinstance(raw_vocab, dict) else {}
    added = {t["content"]: int(t["id"]) for t in tokenizer.get("added_tokens") or []
             if isinstance(t, dict) and "content" in t and "id" in t}
    # eos: config.json (or generation_config.json) ids first, as transformers' generate uses
    # them; the first is the eos, the rest also end generation (e.g. Qwen's <|im_end|>).
    generation = (_json(directory / "generation_config.json")
                  if (directory / "generation_config.json").is_file() else {})
    eos = _ids(generation.get("eos_token_id")) or _ids(config.get("eos_token_id"))
    template_eos = _token_id(tokenizer_config.get("eos_token"), added, vocab)
    if template_eos is not None and template_eos not in eos:
        eos.insert(0, template_eos)
    if not eos:
        raise HFArtifactError(f"{directory}: no eos token (config.json eos_token_id or "
                              "tokenizer_config.json eos_token)")
    bos = _token_id(tokenizer_config.get("bos_token"), added, vocab)
    if bos is None and _ids(config.get("bos_token_id")):
        bos = _ids(config.get("bos_token_id"))[0]
    pad = _token_id(tokenizer_config.get("pad_token"), added, vocab)

    template_file = directory / "chat_template.jinja"
    template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                else tokenizer_config.get("chat_template"))
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        max_context = int(config.get("max_position_embeddings", 2048))
        window = config.get("sliding_window")
        if config.get("model_type") == "mistral" and window:
            max_context = min(max_context, int(window))  # the engine caps it likewise
        architecture = {
            "name": str(config["model_type"]),
            "numLayers": int(config["num_hidden_layers"]),
            "hiddenSize": hidden,
            "numQueryHeads": heads,
            "numKVHeads": int(config.get("num_key_value_heads") or heads),
            "headDim": int(config.get("head_dim") or hidden // heads),
            "vocabSize": int(config["vocab_size"]),
            "maxContextLength": max_context,
            "numParameters": sum(map(safetensors_parameters, shards)),
            "intermediateSize": config.get("intermediate_size"),
        }
    except (KeyError, TypeError, ValueError) as error:
        raise HFArtifactError(f"{directory / 'config.json'}: {type(error).__name__} "
                              f"{error} (re-export with transformers' save_pretrained)") from None
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    spec: dict[str, Any] = {
        "family": family or str(config.get("model_type")),
        "weights": {"format": "safetensors", "files": [
            {"uri": uri(p), "sha256": file_sha256(p), "sizeBytes": p.stat().st_size}
            for p in files]},
        "tokenizer": {"type": _TOKENIZER_TYPES.get(str(model.get("type")), "gpt2"),
                      "sha256": file_sha256(directory / "tokenizer.json"),
                      "uri": uri(directory / "tokenizer.json")},
        "specialTokens": {k: v for k, v in {
            "bosTokenId": bos, "eosTokenId": eos[0], "padTokenId": pad,
            "stopTokenIds": eos[1:] or None}.items() if v is not None},
        "architecture": architecture,
        "dtype": dtype if dtype in _DTYPES else "float32",
        "engineVersions": {"min": engine_min_version},
    }
    if isinstance(template, str):
        spec["chatTemplate"] = {"sha256": hashlib.sha256(template.encode("utf-8")).hexdigest()}
        if template_file.is_file():
            spec["chatTemplate"]["uri"] = uri(template_file)
    data = {"apiVersion": API_VERSION, "kind": "ModelArtifact", "metadata": {"name": name},
            "spec": spec}
    return ModelArtifact.model_validate(data)
