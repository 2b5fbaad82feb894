"""Builders for a tiny random-weight Llama: its config, weights, and a GGUF file of it.

The GGUF is written the way llama.cpp's converter writes one (Q/K rows permuted for its RoPE,
quantized tensors, byte-level BPE vocabulary in the metadata), so the loader's real code
paths run in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from kvfleet.engine.model.config import ModelConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Merges in rank order; each merged token is added to the vocabulary after the byte alphabet.
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_alphabet() -> list[str]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return [chr(c) for c in chars]


def vocab_tokens() -> tuple[list[str], list[int]]:
    """Tokens and llama.cpp token types (3 = control, 1 = normal) of the tiny vocabulary."""
    tokens = [*SPECIAL_TOKENS, *_byte_alphabet(), *(m.replace(" ", "") for m in MERGES)]
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types


def tiny_config(*, tie_word_embeddings: bool = True, num_layers: int = 2) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=len(vocab_tokens()[0]),
        hidden_size=64,
        intermediate_size=96,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_context=256,
        tie_word_embeddings=tie_word_embeddings,
        name="tiny",
    )


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Internal-name weights with a scale that keeps activations O(1) through the layers."""
    gen = torch.Generator().manual_seed(seed)
    h, q, kv, f = (
        config.hidden_size,
        config.num_heads * config.head_dim,
        config.kv_dim,
        config.intermediate_size,
    )

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    weights = {
        "embed_tokens": rand(config.vocab_size, h, scale=1.0),
        "norm": 1.0 + rand(h, scale=0.1),
    }
    if not config.tie_word_embeddings:
        weights["lm_head"] = rand(config.vocab_size, h, scale=h**-0.5)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        weights |= {
            p + "input_layernorm": 1.0 + rand(h, scale=0.1),
            p + "q_proj": rand(q, h, scale=h**-0.5),
            p + "k_proj": rand(kv, h, scale=h**-0.5),
            p + "v_proj": rand(kv, h, scale=h**-0.5),
            p + "o_proj": rand(h, q, scale=q**-0.5),
            p + "post_attention_layernorm": 1.0 + rand(h, scale=0.1),
            p + "gate_proj": rand(f, h, scale=h**-0.5),
            p + "up_proj": rand(f, h, scale=h**-0.5),
            p + "down_proj": rand(h, f, scale=f**-0.5),
        }
    return weights


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's Q/K row permutation."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
Q = gguf.GGMLQuantizationType


def default_quant_types() -> dict[str, gguf.GGMLQuantizationType]:
    """A mix like a real file: Q8_0 embedding, Q4_0/Q4_1 projections, F16 somewhere, F32 norms."""
    return {
        "embed_tokens": Q.Q8_0,
        "layers.0.q_proj": Q.Q4_0,
        "layers.0.k_proj": Q.Q4_1,
        "layers.0.down_proj": Q.Q4_1,
        "layers.1.up_proj": Q.F16,
        "layers.1.o_proj": Q.BF16,
        "layers.0.gate_proj": Q.Q8_0,
    }


def quantized_roundtrip(
    weights: dict[str, torch.Tensor], qtypes: dict[str, gguf.GGMLQuantizationType]
) -> dict[str, torch.Tensor]:
    """What the loader must return for `weights` written with `qtypes`."""
    out = {}
    for name, w in weights.items():
        qtype = qtypes.get(name, Q.F32)
        data = gguf.quants.quantize(w.numpy().astype(np.float32), qtype)
        out[name] = torch.from_numpy(
            np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(w.shape)
        )
    return out


def write_gguf(
    path: Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
    *,
    architecture: str = "llama",
    skip_tensors: tuple[str, ...] = (),
    chat_template: str | None = CHAT_TEMPLATE,
) -> Path:
    qtypes = default_quant_types() if qtypes is None else qtypes
    writer = gguf.GGUFWriter(str(path), architecture)
    arch = architecture
    writer.add_name(config.name)
    writer.add_uint32(f"{arch}.block_count", config.num_layers)
    writer.add_uint32(f"{arch}.context_length", config.max_context)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config.num_kv_heads)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_uint32(f"{arch}.vocab_size", config.vocab_size)
    tokens, types = vocab_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, tensor in weights.items():
        parts = name.split(".")
        if name == "embed_tokens":
            gguf_name = "token_embd.weight"
        elif name == "norm":
            gguf_name = "output_norm.weight"
        elif name == "lm_head":
            gguf_name = "output.weight"
        else:
            gguf_name = f"blk.{parts[1]}.{_GGUF_NAMES[parts[2]]}.weight"
        if gguf_name in skip_tensors:
            continue
        array = tensor.numpy().astype(np.float32)
        if parts[-1] == "q_proj":
            array = llama_cpp_permute(array, config.num_heads)
        elif parts[-1] == "k_proj":
            array = llama_cpp_permute(array, config.num_kv_heads)
        qtype = qtypes.get(name, Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(gguf_name, array)
        elif qtype == Q.I8:  # an integer tensor: valid GGUF, but no weight format we run
            writer.add_tensor(gguf_name, (array * 100).astype(np.int8))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
