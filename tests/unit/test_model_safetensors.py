"""Loading an HF-layout checkpoint directory (config.json + safetensors + tokenizer files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_llama import CHAT_TEMPLATE, MERGES, random_weights, tiny_config, vocab_tokens

from kvfleet.engine.errors import ModelLoadError, UnsupportedModelError
from kvfleet.engine.model import load_model
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.tokenizer import GGUFTokenizerSpec, Tokenizer

_HF_NAMES = {
    "input_layernorm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "post_attention_layernorm": "post_attention_layernorm",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


def hf_name(name: str) -> str:
    if name == "lm_head":
        return "lm_head.weight"
    if name in ("embed_tokens", "norm"):
        return f"model.{name}.weight"
    _, layer, short = name.split(".")
    return f"model.layers.{layer}.{_HF_NAMES[short]}.weight"


def write_checkpoint(
    directory: Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    *,
    model_type: str = "llama",
    extra: dict[str, object] | None = None,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    hf_config = {
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_context,
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": "float32",
        **(extra or {}),
    }
    (directory / "config.json").write_text(json.dumps(hf_config))
    # Two shards, as large checkpoints have.
    names = sorted(weights)
    half = len(names) // 2
    for index, shard in enumerate((names[:half], names[half:])):
        save_file(
            {hf_name(n): weights[n].contiguous() for n in shard},
            str(directory / f"model-{index + 1:05d}-of-00002.safetensors"),
        )
    tokens, types = vocab_tokens()
    tokenizer = Tokenizer.from_gguf(
        GGUFTokenizerSpec(
            model="gpt2",
            tokens=tokens,
            token_types=types,
            merges=MERGES,
            bos_token_id=1,
            eos_token_id=2,
            add_bos_token=False,
        ),
        "tiny",
    )
    tokenizer.save(directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": {"content": "<|im_end|>"},
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return directory


def test_checkpoint_dir_loads_weights_tokenizer_and_template(tmp_path: Path) -> None:
    config = tiny_config(tie_word_embeddings=False)
    weights = random_weights(config)
    loaded = load_model(write_checkpoint(tmp_path / "ckpt", config, weights), show_progress=False)
    assert loaded.config.num_kv_heads == config.num_kv_heads
    assert loaded.config.tie_word_embeddings is False
    model = loaded.model
    assert torch.equal(model.lm_head, weights["lm_head"])
    q, k, v = (weights[f"layers.1.{n}"] for n in ("q_proj", "k_proj", "v_proj"))
    assert torch.equal(model.qkv_t[1], torch.cat([q, k, v]).t())  # no RoPE permutation here
    assert (loaded.tokenizer.bos_token_id, loaded.tokenizer.eos_token_id) == (1, 2)
    assert loaded.tokenizer.encode("<|im_start|>hello") == [
        1,
        loaded.tokenizer.token_to_id("hello"),
    ]
    assert loaded.chat_template is not None
    assert loaded.chat_template.render([{"role": "user", "content": "x"}]).endswith("assistant\n")
    assert len(loaded.revision) == 64


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json is missing"):
        load_model(tmp_path, show_progress=False)


def test_unsupported_model_type(tmp_path: Path) -> None:
    config = tiny_config()
    directory = write_checkpoint(
        tmp_path / "gpt2", config, random_weights(config), model_type="gpt2"
    )
    with pytest.raises(UnsupportedModelError, match="model_type is 'gpt2'"):
        load_model(directory, show_progress=False)


def test_corrupt_safetensors_shard(tmp_path: Path) -> None:
    config = tiny_config()
    directory = write_checkpoint(tmp_path / "ckpt", config, random_weights(config))
    shard = next(directory.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="truncated or corrupt") as info:
        load_model(directory, show_progress=False)
    assert info.value.path == str(shard)


@pytest.mark.parametrize(("model_type", "extra", "named"), [
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling 'llama3'"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "RoPE scaling 'yarn'"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64,
               "layer_types": ["full_attention", "sliding_attention"]}, "some layers only"),
])
def test_what_the_engine_would_serve_wrong_is_refused_by_name(
        tmp_path: Path, model_type: str, extra: dict[str, object], named: str) -> None:
    config = tiny_config()
    directory = write_checkpoint(tmp_path / "ckpt", config, random_weights(config),
                                 model_type=model_type, extra=extra)
    with pytest.raises(UnsupportedModelError, match=named):
        load_model(directory, show_progress=False)


def test_a_missing_bias_names_the_tensor(tmp_path: Path) -> None:
    """Qwen2 always has q/k/v biases: a checkpoint without them is incomplete, not Llama."""
    config = tiny_config()
    directory = write_checkpoint(tmp_path / "ckpt", config, random_weights(config),
                                 model_type="qwen2")
    with pytest.raises(ModelLoadError, match=r"'layers\.0\.q_bias' is missing"):
        load_model(directory, show_progress=False)


def test_a_16_bit_checkpoint_is_built_in_the_dtype_asked_for(tmp_path: Path) -> None:
    """Stored bfloat16: float32 on the CPU by default, bfloat16 when asked (as on a GPU),
    each tensor cast once from the file's dtype."""
    config = tiny_config(tie_word_embeddings=False)
    weights = {k: v.to(torch.bfloat16) for k, v in random_weights(config).items()}
    directory = write_checkpoint(tmp_path / "ckpt", config, weights)
    default = load_model(directory, show_progress=False)
    assert default.model.embed_tokens.dtype == torch.float32
    assert torch.equal(default.model.lm_head, weights["lm_head"].float())
    half = load_model(directory, show_progress=False, dtype="bfloat16")
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    assert torch.equal(half.model.lm_head, weights["lm_head"])
