"""kvfleet.engine.model: Llama-family weights and math, loaded from GGUF or safetensors."""

from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.llama import LlamaModel
from kvfleet.engine.model.loader import LoadedModel, default_model_path, load_model

__all__ = ["LlamaModel", "LoadedModel", "ModelConfig", "default_model_path", "load_model"]
