"""The Llama-family decoder (RMSNorm, rotate-half RoPE, GQA, SwiGLU) over a flat token batch.

Llama, Mistral, Qwen2 and Qwen3 (see `ModelConfig`): optional biases on the attention
projections, optional per-head RMSNorm of q and k before RoPE.

The model knows nothing about paging or requests: `forward` takes the concatenated tokens of
every sequence in a step, their positions, and an `Attention` object that stores this step's
K/V and attends over each sequence's context. The model runner supplies a paged one; tests
supply a contiguous one as the reference.

Batch invariance (`batch_invariant=True`: a request's output bits do not depend on what it is
batched with): on CPU, MKL picks a different sgemm kernel for fewer than 16 rows, and with 2+
threads splits long reductions (K=1536) across threads for some row counts; either changes
the last bits of a row's result depending on the *other* rows. So in that mode every matmul
runs on at least `MIN_GEMM_ROWS` rows (zero padding) and reductions longer than `MAX_GEMM_K`
are split into fixed chunks summed in a fixed order. Measured: identical bits per row for any
batch size. It is opt-in, as in vLLM, because the padding is paid where latency matters most:
with one or two requests running, a SmolLM2 decode step took 85 ms padded and 42 ms not (2 CPU
threads; MKL's one-row kernel streams the weights, the 16-row one does not).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from functools import partial
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet.engine import hugepages, native
from kvfleet.engine.errors import ModelLoadError
from kvfleet.engine.fused_ops import FusedOps
from kvfleet.engine.matmul_plan import (
    MatmulPlan,
    ShapeChoice,
    ShapeSample,
    WeightShape,
    candidates,
    routed,
)
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.packed_matmul import (
    Packer,
    QuantBlocks,
    QuantKernel,
    QuantWeight,
    RowRoutedWeight,
    TorchWeight,
    WeightMatmul,
    bytes_read,
    with_activation_rounding,
)

MIN_GEMM_ROWS = 16
MAX_GEMM_K = 768


class Attention(Protocol):
    """Stores a layer's new K/V and returns attention output for every query token.

    q: [T, num_heads, head_dim], k/v: [T, num_kv_heads, head_dim] (RoPE applied);
    returns [T, num_heads * head_dim].
    """

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, kv, q = config.hidden_size, config.kv_dim, config.num_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens": (config.vocab_size, h),
        "norm": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        shapes.update(
            {
                f"layers.{i}.input_layernorm": (h,),
                f"layers.{i}.q_proj": (q, h),
                f"layers.{i}.k_proj": (kv, h),
                f"layers.{i}.v_proj": (kv, h),
                f"layers.{i}.o_proj": (h, q),
                f"layers.{i}.post_attention_layernorm": (h,),
                f"layers.{i}.gate_proj": (config.intermediate_size, h),
                f"layers.{i}.up_proj": (config.intermediate_size, h),
                f"layers.{i}.down_proj": (h, config.intermediate_size),
            }
        )
        if config.attention_bias:
            shapes.update({f"layers.{i}.q_bias": (q,), f"layers.{i}.k_bias": (kv,),
                           f"layers.{i}.v_bias": (kv,)})
        if config.output_bias:
            shapes[f"layers.{i}.o_bias"] = (h,)
        if config.qk_norm:
            shapes.update({f"layers.{i}.q_norm": (config.head_dim,),
                           f"layers.{i}.k_norm": (config.head_dim,)})
    return shapes


def check_weights(
    config: ModelConfig, weights: Mapping[str, torch.Tensor], path: str | Path
) -> None:
    """ModelLoadError naming the first missing or mis-shaped tensor."""
    for name, shape in expected_weight_shapes(config).items():
        tensor = weights.get(name)
        if tensor is None:
            raise ModelLoadError(
                path,
                f"weight {name!r} is missing",
                "The file is incomplete; re-convert or re-download it",
            )
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                path,
                f"weight {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {shape} from the file's hyperparameters",
                "The file is inconsistent; re-convert it",
            )


def matmul(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """x @ weight_t for a weight stored transposed ([in, out], contiguous).

    MKL's sgemm is faster on this layout than on `F.linear`'s [out, in] one for the row
    counts decode runs at: the weight matmuls of a SmolLM2 step took 69 vs 80 ms at 64 rows,
    50 vs 55 at 32, 18 vs 21 at 1 (2 threads, measured side by side)."""
    return torch.mm(x, weight_t)


def invariant_matmul(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """x @ weight_t with a result per row that does not depend on the other rows."""
    rows = x.shape[0]
    if rows < MIN_GEMM_ROWS:
        x = torch.cat([x, x.new_zeros(MIN_GEMM_ROWS - rows, x.shape[1])])
    k = x.shape[1]
    if k <= MAX_GEMM_K:
        out = torch.mm(x, weight_t)
    else:
        out = torch.mm(x[:, :MAX_GEMM_K], weight_t[:MAX_GEMM_K])
        for start in range(MAX_GEMM_K, k, MAX_GEMM_K):
            out += torch.mm(x[:, start : start + MAX_GEMM_K], weight_t[start : start + MAX_GEMM_K])
    return out[:rows] if rows < MIN_GEMM_ROWS else out


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`invariant_matmul` for a weight stored [out, in] (the LM head, which is also the
    embedding table and so keeps the row layout the token lookup needs)."""
    return invariant_matmul(x, weight.t())


def _parts(weight: WeightMatmul) -> tuple[WeightMatmul, ...]:
    return weight.weights if isinstance(weight, RowRoutedWeight) else (weight,)


# Without a measured plan: the fewest bytes a step streams (routed() falls back in this order).
_FIXED_ORDER = ShapeChoice((2**62,), ("quant",))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as HF's LlamaRMSNorm, so the two agree bit for bit on the same input: in
    # float32 (a no-op for float32 input), the result back in the input's dtype.
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


# A layer's weights, in the order `LlamaModel.weight_matmul` and `pack_weights` use, and the
# checkpoint matrices each fuses (in order, along the output features).
QKV, O_PROJ, GATE_UP, DOWN = range(4)
LayerMatmul = Callable[[torch.Tensor], torch.Tensor]
# Per layer: the (qkv, output, gate_up, down) matmuls; the input and post-attention norms.
_ForwardPlan = tuple[list[tuple[LayerMatmul, ...]], list[torch.Tensor], list[torch.Tensor]]
_FUSED = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


class LlamaModel(nn.Module):
    """Weights plus the math; the K/V storage lives in the `Attention` passed to `forward`."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        path: str | Path = "<weights>",
        quant_blocks: Mapping[str, QuantBlocks] | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        release: bool = False,
    ) -> None:
        """`quant_blocks`: raw blocks of the matrices a GGUF stored as Q4_1 or Q8_0 (see
        `GGUFContents`), kept for `pack_weights` until it runs (float32 on the CPU only).
        `dtype` and `device`: where the parameters are built, one tensor at a time, so a
        bfloat16 checkpoint bound for a GPU never exists as float32 in host memory.
        `release`: `weights` is a dict the caller is done with; each layer matrix is removed
        from it once its fused, transposed copy exists (the loader's: holding both copies of
        every layer put a float32 load's peak ~310 MiB higher for SmolLM2-135M)."""
        super().__init__()
        check_weights(config, weights, path)
        self.config = config
        if release and not isinstance(weights, MutableMapping):
            raise TypeError("LlamaModel(release=True) removes entries from `weights`: pass a dict")
        owned = weights if release and isinstance(weights, MutableMapping) else None

        def cast(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device=device, dtype=dtype)

        self.embed_tokens = nn.Parameter(cast(weights["embed_tokens"]), requires_grad=False)
        self.norm = nn.Parameter(cast(weights["norm"]), requires_grad=False)
        lm_head = weights.get("lm_head") if not config.tie_word_embeddings else None
        self.lm_head = (
            self.embed_tokens
            if lm_head is None
            else nn.Parameter(cast(lm_head), requires_grad=False)
        )
        # Q/K/V and gate/up are fused so each is one matmul over all tokens of the step, and
        # every layer weight is stored transposed, [in, out] (see `matmul`).
        self.qkv_t = nn.ParameterList()
        self.o_t = nn.ParameterList()
        self.gate_up_t = nn.ParameterList()
        self.down_t = nn.ParameterList()
        self.input_layernorm = nn.ParameterList()
        self.post_attention_layernorm = nn.ParameterList()
        # Per layer, empty when the architecture has none: the fused q/k/v bias, the output
        # projection's bias, and the q and k head norms.
        self.qkv_bias = nn.ParameterList()
        self.o_bias = nn.ParameterList()
        self.q_norm = nn.ParameterList()
        self.k_norm = nn.ParameterList()
        for i in range(config.num_layers):

            def w(name: str, layer: int = i) -> torch.Tensor:
                return cast(weights[f"layers.{layer}.{name}"])

            def w_t(*names: str, layer: int = i) -> nn.Parameter:
                fused = torch.cat([w(name, layer) for name in names])
                if owned is not None:
                    for name in names:
                        del owned[f"layers.{layer}.{name}"]
                return nn.Parameter(fused.t().contiguous(), requires_grad=False)

            for weights_t, names in zip((self.qkv_t, self.o_t, self.gate_up_t, self.down_t),
                                        _FUSED, strict=True):
                weights_t.append(w_t(*names))
            self.input_layernorm.append(nn.Parameter(w("input_layernorm"), requires_grad=False))
            self.post_attention_layernorm.append(
                nn.Parameter(w("post_attention_layernorm"), requires_grad=False)
            )
            if config.attention_bias:
                self.qkv_bias.append(nn.Parameter(
                    torch.cat([w("q_bias"), w("k_bias"), w("v_bias")]), requires_grad=False))
            if config.output_bias:
                self.o_bias.append(nn.Parameter(w("o_bias"), requires_grad=False))
            if config.qk_norm:
                self.q_norm.append(nn.Parameter(w("q_norm"), requires_grad=False))
                self.k_norm.append(nn.Parameter(w("k_norm"), requires_grad=False))
        self._inv_freq = 1.0 / (
            config.rope_theta
            ** (torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim)
        )
        self._rope_cache_len = 0
        self._cos = torch.empty(0)
        self._sin_signed = torch.empty(0)
        on_cpu_float32 = (device is None or device.type == "cpu") and dtype == torch.float32
        self._quant_blocks = dict(quant_blocks or {}) if on_cpu_float32 else {}
        # Per layer (qkv, o, gate_up, down) once `pack_weights` ran; the [in, out] copies are
        # then dropped.
        self._packed: list[tuple[WeightMatmul, ...]] | None = None
        # The LM head packed too (also once `pack_weights` ran); the float32 matrix stays, as
        # the embedding table when tied and for batch-invariant logits.
        self._lm_head_packed: WeightMatmul | None = None
        self._fused: FusedOps | None = None
        self._plan_key: tuple[object, bool] | None = None
        self._plan: _ForwardPlan = ([], [], [])

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        """Run norms, RoPE and SiLU as the fused ops from now on (see `fused_ops`); None goes
        back to the torch ops."""
        self._fused = ops

    @property
    def is_packed(self) -> bool:
        return self._packed is not None

    _WEIGHT_NAMES = ("qkv", "o", "gate_up", "down")

    def _layer_parts(self, layer: int, index: int) -> list[QuantBlocks | None]:
        return [self._quant_blocks.get(f"layers.{layer}.{name}") for name in _FUSED[index]]

    def layer_shape(self, layer: int, index: int) -> WeightShape:
        """The shape and storage type of one layer weight (no blocks are copied)."""
        weight_t = (self.qkv_t, self.o_t, self.gate_up_t, self.down_t)[index][layer]
        types = {p.ggml_type if p is not None else None for p in self._layer_parts(layer, index)}
        ggml_type = types.pop() if len(types) == 1 else None  # mixed types: float32 paths
        return WeightShape(self._WEIGHT_NAMES[index], weight_t.shape[0], weight_t.shape[1],
                           ggml_type)

    def _layer_sample(self, layer: int, index: int) -> ShapeSample:
        weight_t = (self.qkv_t, self.o_t, self.gate_up_t, self.down_t)[index][layer]
        parts = self._layer_parts(layer, index)
        blocks = (QuantBlocks.concat([p for p in parts if p is not None])
                  if all(p is not None for p in parts) else None)
        return ShapeSample(self.layer_shape(layer, index), weight_t, blocks)

    def _lm_head_sample(self) -> ShapeSample:
        name = "embed_tokens" if self.lm_head is self.embed_tokens else "lm_head"
        blocks = self._quant_blocks.get(name)
        vocab, hidden = self.lm_head.shape
        return ShapeSample(WeightShape("lm_head", hidden, vocab,
                                       blocks.ggml_type if blocks is not None else None),
                           self.lm_head.t(), blocks)

    def weight_samples(self) -> list[ShapeSample]:
        """One weight of each distinct shape and storage type (layer weights, the LM head):
        what `matmul_plan` times. Only before `pack_weights`."""
        if self._packed is not None:
            raise RuntimeError("weight_samples: the weights are packed already")
        samples: dict[str, ShapeSample] = {}
        for layer in range(self.config.num_layers):
            for index in range(len(_FUSED)):
                if self.layer_shape(layer, index).key not in samples:  # fused only when new
                    sample = self._layer_sample(layer, index)
                    samples[sample.shape.key] = sample
        head = self._lm_head_sample()
        # The LM head is timed on the first half of its outputs (each path's copy of it lives
        # while the paths are timed, and MKL's float32 one is 113 MB for SmolLM2's tied
        # embedding): a start that timed the paths peaked at 1,550 MiB, over the engine's
        # 1,536 MiB target. Half of SmolLM2's head is 57 MB as float32, still past the L3 of
        # the CPUs it runs on, so the paths still read it from memory as a step does.
        half = head.shape.out_features // 2 // 16 * 16
        samples.setdefault(head.shape.key, head.first_outputs(half) if half else head)
        return list(samples.values())

    def pack_weights(self, packer: Packer | None, quant: QuantKernel | None = None,
                     plan: MatmulPlan | None = None) -> None:
        """Multiply by packed weights from now on (see `packed_matmul`). `plan` (see
        `matmul_plan`) names each weight's path per row count, as measured on this host;
        without one (or for a shape it lacks): quantized where the file stored a matrix as
        Q4_1 or Q8_0 and `quant` is given, else MKL-packed float32 (`packer`), else plain
        float32. Drops the [in, out] copies as each layer is packed, so memory does not double.
        The LM head is packed as well (`torch.mm` re-packs its 113 MB on every call: 16 vs 9 ms
        at 8 rows, 28 vs 21 at 64 MKL-packed, SmolLM2, 2 threads). Batch-invariant forward
        passes need the unpacked weights: they refuse afterwards."""
        if self._packed is not None:
            return

        def pack(sample: ShapeSample) -> WeightMatmul:
            choice = (plan.choice(sample.shape) if plan is not None else None) or _FIXED_ORDER
            return routed(choice, candidates(sample, packer, quant))

        packed = []
        lists = (self.qkv_t, self.o_t, self.gate_up_t, self.down_t)
        for layer in range(self.config.num_layers):
            packed.append(tuple(pack(self._layer_sample(layer, index))
                                for index in range(len(_FUSED))))
            for weights in lists:
                weights[layer] = nn.Parameter(torch.empty(0), requires_grad=False)
            # The freed layer goes back to the OS now, not after the last one: packing all
            # layers first would hold both copies at once (peak +400 MiB, measured).
            native.return_freed_memory()
        self._packed = packed
        head = pack(self._lm_head_sample())
        # A torch path needs no packed head: compute_logits then multiplies the matrix itself.
        self._lm_head_packed = None if isinstance(head, TorchWeight) else head
        self._quant_blocks.clear()
        self._move_to_huge_pages()
        native.return_freed_memory()  # the raw blocks, the transposed copy packing read from

    def use_activation_rounding(self, int8_rows: int, int16: bool) -> None:
        """From now on, matmuls whose plan takes the 4-bit kernel round their input: layer
        matmuls of up to `int8_rows` rows (0: none) to 8 bits per 32-value block and, if
        `int16`, every other layer and LM-head matmul to 16 bits (`packed_matmul.QuantWeight`).
        Only on packed weights."""
        if self._packed is None:
            raise RuntimeError("use_activation_rounding: the weights are not packed (an engine "
                               "without batch invariance packs them)")
        self._packed = [tuple(with_activation_rounding(w, int8_rows, int16) for w in layer)
                        for layer in self._packed]
        if self._lm_head_packed is not None:
            self._lm_head_packed = with_activation_rounding(self._lm_head_packed, 0, int16)

    def _move_to_huge_pages(self) -> None:
        """Every quantized weight into one mapping on huge pages (see `hugepages`): a step
        streams them all. MKL's packed buffers stay where MKL packed them: a copy at another
        address gave wrong products (its layout is MKL's business, not documented)."""
        assert self._packed is not None
        weights = [w for layer in self._packed for w in layer]
        if self._lm_head_packed is not None:
            weights.append(self._lm_head_packed)
        # By tensor: a weight's two quantized paths (`quant`, `quant_wide`) share one.
        movable = list({id(q.packed): q.packed for w in weights for q in _parts(w)
                        if isinstance(q, QuantWeight)}.values())
        moved = dict(zip(map(id, movable), hugepages.gather(movable), strict=True))

        def rehomed(w: WeightMatmul) -> WeightMatmul:
            if isinstance(w, QuantWeight):
                return dataclasses.replace(w, packed=moved[id(w.packed)])
            if isinstance(w, RowRoutedWeight):
                return dataclasses.replace(w, weights=tuple(map(rehomed, w.weights)))
            return w

        self._packed = [tuple(map(rehomed, layer)) for layer in self._packed]
        if self._lm_head_packed is not None:
            self._lm_head_packed = rehomed(self._lm_head_packed)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, head_dim] for `positions`, from a table grown on demand.

        HF rotates with `x * cos + rotate_half(x) * sin`, rotate_half(x) = (-x2, x1). Here
        that is `x * cos + roll(x, half) * (-sin1, sin2)`: 4 ops instead of 7, and bit for bit
        the same (`-x2 * s` and `x2 * -s` round alike)."""
        needed = int(positions.max().item()) + 1 if positions.numel() else 0
        if needed > self._rope_cache_len:
            length = max(needed, 2 * self._rope_cache_len, 1024)
            # Same float32 computation as HF's default rotary embedding.
            freqs = torch.arange(length, dtype=torch.float32)[:, None] * self._inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            half = self.config.head_dim // 2
            sin = emb.sin()
            # On the model's device, in its dtype (as HF casts cos/sin to the activations').
            device, dtype = self.embed_tokens.device, self.embed_tokens.dtype
            self._cos = emb.cos().to(device=device, dtype=dtype)
            self._sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), 1).to(
                device=device, dtype=dtype)
            self._rope_cache_len = length
        return (self._cos.index_select(0, positions),
                self._sin_signed.index_select(0, positions))

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
        batch_invariant: bool = False, output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] (before the final norm) for flat `token_ids` [T], or only
        the rows `output_rows` [N] when given: the last layer then runs its output projection
        and MLP on those rows alone (no later layer reads the others, and attention has
        already written their K/V) — in a prefill step that samples one row per chunk, most
        of a layer's work."""
        cfg = self.config
        num_tokens = token_ids.shape[0]
        q_size = cfg.num_heads * cfg.head_dim
        cos, sin = self._rope(positions)
        hidden = self.embed_tokens.index_select(0, token_ids)
        if self._fused is not None:
            return self._forward_fused(self._fused, hidden, cos, sin, attention,
                                       batch_invariant, output_rows)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        half = cfg.head_dim // 2
        for layer in range(cfg.num_layers):
            x = _rms_norm(hidden, self.input_layernorm[layer], cfg.rms_norm_eps)
            qkv = self._qkv(layer, x, batch_invariant)
            # RoPE on Q and K together: [T, heads + kv_heads, head_dim].
            qk = qkv[:, : q_size + cfg.kv_dim].view(num_tokens, -1, cfg.head_dim)
            qk = qk * cos + qk.roll(half, -1) * sin
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            v = qkv[:, q_size + cfg.kv_dim :].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            attn = attention(layer, q, k, v)
            if output_rows is not None and layer == cfg.num_layers - 1:
                hidden = hidden.index_select(0, output_rows)
                attn = attn.index_select(0, output_rows)
            hidden = hidden + self._output(layer, attn, batch_invariant)
            x = _rms_norm(hidden, self.post_attention_layernorm[layer], cfg.rms_norm_eps)
            gate, up = self.weight_matmul(layer, GATE_UP, x, batch_invariant).chunk(2, dim=-1)
            hidden = hidden + self.weight_matmul(layer, DOWN, F.silu(gate) * up, batch_invariant)
        return hidden

    def _forward_fused(self, ops: FusedOps, hidden: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, attention: Attention, batch_invariant: bool,
                       output_rows: torch.Tensor | None) -> torch.Tensor:
        """`forward` with the fused elementwise ops: the same math, up to float32 rounding.
        `hidden` (a fresh tensor) takes the residual adds in place."""
        cfg = self.config
        num_tokens = hidden.shape[0]
        q_size = cfg.num_heads * cfg.head_dim
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        matmuls, input_norms, post_norms = self._forward_plan(batch_invariant)
        last = cfg.num_layers - 1
        x = ops.rms_norm(hidden, input_norms[0], eps)
        for layer, (qkv_of, output_of, gate_up_of, down_of) in enumerate(matmuls):
            qkv = qkv_of(x)
            ops.rope_(qkv, cos, sin, heads + kv_heads, head_dim)
            q = qkv[:, :q_size].view(num_tokens, heads, head_dim)
            k = qkv[:, q_size : q_size + cfg.kv_dim].view(num_tokens, kv_heads, head_dim)
            v = qkv[:, q_size + cfg.kv_dim :].view(num_tokens, kv_heads, head_dim)
            attn = attention(layer, q, k, v)
            if output_rows is not None and layer == last:
                hidden = hidden.index_select(0, output_rows)
                attn = attn.index_select(0, output_rows)
            x = ops.add_rms_norm_(hidden, output_of(attn), post_norms[layer], eps)
            down = down_of(ops.silu_mul(gate_up_of(x)))
            if layer < last:
                x = ops.add_rms_norm_(hidden, down, input_norms[layer + 1], eps)
            else:
                hidden += down
        return hidden

    def _forward_plan(self, batch_invariant: bool) -> _ForwardPlan:
        """Per layer, what `_forward_fused` multiplies by: x -> QKV (bias and head norms
        applied, as `_qkv`), attention -> output (`_output`), x -> gate_up, and -> down; and
        the norms' weights as plain lists. Packed weights with neither biases nor head norms
        (SmolLM2, Llama) are called directly: at one row the Python between a layer's
        matmuls, with a ParameterList's indexing and nn.Module's attribute lookups, was ~1/10
        of a step. Cached until the packed weights change."""
        if (self._plan_key is not None and self._plan_key[0] is self._packed
                and self._plan_key[1] == batch_invariant):
            return self._plan
        direct = (self._packed is not None and not batch_invariant and not self.qkv_bias
                  and not self.o_bias and not self.q_norm)
        matmuls: list[tuple[LayerMatmul, ...]]
        if direct:
            assert self._packed is not None
            matmuls = [tuple(w.matmul for w in layer) for layer in self._packed]
        else:
            matmuls = [(partial(self._qkv, layer, batch_invariant=batch_invariant),
                        partial(self._output, layer, batch_invariant=batch_invariant),
                        partial(self.weight_matmul, layer, GATE_UP,
                                batch_invariant=batch_invariant),
                        partial(self.weight_matmul, layer, DOWN,
                                batch_invariant=batch_invariant))
                       for layer in range(self.config.num_layers)]
        self._plan_key = (self._packed, batch_invariant)
        self._plan = (matmuls, list(self.input_layernorm), list(self.post_attention_layernorm))
        return self._plan

    def _qkv(self, layer: int, x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        """[T, q + 2 kv] for the layer's input: the fused projection, its bias (Qwen2) and
        the q and k head norms (Qwen3, which HF applies before RoPE), RoPE not yet applied."""
        qkv = self.weight_matmul(layer, QKV, x, batch_invariant)
        if self.qkv_bias:
            qkv += self.qkv_bias[layer]  # the matmul's result is ours to change
        if self.q_norm:
            cfg = self.config
            q_size = cfg.num_heads * cfg.head_dim
            for start, end, weight in ((0, q_size, self.q_norm[layer]),
                                       (q_size, q_size + cfg.kv_dim, self.k_norm[layer])):
                heads = qkv[:, start:end].view(qkv.shape[0], -1, cfg.head_dim)
                heads.copy_(_rms_norm(heads, weight, cfg.rms_norm_eps))
        return qkv

    def _output(self, layer: int, attn: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        out = self.weight_matmul(layer, O_PROJ, attn, batch_invariant)
        if self.o_bias:
            out += self.o_bias[layer]
        return out

    def weight_matmul(self, layer: int, index: int, x: torch.Tensor,
                      batch_invariant: bool = False) -> torch.Tensor:
        """x @ the layer's weight `index` (QKV, O_PROJ, GATE_UP or DOWN), as `forward` does."""
        if self._packed is not None:
            if batch_invariant:
                raise RuntimeError("this model's weights are packed for the default mode (an "
                                   "engine was built on it without batch invariance); load the "
                                   "model again for a batch-invariant engine")
            return self._packed[layer][index].matmul(x)
        weight = (self.qkv_t, self.o_t, self.gate_up_t, self.down_t)[index][layer]
        return (invariant_matmul if batch_invariant else matmul)(x, weight)

    def weight_bytes_read(self, rows: int) -> int:
        """Bytes of weights one forward pass over `rows` rows reads: each layer weight and the
        LM head in the representation its path multiplies by at that row count."""
        if self._packed is None:
            layers = sum(w[layer].nbytes for w in (self.qkv_t, self.o_t, self.gate_up_t,
                                                   self.down_t)
                         for layer in range(self.config.num_layers))
        else:
            layers = sum(bytes_read(w, rows) for layer in self._packed for w in layer)
        head: int = (bytes_read(self._lm_head_packed, rows) if self._lm_head_packed is not None
                     else self.lm_head.nbytes)
        return int(layers) + head

    def compute_logits(self, hidden: torch.Tensor, batch_invariant: bool = False
                       ) -> torch.Tensor:
        """Float32 logits [N, vocab] for pre-norm hidden states [N, hidden]."""
        x = (_rms_norm(hidden, self.norm, self.config.rms_norm_eps) if self._fused is None
             else self._fused.rms_norm(hidden, self.norm, self.config.rms_norm_eps))
        if self._lm_head_packed is not None and not batch_invariant:
            return self._lm_head_packed.matmul(x)
        return (invariant_linear if batch_invariant else F.linear)(x, self.lm_head).float()

    def to_device(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move the weights to `device` in `dtype` (e.g. bfloat16 on a GPU). Only before
        `pack_weights` (packing is the CPU's) and fused ops (CPU kernels)."""
        if self._packed is not None or self._fused is not None:
            raise RuntimeError("to_device: packed weights and fused ops are the CPU's; move "
                               "the model before building an engine on it")
        self.to(device=device, dtype=dtype)  # in place: a tied head stays the embedding's
        self._rope_cache_len = 0  # rebuilt on the device, in the dtype, at the next step
        self._quant_blocks.clear()  # raw GGUF blocks feed the CPU's 4-bit kernel only
