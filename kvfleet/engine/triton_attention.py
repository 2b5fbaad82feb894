"""Paged attention as Triton kernels: the attention of a step on a CUDA device.

The same `Kernel` the model runner uses on the CPU (`paged_attention.py`), reading K/V straight
from the cache blocks through the block table, with no gather and no padding:

- decode: one program per (sequence, query head) walks the sequence's blocks with an online
  softmax (running max and sum), so one pass over the context reads each K/V byte once;
- prefill of a chunk: one program per (tile of BLOCK_M queries, query head) over the cached
  prefix and the chunk's own positions, causal by position (query at `start + i` sees keys
  `<= start + i`), so a chunk after a prefix-cache hit attends over cached blocks in place.

K/V may be float32, bfloat16 or float16 (the pool's kvCacheDtype): blocks are loaded in their
dtype and converted to float32 for the products and the softmax, which accumulate in float32.
Grouped-query attention maps query head h to KV head h // group.

Tested on this CPU-only project under Triton's interpreter (`TRITON_INTERPRET=1`) against the
reference attention (tests/unit/test_triton_attention.py) and inside the model runner against
its SDPA path; it has not yet run on a GPU (bench/gpu_check.py is the check to run there).
"""

from __future__ import annotations

import os
from typing import Any

import torch

INTERPRET_ENV = "TRITON_INTERPRET"


def available() -> bool:
    """Whether Triton is importable (it ships with torch's CUDA wheels)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreted() -> bool:
    return os.environ.get(INTERPRET_ENV, "") == "1"


def _kernels() -> tuple[Any, Any]:
    """The jitted kernels, defined on first use (importing triton costs ~1 s)."""
    global _CACHED
    if _CACHED is not None:
        return _CACHED
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def decode(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, scale,  # type: ignore[no-untyped-def]
               stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb,
               stride_ob, stride_oh,
               GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
               DIM_PAD: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        context = tl.load(lens_ptr + seq)
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + dims, mask=dim_ok,
                    other=0.0).to(tl.float32)
        slots = tl.arange(0, BLOCK_SIZE)
        running_max = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), 0)
        running_sum = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), 0)
        acc = tl.zeros([DIM_PAD], tl.float32)
        for i in range(0, tl.cdiv(context, BLOCK_SIZE)):
            block = tl.load(table_ptr + seq * stride_tb + i)
            positions = i * BLOCK_SIZE + slots
            valid = positions < context
            offsets = (block * stride_kb + slots[:, None] * stride_ks + kv_head * stride_kh
                       + dims[None, :])
            both = valid[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + offsets, mask=both, other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], 1) * scale
            scores = tl.where(valid, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 0))
            weights = tl.exp(scores - new_max)
            rescale = tl.exp(running_max - new_max)
            v = tl.load(v_ptr + offsets, mask=both, other=0.0).to(tl.float32)
            acc = acc * rescale + tl.sum(weights[:, None] * v, 0)
            running_sum = running_sum * rescale + tl.sum(weights, 0)
            running_max = new_max
        out = acc / running_sum
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims,
                 out.to(out_ptr.dtype.element_ty), mask=dim_ok)

    @triton.jit  # type: ignore[untyped-decorator]
    def prefill(q_ptr, k_ptr, v_ptr, table_ptr, out_ptr, scale, start, num_tokens,  # type: ignore[no-untyped-def]
                stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh,
                GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
        tile = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < num_tokens
        query_pos = start + rows
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        slots = tl.arange(0, BLOCK_SIZE)
        running_max = tl.max(tl.full([BLOCK_M, BLOCK_SIZE], float("-inf"), tl.float32), 1)
        running_sum = tl.sum(tl.zeros([BLOCK_M, BLOCK_SIZE], tl.float32), 1)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        # The tile's last query sees positions up to start + its row: no block past it.
        last = tl.minimum(start + (tile + 1) * BLOCK_M, start + num_tokens)
        for i in range(0, tl.cdiv(last, BLOCK_SIZE)):
            block = tl.load(table_ptr + i)
            key_pos = i * BLOCK_SIZE + slots
            offsets = (block * stride_kb + slots[:, None] * stride_ks + kv_head * stride_kh
                       + dims[None, :])
            in_range = (key_pos < start + num_tokens)[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale
            visible = (key_pos[None, :] <= query_pos[:, None]) & row_ok[:, None]
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            # Rows that see nothing yet (padding rows) keep a -inf max: exp(-inf - -inf) would
            # be NaN, so their weights and rescale are pinned to 0 and 1.
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            weights = tl.exp(scores - safe_max[:, None])
            rescale = tl.where(running_max == float("-inf"), 1.0,
                               tl.exp(running_max - safe_max))
            v = tl.load(v_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
            acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], 1)
            running_sum = running_sum * rescale + tl.sum(weights, 1)
            running_max = new_max
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])

    _CACHED = (decode, prefill)
    return _CACHED


_CACHED: tuple[Any, Any] | None = None
PREFILL_BLOCK_M = 16


def _dim_pad(head_dim: int) -> int:
    return 1 << (head_dim - 1).bit_length()


class TritonKernel:
    """`paged_attention.Kernel` on a CUDA device (or the CPU, under Triton's interpreter).

    k_cache / v_cache: [num_blocks, block_size, kv_heads, head_dim] of one layer, contiguous
    per block; q: [T, heads, head_dim]; results in q's dtype.
    """

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        flat_k = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
        flat_v = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
        flat_k.index_copy_(0, slots, k.to(k_cache.dtype))
        flat_v.index_copy_(0, slots, v.to(v_cache.dtype))

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        decode, _ = _kernels()
        batch, heads, head_dim = q.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        decode[(batch, heads)](
            q, k_cache, v_cache, tables, lens, out, scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            tables.stride(0), out.stride(0), out.stride(1),
            GROUP=heads // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
            DIM_PAD=_dim_pad(head_dim))
        return out

    def paged_prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, block_table: torch.Tensor, start: int,
                                scale: float) -> torch.Tensor:
        _, prefill = _kernels()
        num_tokens, heads, head_dim = q.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        table = block_table.to(torch.int32).contiguous()
        grid = (-(-num_tokens // PREFILL_BLOCK_M), heads)
        prefill[grid](
            q, k_cache, v_cache, table, out, scale, start, num_tokens,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            out.stride(0), out.stride(1),
            GROUP=heads // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
            DIM_PAD=_dim_pad(head_dim), BLOCK_M=PREFILL_BLOCK_M)
        return out
