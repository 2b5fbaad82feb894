"""`kvfleet capacity`: GPU memory ledger, KV capacity and GPU count (see kvfleet/capacity.py).

Model inputs come from --artifact, --hf-config or --gguf, and any flag overrides them. Anything
still missing is printed as "unknown" and listed, never assumed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from kvfleet.api import DocumentError, ModelArtifact, load_objects
from kvfleet.api.gguf_artifact import GGUFArtifactError, artifact_from_gguf
from kvfleet.api.modelartifact import DType
from kvfleet.api.quantity import QuantityError, format_bytes, parse_bytes
from kvfleet.capacity import (
    LoadInputs,
    MemoryInputs,
    MemoryPlan,
    ModelShape,
    ReplicaPlan,
    plan_memory,
    plan_replicas,
    shape_from_artifact,
    shape_from_hf_config,
)
from kvfleet.compat import MatrixError, default_matrix

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "fp32": "float32",
    "f32": "float32",
    "fp8_e4m3": "fp8",
}


def _dtype(text: str) -> DType:
    try:
        return DType(_DTYPE_ALIASES.get(text.lower(), text.lower()))
    except ValueError:
        names = sorted({*(d.value for d in DType), *_DTYPE_ALIASES})
        raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(names)}") from None


def _product(label: str) -> str:
    """A matrix product label from an exact label or a unique suffix (L4 → NVIDIA-L4)."""
    products = default_matrix().gpu_products
    if label in products:
        return label
    matches = [p for p in products if p.lower().endswith("-" + label.lower())]
    if len(matches) != 1:
        raise ValueError(
            f"--gpu {label}: not one product of the compatibility matrix "
            f"({', '.join(sorted(products))}); or give --gpu-memory"
        )
    return matches[0]


_OVERRIDES = {  # flag dest -> ModelShape field
    "layers": "num_layers",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "hidden_size": "hidden_size",
    "params": "num_parameters",
    "weight_dtype": "weight_dtype",
    "quant_method": "quantization_method",
    "quant_bits": "quantization_bits",
    "quant_group_size": "quantization_group_size",
}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "capacity", help="GPU memory / KV / GPU-count planner", description=__doc__
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--artifact", type=Path, help="ModelArtifact YAML")
    src.add_argument("--hf-config", type=Path, help="Hugging Face config.json")
    src.add_argument("--gguf", type=Path, help="GGUF file")
    p.add_argument("--layers", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--hidden-size", type=int, help="needed for the replicated terms under TP")
    p.add_argument("--params", type=lambda s: int(float(s)), help="parameter count, e.g. 8e9")
    p.add_argument("--weight-dtype", type=_dtype, help="e.g. bf16, float16, fp8")
    p.add_argument("--kv-dtype", type=_dtype, help="default: the weight dtype")
    p.add_argument("--quant-method")
    p.add_argument("--quant-bits", type=int)
    p.add_argument("--quant-group-size", type=int)
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: model max context)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tp", type=int, default=1, help="GPUs per replica (tensor parallel)")
    p.add_argument("--gpu", help="GPU product label; memory from the compatibility matrix")
    p.add_argument("--gpu-memory", help="memory of one GPU, e.g. 24GiB")
    p.add_argument("--workspace", help="per-GPU workspace, e.g. 2GiB")
    p.add_argument("--safety", help="per-GPU safety margin, e.g. 1GiB")
    p.add_argument("--arrival-rate", type=float, help="λ, requests per second")
    p.add_argument("--mean-input", type=float, help="P, mean prompt tokens")
    p.add_argument("--mean-output", type=float, help="D, mean output tokens")
    p.add_argument("--prefill-rate", type=float, help="measured prefill tokens/s per replica")
    p.add_argument("--decode-rate", type=float, help="measured decode tokens/s per replica")
    p.add_argument("--reserve", type=int, default=0, help="reserve replicas added on top")
    p.add_argument("--output", choices=["table", "json"], default="table")
    p.set_defaults(func=_capacity)


def _base_shape(args: argparse.Namespace) -> ModelShape:
    if args.artifact:
        artifacts = [o for o in load_objects(args.artifact) if isinstance(o, ModelArtifact)]
        if not artifacts:
            raise ValueError(f"{args.artifact}: no ModelArtifact in the file")
        return shape_from_artifact(artifacts[0].spec)
    if args.hf_config:
        return shape_from_hf_config(json.loads(args.hf_config.read_text(encoding="utf-8")))
    if args.gguf:
        return shape_from_artifact(artifact_from_gguf(args.gguf, name="gguf").spec)
    return ModelShape()


def _inputs(args: argparse.Namespace, shape: ModelShape) -> MemoryInputs:
    gpu_memory = parse_bytes(args.gpu_memory) if args.gpu_memory else None
    if gpu_memory is None and args.gpu:
        gpu_memory = default_matrix().gpu_products[_product(args.gpu)].memory_bytes
    return MemoryInputs(
        gpu_memory_bytes=gpu_memory,
        workspace_bytes=parse_bytes(args.workspace) if args.workspace else None,
        safety_bytes=parse_bytes(args.safety) if args.safety else None,
        seq_len=args.seq_len or shape.max_context_length,
        kv_dtype=args.kv_dtype,
        block_size=args.block_size,
        tensor_parallel=args.tp,
    )


def _load(args: argparse.Namespace) -> LoadInputs | None:
    values = [
        args.arrival_rate,
        args.mean_input,
        args.mean_output,
        args.prefill_rate,
        args.decode_rate,
    ]
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError(
            "GPU count needs all of --arrival-rate --mean-input --mean-output "
            "--prefill-rate --decode-rate"
        )
    return LoadInputs(
        arrival_rate=args.arrival_rate,
        mean_input_tokens=args.mean_input,
        mean_output_tokens=args.mean_output,
        prefill_tokens_per_second=args.prefill_rate,
        decode_tokens_per_second=args.decode_rate,
        gpus_per_replica=args.tp,
        reserve_replicas=args.reserve,
    )


def _b(value: int | None) -> str:
    return "unknown" if value is None else format_bytes(value)


def _table(plan: MemoryPlan, replicas: ReplicaPlan | None) -> str:
    block = plan.inputs.block_size
    seq = (
        "unknown"
        if plan.seq_tokens is None
        else (f"{plan.seq_tokens:,} tokens = {plan.seq_tokens // block:,} blocks of {block}")
    )
    per_token = "unknown" if plan.kv_bytes_per_token is None else f"{plan.kv_bytes_per_token:,} B"
    lines = [
        f"  KV bytes per token     {per_token}",
        f"  sequence               {seq}",
        f"  KV per sequence        {_b(plan.kv_bytes_per_sequence)}",
        f"  weights                {_b(plan.weight_bytes)}",
        "",
        f"per-GPU ledger (tensor parallel {plan.inputs.tensor_parallel})",
    ]
    for line in plan.ledger:
        lines.append(f"  {line.name:<16} {line.scope:<11} {_b(line.bytes_per_rank)}")
    lines.append(f"  {'GPU memory':<16} {'':<11} {_b(plan.inputs.gpu_memory_bytes)}")
    tokens = (
        "unknown"
        if plan.kv_tokens_per_replica is None
        else (f"{plan.kv_tokens_per_replica:,} ({plan.kv_blocks_per_rank:,} blocks)")
    )
    concurrency = (
        "unknown"
        if plan.candidate_concurrency is None
        else (f"{plan.candidate_concurrency} sequences of {plan.seq_tokens:,} tokens")
    )
    lines += ["", f"  KV tokens per replica  {tokens}", f"  candidate concurrency  {concurrency}"]
    if plan.fits is False:
        lines.append("  DOES NOT FIT: not even one sequence fits in the KV budget")
    if plan.unknowns:
        lines.append(f"  unknown inputs: {', '.join(plan.unknowns)}")
    if replicas is not None:
        lines += [
            "",
            "GPU count",
            f"  prefill load           {replicas.prefill_replicas_exact:.3f} replicas",
            f"  decode load            {replicas.decode_replicas_exact:.3f} replicas",
            f"  shared pool            {replicas.shared_replicas} + {replicas.reserve_replicas}"
            f" reserve replicas = {replicas.shared_gpus} GPUs",
            f"  split pools            {replicas.split_prefill_replicas} prefill + "
            f"{replicas.split_decode_replicas} decode + {replicas.reserve_replicas} reserve = "
            f"{replicas.split_gpus} GPUs",
        ]
    return "\n".join(lines) + "\n"


def _json(plan: MemoryPlan, replicas: ReplicaPlan | None) -> str:
    data: dict[str, Any] = dataclasses.asdict(plan)
    data["fits"] = plan.fits
    if replicas is not None:
        data["replicas"] = {
            **dataclasses.asdict(replicas),
            "split_replicas": replicas.split_replicas,
            "shared_gpus": replicas.shared_gpus,
            "split_gpus": replicas.split_gpus,
        }
    return json.dumps(data, indent=2, default=str) + "\n"


def _capacity(args: argparse.Namespace) -> int:
    try:
        shape = _base_shape(args)
        overrides = {
            field: getattr(args, dest)
            for dest, field in _OVERRIDES.items()
            if getattr(args, dest) is not None
        }
        shape = dataclasses.replace(shape, **overrides)
        plan = plan_memory(shape, _inputs(args, shape))
        load = _load(args)
        replicas = plan_replicas(load) if load is not None else None
    except (
        ValueError,
        OSError,
        QuantityError,
        DocumentError,
        GGUFArtifactError,
        MatrixError,
    ) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(_json(plan, replicas) if args.output == "json" else _table(plan, replicas))
    return 0
