"""`ModelRunner`: owns the paged KV cache and runs one `SchedulerOutput` as one forward pass.

The KV cache is one tensor `[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
head_dim]` on the model's device, float32 by default or 16-bit (`kv_dtype`: bfloat16 or
float16 halve its memory and the bytes a decode step reads; K/V are converted to the compute
dtype as attention reads them); position p of a request lives in block
`block_ids[p // block_size]`, slot `p % block_size` (see `scheduler_output.py`).

A step concatenates the tokens of all its chunks into one flat batch, so every projection and
MLP is one matmul over all tokens. Attention is the only per-sequence part:
- decode chunks (one token each) are batched in a few groups of similar context length: a
  group's K/V is gathered block-wise from the cache into `[B, max_blocks * block_size]`,
  padding masked out, one SDPA call per group and layer;
- prefill chunks (more than one token) each gather their own context and use a causal mask
  offset by `start_position`, so chunked prefill across block boundaries is exact.
Grouped-query attention is folded into the query length ([kv_heads, group * L, head_dim]) so
K/V are never repeated per query head.

By default attention instead runs kernels that read K/V straight from the blocks (no gather,
no padding, no groups): one decode call per layer for every decode row, one prefill call per
layer and chunk. On the CPU they are the compiled ones of `paged_attention.py` (float32 or
bfloat16 K/V);
on a CUDA device the Triton ones of `triton_attention.py` (`KVFLEET_ATTENTION=triton` runs
those on the CPU too, under Triton's interpreter: how the tests check them). Batch-invariant
mode keeps SDPA for both: a request recomputed after preemption redoes its decoded positions
as prefill, and only the SDPA padding rule below makes the two paths agree bit for bit.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfleet.engine import hugepages
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.llama import LlamaModel
from kvfleet.engine.model.loader import LoadedModel
from kvfleet.engine.paged_attention import Kernel, load_kernel
from kvfleet.engine.sampler import StepLogits
from kvfleet.engine.scheduler_output import ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)

KV_DTYPE = torch.float32


def kv_bytes_per_block(config: ModelConfig, block_size: int,
                       dtype: torch.dtype = KV_DTYPE) -> int:
    """Bytes of KV cache one block of `block_size` tokens takes across all layers."""
    return config.num_layers * 2 * block_size * config.kv_dim * dtype.itemsize


def num_blocks_for_budget(config: ModelConfig, block_size: int, budget_bytes: int,
                          dtype: torch.dtype = KV_DTYPE) -> int:
    """How many KV blocks fit in `budget_bytes` (at least 1 is not guaranteed: may return 0)."""
    return max(0, budget_bytes // kv_bytes_per_block(config, block_size, dtype))


def choose_kernel(device: torch.device, kv_dtype: torch.dtype, head_dim: int) -> Kernel | None:
    """The attention kernel for a cache on `device` in `kv_dtype`, or None for SDPA."""
    from kvfleet.engine import triton_attention
    from kvfleet.engine.paged_attention import ENV_SWITCH

    choice = os.environ.get(ENV_SWITCH, "kernel").lower()
    if choice == "sdpa":
        return None
    if device.type == "cuda" or choice == "triton":
        if triton_attention.available():
            return triton_attention.TritonKernel()
        logger.warning("Triton is not installed: attention on %s uses SDPA", device)
        return None
    # The C++ kernel vectorizes over 16-float lanes of a head, keeps a head in registers and
    # reads float32 or bfloat16 K/V (a float16 cache stays on SDPA).
    if kv_dtype not in (torch.float32, torch.bfloat16) or head_dim % 16 or head_dim > 256:
        return None
    return load_kernel()


# See `padded_context_len`: SDPA's CPU kernel reduces K/V in splits of 512 positions, and a
# split padded past 256 positions sums in a different order than a full one.
_PAD_MULTIPLE = 16
_KV_SPLIT = 512
# What one more attention batch per step costs (an SDPA call and gathers in every layer),
# in sequence-positions of attention work: ~3 ms per step vs ~5 us per sequence-position
# across all layers, measured on SmolLM2 with 2 CPU threads.
DECODE_GROUP_COST = 512


def padded_context_len(context_len: int, block_size: int) -> int:
    """The K/V length attention runs over for a context of `context_len` positions.

    Padding (masked out) is chosen so that a query's result does not depend on how far the
    batch it runs in is padded: measured on torch's CPU SDPA kernel, any padded length that is
    a multiple of 16 and ends at most 256 positions into a 512-position split gives bitwise the
    same result, so a request's logits are the same alone and in a batch of any lengths.
    """
    padded = -(-context_len // _PAD_MULTIPLE) * _PAD_MULTIPLE
    if padded % _KV_SPLIT > _KV_SPLIT // 2:
        padded = -(-padded // _KV_SPLIT) * _KV_SPLIT
    return -(-padded // block_size) * block_size


def decode_groups(padded: list[int]) -> list[range]:
    """Split decode rows, sorted by padded context length, into consecutive groups that
    minimize the attention work: a group costs its size x its longest padded length plus
    `DECODE_GROUP_COST`. Dynamic programming over the split points, O(n^2) for n rows."""
    n = len(padded)
    best = [0] * (n + 1)  # best[j]: the cost of rows [0, j)
    start = [0] * (n + 1)  # where the last group of that best split starts
    for j in range(1, n + 1):
        best[j], start[j] = min(
            (best[i] + (j - i) * padded[j - 1] + DECODE_GROUP_COST, i) for i in range(j)
        )
    groups: list[range] = []
    j = n
    while j > 0:
        groups.append(range(start[j], j))
        j = start[j]
    return groups[::-1]


@dataclass(frozen=True, slots=True)
class _DecodeBatch:
    token_index: torch.Tensor  # [B] rows of the flat batch
    block_table: torch.Tensor  # [B, padded_blocks], padded with block 0
    mask: torch.Tensor  # [B, 1, 1, padded_blocks * block_size], True = attend


@dataclass(frozen=True, slots=True)
class _KernelDecode:
    token_index: torch.Tensor  # [B] rows of the flat batch
    block_table: torch.Tensor  # [B, max blocks], padded with block 0 (never read)
    context_lens: torch.Tensor  # [B]
    # The decode rows are every row of the step, in order (no prefill chunk in it): q goes to
    # the kernel as it is and the kernel's output is the layer's, with no gather or scatter.
    whole_step: bool


@dataclass(frozen=True, slots=True)
class _PrefillChunk:
    first_row: int
    num_tokens: int
    block_table: torch.Tensor  # [padded_blocks], padded with block 0
    start: int  # positions before the chunk: cached context every query sees
    # Either the whole context's mask ([group * num_tokens, padded_blocks * block_size], True
    # = attend) or, for `_split_attention`, the chunk's own causal part as an additive mask
    # ([group * num_tokens, num_tokens]); neither for the kernel, which masks by position.
    mask: torch.Tensor | None
    new_mask: torch.Tensor | None


# SDPA's CPU kernel, which also returns each query row's log-sum-exp (not in every torch).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, n: int,
                     new_mask: torch.Tensor) -> torch.Tensor:
    """Causal attention of a chunk's `n` queries (GQA-folded, [kv_heads, group * n, dim]) over
    `start` cached positions plus its own, as two parts merged by their log-sum-exp. Every
    query sees all of the cached part, so it runs without a mask, which the CPU kernel does
    ~30 % faster than the masked whole (1 thread, 112 queries over 1,024 positions). A whole
    prefix-cache hit (112 new tokens after 912 cached) took 210 vs 216 ms (median of 40)."""
    assert _FLASH_CPU is not None
    cached, cached_lse = _FLASH_CPU(q[None], k[None, :, :start], v[None, :, :start])
    own, own_lse = _FLASH_CPU(q[None], k[None, :, start : start + n], v[None, :, start : start + n],
                              attn_mask=new_mask)
    # Weights exp(lse_part - lse_all): the cached part's is sigmoid(cached_lse - own_lse), so
    # the merge is one lerp (3 ops instead of 8: 15 vs 47 us a layer on a prefix hit).
    weight = torch.sigmoid(cached_lse - own_lse).unsqueeze(-1).to(own.dtype)
    merged: torch.Tensor = torch.lerp(own, cached, weight)
    return merged[0]


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[*table.shape[:-1], num_blocks * block_size, kv_heads, head_dim] K or V of a block table."""
    blocks = cache.index_select(0, block_table.reshape(-1))
    return blocks.view(*block_table.shape[:-1], -1, *cache.shape[2:])


class _PagedAttention:
    """The `Attention` the model calls for one step: writes K/V to the cache, then attends."""

    def __init__(
        self,
        runner: ModelRunner,
        slots: torch.Tensor,
        decode: list[_DecodeBatch] | _KernelDecode,
        prefills: list[_PrefillChunk],
    ) -> None:
        self._runner = runner
        self._slots = slots
        self._decode = decode
        self._prefills = prefills
        self._scale = runner.config.head_dim**-0.5

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        cfg = self._runner.config
        group = cfg.num_queries_per_kv
        k_cache, v_cache = self._runner.layer_caches[layer]
        if self._runner.kernel is not None:
            self._runner.kernel.write_kv(k, v, k_cache, v_cache, self._slots)
        else:
            # index_copy_/index_select, not `t[idx] = x` / `t[idx]`: advanced indexing on CPU
            # is 10-100x slower for these shapes (measured), and it runs 60 times per step.
            k_cache.view(-1, cfg.num_kv_heads, cfg.head_dim).index_copy_(
                0, self._slots, k.to(k_cache.dtype))
            v_cache.view(-1, cfg.num_kv_heads, cfg.head_dim).index_copy_(
                0, self._slots, v.to(v_cache.dtype))
        if isinstance(self._decode, _KernelDecode) and self._decode.whole_step:
            return self._kernel_decode(q, k_cache, v_cache).view(q.shape[0], -1)
        out = q.new_empty(q.shape[0], cfg.num_heads * cfg.head_dim)
        if isinstance(self._decode, _KernelDecode):
            attended = self._kernel_decode(q.index_select(0, self._decode.token_index), k_cache,
                                           v_cache)
            out.index_copy_(0, self._decode.token_index, attended.view(attended.shape[0], -1))
        else:
            for d in self._decode:
                batch = d.token_index.shape[0]
                qd = q.index_select(0, d.token_index).view(batch, cfg.num_kv_heads, group, -1)
                kd = _gather(k_cache, d.block_table).transpose(1, 2).to(q.dtype)
                vd = _gather(v_cache, d.block_table).transpose(1, 2).to(q.dtype)
                od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask)
                out.index_copy_(0, d.token_index, od.reshape(batch, -1))
        for p in self._prefills:
            rows = slice(p.first_row, p.first_row + p.num_tokens)
            if self._runner.kernel is not None:
                out[rows] = self._runner.kernel.paged_prefill_attention(
                    q[rows], k_cache, v_cache, p.block_table, p.start, self._scale
                ).view(p.num_tokens, -1)
                continue
            qp = (
                q[rows]
                .view(p.num_tokens, cfg.num_kv_heads, group, cfg.head_dim)
                .permute(1, 2, 0, 3)
                .reshape(cfg.num_kv_heads, group * p.num_tokens, cfg.head_dim)
            )
            kp = _gather(k_cache, p.block_table).transpose(0, 1).to(q.dtype)
            vp = _gather(v_cache, p.block_table).transpose(0, 1).to(q.dtype)
            if p.new_mask is not None:
                op = _split_attention(qp, kp, vp, p.start, p.num_tokens, p.new_mask)
            else:
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask)
            out[rows] = (
                op.view(cfg.num_kv_heads, group, p.num_tokens, cfg.head_dim)
                .permute(2, 0, 1, 3)
                .reshape(p.num_tokens, -1)
            )
        return out

    def _kernel_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                       ) -> torch.Tensor:
        plan, kernel = self._decode, self._runner.kernel
        assert isinstance(plan, _KernelDecode) and kernel is not None  # planned only with one
        return kernel.paged_decode_attention(q, k_cache, v_cache, plan.block_table,
                                             plan.context_lens, self._scale)


class ModelRunner:
    """Runs scheduled chunks over the paged KV cache and returns next-token logits."""

    def __init__(self, model: LoadedModel | LlamaModel, num_blocks: int, block_size: int,
                 batch_invariant: bool = False, attention_kernel: bool = True,
                 kv_dtype: torch.dtype = KV_DTYPE) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.model: LlamaModel = model.model if isinstance(model, LoadedModel) else model
        self.config = self.model.config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.batch_invariant = batch_invariant
        cfg = self.config
        self.device = self.model.embed_tokens.device
        self.kernel: Kernel | None = (
            choose_kernel(self.device, kv_dtype, cfg.head_dim)
            if attention_kernel and not batch_invariant else None)
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = (hugepages.zeros(*shape, dtype=kv_dtype) if self.device.type == "cpu"
                         else torch.zeros(shape, dtype=kv_dtype, device=self.device))
        # Each layer's (K, V) views, made once: indexing the cache made two views per layer
        # on every step.
        self.layer_caches = [(self.kv_cache[layer, 0], self.kv_cache[layer, 1])
                             for layer in range(cfg.num_layers)]

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def _check_chunk(self, chunk: ScheduledChunk) -> None:
        end = chunk.start_position + len(chunk.token_ids)
        # Invariants of SchedulerOutput; a violation is a scheduler bug, so fail loudly here
        # rather than write K/V into another request's block.
        if not chunk.token_ids or chunk.start_position < 0:
            raise ValueError(f"chunk of request {chunk.request_id!r} is empty or starts before 0")
        if len(chunk.block_ids) * self.block_size < end:
            raise ValueError(
                f"chunk of request {chunk.request_id!r} covers positions up to {end} "
                f"but has only {len(chunk.block_ids)} blocks of {self.block_size}"
            )
        if any(not 0 <= b < self.num_blocks for b in chunk.block_ids):
            raise ValueError(
                f"chunk of request {chunk.request_id!r} names a block outside "
                f"[0, {self.num_blocks})"
            )

    def _apply_block_copies(self, copies: tuple[tuple[int, int], ...]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        # Gather first, then scatter: a block may be both a source and a destination.
        self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src))

    def _block_table(
        self, chunk: ScheduledChunk, context_len: int, padded_blocks: int
    ) -> torch.Tensor:
        """The chunk's blocks covering `context_len` positions, padded with block 0 (masked)."""
        table = torch.zeros(padded_blocks, dtype=torch.long)
        used = chunk.block_ids[: -(-context_len // self.block_size)]
        table[: len(used)] = torch.tensor(used, dtype=torch.long)
        return table.to(self.device)

    def _plan_prefill(self, chunk: ScheduledChunk, first_row: int) -> _PrefillChunk:
        bs, n, start = self.block_size, len(chunk.token_ids), chunk.start_position
        padded_blocks = padded_context_len(start + n, bs) // bs
        table = self._block_table(chunk, start + n, padded_blocks)
        if self.kernel is not None:  # reads the table itself, masks by position
            return _PrefillChunk(first_row, n, table, start, None, None)
        group = self.config.num_queries_per_kv
        if (start > 0 and not self.batch_invariant and _FLASH_CPU is not None
                and self.device.type == "cpu"):
            # Query row (g, i) of the GQA-folded chunk is token i: it sees new tokens <= i.
            own = torch.arange(n).repeat(group)
            new_mask = torch.zeros(group * n, n).masked_fill_(
                torch.arange(n)[None, :] > own[:, None], float("-inf"))
            return _PrefillChunk(first_row, n, table, start, None,
                                 new_mask.to(self.model.embed_tokens.dtype))
        # Batch-invariant mode keeps one SDPA call over the padded context (see
        # `padded_context_len`): the split's summation order would depend on the chunking.
        query_pos = torch.arange(start, start + n).repeat(group)
        mask = torch.arange(padded_blocks * bs)[None, :] <= query_pos[:, None]
        return _PrefillChunk(first_row, n, table, start, mask.to(self.device), None)

    def _plan_decode(self, chunks: list[ScheduledChunk], rows: list[int]) -> list[_DecodeBatch]:
        """Decode chunks grouped by context length, one attention batch per group.

        Each group is padded to its own longest context, not the step's: with contexts of 40
        and 700 in one step, a single batch gathers and attends over 704 positions for every
        sequence, which at 32 running with mixed lengths was most of the step (measured). The
        padding rule keeps each row's result independent of its group (`padded_context_len`).
        """
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].start_position)
        padded = [padded_context_len(chunks[i].start_position + 1, self.block_size)
                  for i in order]
        return [self._decode_batch([chunks[order[k]] for k in group],
                                   [rows[order[k]] for k in group])
                for group in decode_groups(padded)]

    def _plan_kernel_decode(self, chunks: list[ScheduledChunk], rows: list[int],
                            whole_step: bool) -> _KernelDecode:
        context = [c.start_position + 1 for c in chunks]
        width = -(-max(context) // self.block_size)
        table = torch.zeros(len(chunks), width, dtype=torch.long)
        for i, (c, n) in enumerate(zip(chunks, context, strict=True)):
            used = c.block_ids[: -(-n // self.block_size)]
            table[i, : len(used)] = torch.tensor(used, dtype=torch.long)
        return _KernelDecode(torch.tensor(rows, dtype=torch.long, device=self.device),
                             table.to(self.device),
                             torch.tensor(context, dtype=torch.long, device=self.device),
                             whole_step)

    def _decode_batch(self, chunks: list[ScheduledChunk], rows: list[int]) -> _DecodeBatch:
        bs = self.block_size
        context = [c.start_position + 1 for c in chunks]
        padded_blocks = padded_context_len(max(context), bs) // bs
        table = torch.stack(
            [self._block_table(c, n, padded_blocks) for c, n in zip(chunks, context, strict=True)]
        )
        mask = torch.arange(padded_blocks * bs)[None, :] < torch.tensor(context)[:, None]
        return _DecodeBatch(
            token_index=torch.tensor(rows, dtype=torch.long, device=self.device),
            block_table=table,
            mask=mask[:, None, None, :].to(self.device),
        )

    def _plan(
        self, chunks: tuple[ScheduledChunk, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, _PagedAttention, list[int]]:
        """Flat token batch, positions, attention plan and rows to sample for one step."""
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        decode_rows: list[int] = []
        decode_chunks: list[ScheduledChunk] = []
        prefills: list[_PrefillChunk] = []
        for chunk in chunks:
            self._check_chunk(chunk)
            first_row = len(token_ids)
            n, start = len(chunk.token_ids), chunk.start_position
            token_ids.extend(chunk.token_ids)
            positions.extend(range(start, start + n))
            slots.extend(chunk.block_ids[p // bs] * bs + p % bs for p in range(start, start + n))
            if chunk.sample:
                last_rows.append(first_row + n - 1)
            if n == 1:
                decode_rows.append(first_row)
                decode_chunks.append(chunk)
            else:
                prefills.append(self._plan_prefill(chunk, first_row))
        decode: list[_DecodeBatch] | _KernelDecode = []
        if decode_chunks and self.kernel is not None:
            decode = self._plan_kernel_decode(decode_chunks, decode_rows,
                                              whole_step=not prefills)
        elif decode_chunks:
            decode = self._plan_decode(decode_chunks, decode_rows)
        dev = self.device
        attention = _PagedAttention(self, torch.tensor(slots, dtype=torch.long, device=dev),
                                    decode, prefills)
        return (
            torch.tensor(token_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            attention,
            last_rows,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepLogits:
        """Run one step; float32 logits [vocab] of the last position of each sampled chunk."""
        self._apply_block_copies(out.block_copies)
        if out.is_empty:
            return StepLogits.empty()
        token_ids, positions, attention, last_rows = self._plan(out.chunks)
        rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)
        if self.batch_invariant or len(last_rows) == len(token_ids):
            # Batch-invariant mode keeps every matmul's row count what it was (see llama.py).
            hidden = self.model(token_ids, positions, attention, self.batch_invariant)
            last = hidden if len(last_rows) == len(token_ids) else hidden.index_select(0, rows)
        else:
            last = self.model(token_ids, positions, attention, output_rows=rows)
        sampled = [c.request_id for c in out.chunks if c.sample]
        if not sampled:
            return StepLogits.empty()
        logits = self.model.compute_logits(last, self.batch_invariant)
        # The sampler runs on the CPU (its generators, the requests' token lists): one copy
        # of [sampled, vocab] float32 a step.
        return StepLogits(sampled, logits if logits.device.type == "cpu" else logits.cpu())
