"""The control plane describes a GGUF file with the `gguf` package's reader
(kvfleet.api.gguf_artifact: the control plane never imports the engine); the engine loads it
with its own strict parser (kvfleet.engine.model.gguf_reader). The ModelArtifact's hashes and
shapes are only true if both read the same metadata: they must agree on every field."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from kvfleet.api.gguf_artifact import _fields, embedded_gguf_path
from kvfleet.engine.model.gguf_reader import GGUFFile


def _both(path: Path) -> tuple[dict[str, object], dict[str, object], int, int]:
    control, parameters = _fields(path)
    engine = GGUFFile(path)
    elements = sum(math.prod(t.shape) for t in engine.tensors)
    return control, engine.metadata, parameters, elements


def test_they_agree_on_the_embedded_model() -> None:
    control, engine, parameters, elements = _both(embedded_gguf_path())
    assert control == engine
    assert parameters == elements
    # The fields the manifest is built from are all there.
    for key in ("general.architecture", "llama.embedding_length", "llama.block_count",
                "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id",
                "tokenizer.chat_template"):
        assert key in engine, key


def test_they_agree_on_every_value_type(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.bools", [True, False])
    writer.add_tensor("w", np.zeros((3, 5), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    control, engine, parameters, elements = _both(path)
    assert control == engine
    assert parameters == elements == 15
    assert engine["t.u64"] == 2**63 + 5 and engine["t.strs"] == ["a", "", "ü"]


def test_the_engine_hashes_tokenizer_and_template_as_the_manifest_does() -> None:
    """What `kvfleet artifact from-gguf` records is what the engine finds at load."""
    from kvfleet.api.gguf_artifact import artifact_from_gguf
    from kvfleet.engine.model.loader import load_model

    path = embedded_gguf_path()
    artifact = artifact_from_gguf(path, name="smol")
    loaded = load_model(path, show_progress=False)
    assert loaded.tokenizer_sha256 == artifact.spec.tokenizer.sha256
    assert artifact.spec.chat_template is not None
    assert loaded.chat_template_sha256 == artifact.spec.chat_template.sha256
