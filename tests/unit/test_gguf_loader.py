"""GGUF loading on a tiny generated file: weights, hyperparameters, tokenizer, typed errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from tiny_llama import (
    CHAT_TEMPLATE,
    default_quant_types,
    quantized_roundtrip,
    random_weights,
    tiny_config,
    write_gguf,
)

from kvfleet.engine.errors import ModelLoadError, UnsupportedModelError
from kvfleet.engine.model import default_model_path, load_model
from kvfleet.engine.model.gguf_file import read_gguf
from kvfleet.engine.model.loader import file_sha256


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tiny_config()
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", config, random_weights(config))


def test_weights_dequantize_and_unpermute_to_the_original_layout(tiny_gguf: Path) -> None:
    config = tiny_config()
    expected = quantized_roundtrip(random_weights(config), default_quant_types())
    contents = read_gguf(tiny_gguf)
    assert set(contents.weights) == set(expected)
    for name, tensor in expected.items():
        loaded = contents.weights[name]
        assert loaded.dtype == torch.float32
        # Exact: the loader must undo llama.cpp's Q/K permutation, not approximate it.
        assert torch.equal(loaded, tensor), name


def test_quantized_tensors_are_close_to_the_float_weights(tiny_gguf: Path) -> None:
    original = random_weights(tiny_config())
    loaded = read_gguf(tiny_gguf).weights
    # Q4 keeps ~3 significant bits per weight; anything else means a wrong block layout.
    for name in ("layers.0.q_proj", "layers.0.k_proj", "embed_tokens", "layers.1.up_proj"):
        error = (loaded[name] - original[name]).abs().max() / original[name].abs().max()
        assert error < 0.15, name
    assert torch.equal(loaded["layers.1.input_layernorm"], original["layers.1.input_layernorm"])


def test_hyperparameters_come_from_metadata(tiny_gguf: Path) -> None:
    config = read_gguf(tiny_gguf).config
    expected = tiny_config()
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "max_context",
        "tie_word_embeddings",
    ):
        assert getattr(config, field) == getattr(expected, field), field
    assert config.rope_theta == pytest.approx(expected.rope_theta)
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps)
    assert config.quantization == "F32"  # norms/most tensors in the tiny file are F32


def test_untied_output_weight_is_used(tmp_path: Path) -> None:
    config = tiny_config(tie_word_embeddings=False)
    weights = random_weights(config)
    loaded = load_model(write_gguf(tmp_path / "untied.gguf", config, weights), show_progress=False)
    assert loaded.config.tie_word_embeddings is False
    assert torch.equal(loaded.model.lm_head, weights["lm_head"])
    assert loaded.model.lm_head is not loaded.model.embed_tokens


def test_load_model_builds_tokenizer_and_chat_template(tiny_gguf: Path) -> None:
    progress: list[tuple[int, int]] = []
    loaded = load_model(tiny_gguf, progress=lambda done, total: progress.append((done, total)))
    assert progress and progress[-1][0] == progress[-1][1]
    tok = loaded.tokenizer
    assert tok.encode("hello world") == [tok.token_to_id("hello"), tok.token_to_id("Ġworld")]
    assert tok.encode("<|im_start|>hello<|im_end|>") == [1, tok.token_to_id("hello"), 2]
    assert tok.decode(tok.encode("héllo wörld ✓")) == "héllo wörld ✓"
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token) == (1, 2, "<|im_end|>")
    assert loaded.chat_template is not None
    assert loaded.chat_template.source == CHAT_TEMPLATE
    assert loaded.revision == file_sha256(tiny_gguf)


def test_default_model_path_points_at_the_embedded_smollm2() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"


# --- bad input -------------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no-such\.gguf.*no such file"):
        load_model(tmp_path / "no-such.gguf", show_progress=False)


def test_not_a_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_text("definitely not a model\n")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(bogus, show_progress=False)


def test_empty_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(empty, show_progress=False)


@pytest.mark.parametrize("keep_fraction", [0.05, 0.5, 0.97])
def test_truncated_gguf(tiny_gguf: Path, tmp_path: Path, keep_fraction: float) -> None:
    data = tiny_gguf.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(ModelLoadError, match="truncated or corrupt") as info:
        load_model(truncated, show_progress=False)
    assert info.value.path == str(truncated)


def test_corrupt_header(tiny_gguf: Path, tmp_path: Path) -> None:
    data = bytearray(tiny_gguf.read_bytes())
    data[8:16] = (2**62).to_bytes(8, "little")  # absurd tensor count
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_model(corrupt, show_progress=False)


def test_unsupported_architecture(tmp_path: Path) -> None:
    config = tiny_config()
    path = write_gguf(tmp_path / "mamba.gguf", config, random_weights(config), architecture="mamba")
    with pytest.raises(UnsupportedModelError, match="architecture 'mamba' is not supported"):
        load_model(path, show_progress=False)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    config = tiny_config()
    path = write_gguf(
        tmp_path / "int8.gguf",
        config,
        random_weights(config),
        {"layers.0.v_proj": gguf.GGMLQuantizationType.I8},
    )
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_v\.weight.*type I8"):
        load_model(path, show_progress=False)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    config = tiny_config()
    path = write_gguf(
        tmp_path / "partial.gguf",
        config,
        random_weights(config),
        skip_tensors=("blk.1.ffn_down.weight",),
    )
    with pytest.raises(ModelLoadError, match=r"layers\.1\.down_proj.*missing"):
        load_model(path, show_progress=False)
