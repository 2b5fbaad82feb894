"""`ModelConfig`: the hyperparameters of a Llama-family model, whatever file they came from.

The family: Llama, Mistral, Qwen2 and Qwen3 are one decoder (RMSNorm, rotate-half RoPE, GQA,
SwiGLU) with three switches: biases on the Q/K/V projections (Qwen2), an RMSNorm over each
query and key head before RoPE (Qwen3), and a sliding attention window (Mistral v0.1).
"""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Invariants (checked in `__post_init__`, so a bad file fails at load, not mid-forward):
    `num_heads % num_kv_heads == 0` (grouped-query attention) and `head_dim` is even (RoPE
    rotates pairs).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_context: int
    tie_word_embeddings: bool
    name: str = ""
    quantization: str = "none"
    attention_bias: bool = False  # the q/k/v projections carry a bias (Qwen2)
    output_bias: bool = False  # the attention output projection carries one
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)

    def __post_init__(self) -> None:
        for field_name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_context",
        ):
            value = getattr(self, field_name)
            if value <= 0:
                raise ValueError(f"ModelConfig.{field_name} must be > 0, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"ModelConfig.architecture {self.architecture!r} is not one of "
                             f"{', '.join(ARCHITECTURES)}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("ModelConfig.rope_theta and rms_norm_eps must be > 0")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        attn = (
            self.hidden_size * (self.num_heads * self.head_dim) * 2
            + self.hidden_size * self.kv_dim * 2
        )
        if self.attention_bias:
            attn += self.num_heads * self.head_dim + 2 * self.kv_dim
        if self.output_bias:
            attn += self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * (attn + mlp + norms) + embed + head + self.hidden_size

    def matmul_flops_per_token(self) -> int:
        """FLOPs of the weight matmuls for one token (2 per multiply-add), incl. the LM head.

        Attention score/value FLOPs depend on context length and are not included.
        """
        attn = (
            self.hidden_size * (self.num_heads * self.head_dim) * 2
            + self.hidden_size * self.kv_dim * 2
        )
        mlp = 3 * self.hidden_size * self.intermediate_size
        return 2 * (self.num_layers * (attn + mlp) + self.vocab_size * self.hidden_size)
