"""GPU memory ledger, KV capacity and GPU count of a serving pool.

Memory, per GPU (rank) of a replica with tensor-parallel degree T:

    weights      sharded    (params - replicated) × bytes/param / T   (+ quantization metadata)
    weights      replicated norm weights, (2·layers + 1) · hidden, on every rank
    workspace    replicated activations, CUDA graphs, kernel scratch   (explicit input)
    safety       replicated driver, fragmentation                      (explicit input)
    KV cache     the rest, in whole blocks

    KV bytes/token = 2 (K and V) × layers × KV heads × head dim × KV dtype bytes
    (KV heads, never query heads: under GQA many query heads share one KV head.) Under TP each
    rank holds ceil(KV heads / T) heads; when T > KV heads the heads are replicated.

A sequence of length L occupies ceil(L / block) blocks; the candidate concurrency is how many
such sequences fit in the KV budget. Any missing input makes what depends on it `None`
(printed "unknown") and is named in `unknowns` — never assumed zero.

GPU count from load (λ requests/s, mean input P and output D tokens, measured per-replica
prefill and decode rates in tokens/s): prefill needs λ·P / prefill_rate replicas and decode
λ·D / decode_rate. A shared pool time-slices both, so it needs ceil(sum); split
(disaggregated) pools need ceil of each, summed. Reserves are added on top.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvfleet.api.modelartifact import DTYPE_BYTES, DType, ModelArtifactSpec
from kvfleet.api.quantity import parse_bytes
from kvfleet.api.servingpool import PoolCapacity, ServingPoolSpec

# Bytes of scale (and zero point) stored per quantization group, by method. GGUF blocks of 32:
# q4_0 = 16 B quants + 2 B scale, q4_1 = 16 + 2 (scale) + 2 (min), q8_0 = 32 + 2.
GROUP_METADATA_BYTES: dict[str, float] = {
    "gguf-q4_0": 2,
    "gguf-q4_1": 4,
    "gguf-q8_0": 2,
    "awq": 2.5,  # fp16 scale + packed 4-bit zero point
    "gptq": 2.5,
    "fp8": 4,  # fp32 scale
}
# The engine dequantizes GGUF weights at load (to the artifact dtype), so they occupy GPU
# memory unquantized; the other methods run quantized kernels.
DEQUANTIZED_AT_LOAD = frozenset({"gguf-q4_0", "gguf-q4_1", "gguf-q8_0"})


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model; None = unknown."""

    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    num_parameters: int | None = None
    hidden_size: int | None = None
    weight_dtype: DType | None = None
    quantization_method: str | None = None
    quantization_bits: int | None = None
    quantization_group_size: int | None = None
    max_context_length: int | None = None


@dataclass(frozen=True)
class MemoryInputs:
    """Deployment inputs; None = unknown."""

    gpu_memory_bytes: int | None = None
    workspace_bytes: int | None = None
    safety_bytes: int | None = None
    seq_len: int | None = None
    kv_dtype: DType | None = None
    block_size: int = 16
    tensor_parallel: int = 1


@dataclass(frozen=True)
class LedgerLine:
    name: str
    scope: str  # "sharded", "replicated" or "remainder"
    bytes_per_rank: int | None


@dataclass(frozen=True)
class MemoryPlan:
    """The per-rank ledger and what follows from it."""

    kv_bytes_per_token: int | None  # whole model, all ranks
    kv_bytes_per_token_per_rank: int | None
    kv_heads_per_rank: int | None
    seq_tokens: int | None  # seq_len rounded up to whole blocks
    kv_bytes_per_sequence: int | None  # whole model, at seq_tokens
    weight_bytes: int | None  # whole model
    ledger: tuple[LedgerLine, ...]
    kv_budget_bytes_per_rank: int | None
    kv_blocks_per_rank: int | None
    kv_tokens_per_replica: int | None
    candidate_concurrency: int | None
    unknowns: tuple[str, ...]
    inputs: MemoryInputs = field(repr=False, default_factory=MemoryInputs)

    @property
    def fits(self) -> bool | None:
        """Whether one sequence of seq_len fits; None when inputs are missing."""
        return None if self.candidate_concurrency is None else self.candidate_concurrency >= 1

    def to_status(self) -> PoolCapacity:
        return PoolCapacity(
            kv_tokens_per_replica=self.kv_tokens_per_replica,
            candidate_concurrency=self.candidate_concurrency,
        )


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: DType) -> int:
    """2 × layers × KV heads × head dim × dtype bytes (fp8 → 1)."""
    return int(2 * num_layers * num_kv_heads * head_dim * DTYPE_BYTES[dtype])


def weight_bytes(shape: ModelShape, num_params: int) -> int | None:
    """Resident bytes of `num_params` weights (quantized, or dequantized at load)."""
    method = shape.quantization_method
    if shape.weight_dtype is None:
        return None
    if method is None or method in DEQUANTIZED_AT_LOAD:
        return int(num_params * DTYPE_BYTES[shape.weight_dtype])
    if shape.quantization_bits is None:
        return None
    total = num_params * shape.quantization_bits / 8
    if shape.quantization_group_size is not None:
        total += (
            math.ceil(num_params / shape.quantization_group_size) * GROUP_METADATA_BYTES[method]
        )
    return math.ceil(total)


def _missing(values: dict[str, Any]) -> list[str]:
    return [name for name, value in values.items() if value is None]


def plan_memory(shape: ModelShape, inputs: MemoryInputs) -> MemoryPlan:
    """The per-rank memory ledger and KV capacity of one replica."""
    tp, block = inputs.tensor_parallel, inputs.block_size
    if tp < 1 or block < 1:
        raise ValueError(f"tensor_parallel ({tp}) and block_size ({block}) must be >= 1")
    kv_dtype = inputs.kv_dtype or shape.weight_dtype
    unknowns = _missing(
        {
            "layers": shape.num_layers,
            "kv heads": shape.num_kv_heads,
            "head dim": shape.head_dim,
            "kv dtype": kv_dtype,
            "params": shape.num_parameters,
            "weight dtype": shape.weight_dtype,
            "gpu memory": inputs.gpu_memory_bytes,
            "workspace": inputs.workspace_bytes,
            "safety margin": inputs.safety_bytes,
            "sequence length": inputs.seq_len,
        }
    )
    per_token = per_token_rank = heads_rank = None
    if shape.num_layers and shape.num_kv_heads and shape.head_dim and kv_dtype:
        per_token = kv_bytes_per_token(
            shape.num_layers, shape.num_kv_heads, shape.head_dim, kv_dtype
        )
        heads_rank = math.ceil(shape.num_kv_heads / tp)
        per_token_rank = kv_bytes_per_token(shape.num_layers, heads_rank, shape.head_dim, kv_dtype)
    seq_tokens = math.ceil(inputs.seq_len / block) * block if inputs.seq_len else None
    per_seq = per_token * seq_tokens if per_token is not None and seq_tokens else None

    total_weights = sharded = replicated = None
    if shape.num_parameters is not None:
        total_weights = weight_bytes(shape, shape.num_parameters)
        if shape.quantization_method and shape.quantization_bits is None:
            unknowns.append("quantization bits")
        if tp == 1:
            sharded, replicated = total_weights, 0
        elif shape.hidden_size is not None and shape.num_layers is not None:
            norm_params = (2 * shape.num_layers + 1) * shape.hidden_size
            replicated = weight_bytes(shape, norm_params)
            rest = weight_bytes(shape, shape.num_parameters - norm_params)
            sharded = None if rest is None else math.ceil(rest / tp)
        else:
            unknowns.append("hidden size (for the replicated norm weights under TP)")
    ledger = (
        LedgerLine("weights", "sharded", sharded),
        LedgerLine("weights (norms)", "replicated", replicated),
        LedgerLine("workspace", "replicated", inputs.workspace_bytes),
        LedgerLine("safety margin", "replicated", inputs.safety_bytes),
    )
    budget = blocks = kv_tokens = concurrency = None
    used = [line.bytes_per_rank for line in ledger]
    if inputs.gpu_memory_bytes is not None and all(b is not None for b in used):
        budget = inputs.gpu_memory_bytes - sum(b for b in used if b is not None)
    if budget is not None and per_token_rank is not None:
        blocks = max(budget, 0) // (per_token_rank * block)
        kv_tokens = blocks * block
        if seq_tokens:
            concurrency = blocks // (seq_tokens // block)
    return MemoryPlan(
        kv_bytes_per_token=per_token,
        kv_bytes_per_token_per_rank=per_token_rank,
        kv_heads_per_rank=heads_rank,
        seq_tokens=seq_tokens,
        kv_bytes_per_sequence=per_seq,
        weight_bytes=total_weights,
        ledger=(*ledger, LedgerLine("KV cache", "remainder", budget)),
        kv_budget_bytes_per_rank=budget,
        kv_blocks_per_rank=blocks,
        kv_tokens_per_replica=kv_tokens,
        candidate_concurrency=concurrency,
        unknowns=tuple(unknowns),
        inputs=inputs,
    )


def shape_from_artifact(spec: ModelArtifactSpec) -> ModelShape:
    arch, quant = spec.architecture, spec.quantization
    return ModelShape(
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        num_parameters=arch.num_parameters,
        hidden_size=arch.hidden_size,
        weight_dtype=spec.dtype,
        quantization_method=quant.method.value if quant else None,
        quantization_bits=quant.bits if quant else None,
        quantization_group_size=quant.group_size if quant else None,
        max_context_length=arch.max_context_length,
    )


_HF_DTYPES = {"float32": DType.FLOAT32, "float16": DType.FLOAT16, "bfloat16": DType.BFLOAT16}


def shape_from_hf_config(config: dict[str, Any]) -> ModelShape:
    """From a Hugging Face config.json (parameter count is not in it: unknown unless given)."""
    heads = config.get("num_attention_heads")
    hidden = config.get("hidden_size")
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    dtype_name = config.get("torch_dtype") or config.get("dtype")
    return ModelShape(
        num_layers=config.get("num_hidden_layers"),
        num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=head_dim,
        hidden_size=hidden,
        weight_dtype=_HF_DTYPES.get(str(dtype_name)) if dtype_name else None,
        max_context_length=config.get("max_position_embeddings"),
    )


def plan_for_pool(
    artifact: ModelArtifactSpec, pool: ServingPoolSpec, gpu_memory_bytes: int | None
) -> MemoryPlan:
    """The plan the webhook and operator use: the pool's settings over the artifact's shape.

    `gpu_memory_bytes` is the pool's `gpu.memory` or, when unset, the product's memory from the
    compatibility matrix (the caller resolves it; this module does not read the matrix).
    """
    engine = pool.engine
    if pool.gpu.memory is not None:
        gpu_memory_bytes = parse_bytes(pool.gpu.memory)
    kv = engine.kv_cache_dtype.value
    return plan_memory(
        shape_from_artifact(artifact),
        MemoryInputs(
            gpu_memory_bytes=gpu_memory_bytes,
            workspace_bytes=parse_bytes(engine.workspace),
            safety_bytes=parse_bytes(engine.safety_margin),
            seq_len=engine.max_model_length or artifact.architecture.max_context_length,
            kv_dtype=None if kv == "auto" else DType(kv),
            block_size=engine.block_size,
            tensor_parallel=pool.gpu.count,
        ),
    )


@dataclass(frozen=True)
class LoadInputs:
    """Offered load and measured per-replica throughput."""

    arrival_rate: float  # requests/s
    mean_input_tokens: float
    mean_output_tokens: float
    prefill_tokens_per_second: float  # per replica, measured
    decode_tokens_per_second: float  # per replica at the planned batch, measured
    gpus_per_replica: int = 1
    reserve_replicas: int = 0


@dataclass(frozen=True)
class ReplicaPlan:
    prefill_replicas_exact: float
    decode_replicas_exact: float
    shared_replicas: int
    split_prefill_replicas: int
    split_decode_replicas: int
    reserve_replicas: int
    gpus_per_replica: int

    @property
    def split_replicas(self) -> int:
        return self.split_prefill_replicas + self.split_decode_replicas

    @property
    def shared_gpus(self) -> int:
        return (self.shared_replicas + self.reserve_replicas) * self.gpus_per_replica

    @property
    def split_gpus(self) -> int:
        return (self.split_replicas + self.reserve_replicas) * self.gpus_per_replica


def plan_replicas(load: LoadInputs) -> ReplicaPlan:
    """Replicas and GPUs for the load: shared pool vs split prefill/decode pools."""
    if load.prefill_tokens_per_second <= 0 or load.decode_tokens_per_second <= 0:
        raise ValueError("measured prefill and decode rates must be positive tokens/s")
    if min(load.arrival_rate, load.mean_input_tokens, load.mean_output_tokens) < 0:
        raise ValueError("arrival rate and mean token counts must not be negative")
    prefill = load.arrival_rate * load.mean_input_tokens / load.prefill_tokens_per_second
    decode = load.arrival_rate * load.mean_output_tokens / load.decode_tokens_per_second

    # Float noise must not add a replica: 2.0000000000000004 is 2.
    def up(x: float) -> int:
        return math.ceil(round(x, 9))

    return ReplicaPlan(
        prefill_replicas_exact=prefill,
        decode_replicas_exact=decode,
        shared_replicas=up(prefill + decode),
        split_prefill_replicas=up(prefill),
        split_decode_replicas=up(decode),
        reserve_replicas=load.reserve_replicas,
        gpus_per_replica=load.gpus_per_replica,
    )
