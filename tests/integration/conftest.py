"""Session-scoped real-model fixtures: SmolLM2-135M loaded once by kvfleet and once by HF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine.model.loader import LoadedModel, default_model_path, load_model


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm(smollm_path: Path) -> LoadedModel:
    return load_model(smollm_path, show_progress=False)


@pytest.fixture(scope="session")
def hf_smollm(smollm_path: Path) -> Any:
    """HF transformers' LlamaForCausalLM dequantized from the same GGUF file (float32)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    disable_progress_bar: Any = hf_logging.disable_progress_bar
    disable_progress_bar()
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)
