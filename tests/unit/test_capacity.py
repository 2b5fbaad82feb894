"""The capacity planner: the Qwen3-8B worked example exactly, block rounding, TP, unknowns."""

from __future__ import annotations

import pytest

from kvfleet.api.builders import make_artifact, make_pool
from kvfleet.api.modelartifact import DType
from kvfleet.api.quantity import QuantityError, format_bytes, parse_bytes
from kvfleet.capacity import (
    LoadInputs,
    MemoryInputs,
    ModelShape,
    kv_bytes_per_token,
    plan_for_pool,
    plan_memory,
    plan_replicas,
    shape_from_hf_config,
    weight_bytes,
)

GIB = 1024**3
QWEN3_8B = ModelShape(
    num_layers=36,
    num_kv_heads=8,
    head_dim=128,
    num_parameters=8 * 10**9,
    hidden_size=4096,
    weight_dtype=DType.BFLOAT16,
)
L4 = MemoryInputs(
    gpu_memory_bytes=24 * GIB,
    workspace_bytes=2 * GIB,
    safety_bytes=1 * GIB,
    seq_len=8192,
    kv_dtype=DType.BFLOAT16,
)


def test_worked_example_qwen3_8b_on_24gib() -> None:
    plan = plan_memory(QWEN3_8B, L4)
    assert plan.kv_bytes_per_token == 147_456
    assert plan.kv_bytes_per_sequence == 1_207_959_552
    assert plan.kv_bytes_per_sequence / GIB == 1.125
    assert plan.weight_bytes == 16_000_000_000
    assert f"{plan.weight_bytes / GIB:.3f}" == "14.901"
    assert plan.kv_budget_bytes_per_rank is not None
    assert f"{plan.kv_budget_bytes_per_rank / GIB:.3f}" == "6.099"
    assert plan.candidate_concurrency == 5
    assert plan.fits is True
    assert plan.unknowns == ()


def test_kv_uses_kv_heads_not_query_heads() -> None:
    # 32 query heads would give 4× the bytes; GQA shares 8 KV heads.
    assert kv_bytes_per_token(36, 8, 128, DType.BFLOAT16) == 147_456
    assert kv_bytes_per_token(36, 8, 128, DType.FP8) == 73_728


def test_sequence_is_rounded_up_to_whole_blocks() -> None:
    plan = plan_memory(QWEN3_8B, MemoryInputs(**{**L4.__dict__, "seq_len": 8193}))
    assert plan.seq_tokens == 8208  # 514 blocks of 16
    assert plan.kv_bytes_per_sequence == 8208 * 147_456
    big_blocks = plan_memory(
        QWEN3_8B, MemoryInputs(**{**L4.__dict__, "seq_len": 8193, "block_size": 32})
    )
    assert big_blocks.seq_tokens == 8224


def test_kv_tokens_are_whole_blocks_of_the_budget() -> None:
    plan = plan_memory(QWEN3_8B, L4)
    assert plan.kv_blocks_per_rank == 6_548_578_304 // (16 * 147_456)
    assert plan.kv_tokens_per_replica == plan.kv_blocks_per_rank * 16


def test_unknown_inputs_are_reported_not_zero() -> None:
    plan = plan_memory(
        ModelShape(num_layers=36, num_kv_heads=8, head_dim=128, weight_dtype=DType.BFLOAT16), L4
    )
    assert plan.kv_bytes_per_token == 147_456
    assert plan.weight_bytes is None
    assert plan.kv_budget_bytes_per_rank is None
    assert plan.candidate_concurrency is None and plan.fits is None
    assert "params" in plan.unknowns


def test_tensor_parallel_ledger_shards_weights_and_kv_heads() -> None:
    tp2 = plan_memory(QWEN3_8B, MemoryInputs(**{**L4.__dict__, "tensor_parallel": 2}))
    norms = (2 * 36 + 1) * 4096 * 2
    ledger = {line.name: line.bytes_per_rank for line in tp2.ledger}
    assert ledger["weights (norms)"] == norms
    assert ledger["weights"] == (16_000_000_000 - norms) // 2
    assert ledger["workspace"] == 2 * GIB  # replicated on every rank
    assert tp2.kv_heads_per_rank == 4
    assert tp2.kv_bytes_per_token_per_rank == 147_456 // 2
    assert tp2.candidate_concurrency is not None and tp2.candidate_concurrency > 5


def test_kv_heads_are_replicated_when_tp_exceeds_them() -> None:
    shape = ModelShape(**{**QWEN3_8B.__dict__, "num_kv_heads": 2})
    tp8 = plan_memory(shape, MemoryInputs(**{**L4.__dict__, "tensor_parallel": 8}))
    assert tp8.kv_heads_per_rank == 1  # each rank keeps a full copy of one KV head


def test_tp_without_hidden_size_makes_the_replicated_term_unknown() -> None:
    shape = ModelShape(**{**QWEN3_8B.__dict__, "hidden_size": None})
    plan = plan_memory(shape, MemoryInputs(**{**L4.__dict__, "tensor_parallel": 2}))
    assert plan.candidate_concurrency is None
    assert any("hidden size" in u for u in plan.unknowns)


def test_quantized_weights_include_group_metadata() -> None:
    awq = ModelShape(
        weight_dtype=DType.FLOAT16,
        quantization_method="awq",
        quantization_bits=4,
        quantization_group_size=128,
    )
    assert weight_bytes(awq, 8 * 10**9) == 4 * 10**9 + 62_500_000 * 2.5
    # GGUF is dequantized at load: resident bytes are those of the compute dtype.
    gguf = ModelShape(
        weight_dtype=DType.FLOAT32,
        quantization_method="gguf-q4_1",
        quantization_bits=4,
        quantization_group_size=32,
    )
    assert weight_bytes(gguf, 1000) == 4000


def test_plan_for_pool_uses_pool_settings_and_artifact_shape() -> None:
    artifact = make_artifact().obj().spec
    pool = make_pool().obj().spec
    plan = plan_for_pool(artifact, pool, gpu_memory_bytes=24 * GIB)
    assert plan.candidate_concurrency == 5
    assert plan.to_status().candidate_concurrency == 5
    override = make_pool().set("spec.gpu.memory", "80Gi").obj().spec
    # (80 - 2 - 1 - 14.901) GiB / 1.125 GiB = 55.2
    assert plan_for_pool(artifact, override, gpu_memory_bytes=None).candidate_concurrency == 55
    fp8 = make_pool().set("spec.engine.kvCacheDtype", "fp8").obj().spec
    assert plan_for_pool(artifact, fp8, 24 * GIB).candidate_concurrency == 10


def test_hf_config_shape() -> None:
    shape = shape_from_hf_config(
        {
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "head_dim": 128,
            "torch_dtype": "bfloat16",
            "max_position_embeddings": 40960,
        }
    )
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (36, 8, 128)
    assert shape.num_parameters is None  # not in config.json: unknown, not guessed
    no_head_dim = shape_from_hf_config({"num_attention_heads": 9, "hidden_size": 576})
    assert no_head_dim.head_dim == 64 and no_head_dim.num_kv_heads == 9


def test_replicas_shared_sum_vs_split_pools() -> None:
    load = LoadInputs(
        arrival_rate=10,
        mean_input_tokens=1000,
        mean_output_tokens=200,
        prefill_tokens_per_second=8000,
        decode_tokens_per_second=1500,
        gpus_per_replica=1,
        reserve_replicas=2,
    )
    plan = plan_replicas(load)
    assert plan.prefill_replicas_exact == 1.25
    assert plan.decode_replicas_exact == pytest.approx(1.3333333)
    assert plan.shared_replicas == 3  # ceil(2.583)
    assert (plan.split_prefill_replicas, plan.split_decode_replicas) == (2, 2)
    assert plan.shared_gpus == 5 and plan.split_gpus == 6


def test_exact_multiples_do_not_round_up() -> None:
    plan = plan_replicas(
        LoadInputs(
            arrival_rate=0.3,
            mean_input_tokens=10,
            mean_output_tokens=10,
            prefill_tokens_per_second=1,
            decode_tokens_per_second=1,
        )
    )
    assert plan.split_prefill_replicas == 3


def test_rates_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        plan_replicas(LoadInputs(1, 1, 1, 0, 1))


def test_quantities() -> None:
    assert parse_bytes("24Gi") == parse_bytes("24GiB") == 24 * GIB
    assert parse_bytes("16G") == parse_bytes("16GB") == 16 * 10**9
    assert parse_bytes("1.5Gi") == 1_610_612_736
    assert parse_bytes("8e9") == 8 * 10**9
    with pytest.raises(QuantityError, match="whole number of bytes"):
        parse_bytes("0.5")
    with pytest.raises(QuantityError, match="not a byte quantity"):
        parse_bytes("lots")
    assert format_bytes(1_207_959_552) == "1,207,959,552 B (1.208 GB, 1.125 GiB)"
