"""The Triton paged-attention kernels, run on this CPU under Triton's interpreter, against
attention computed plainly from the gathered context (the reference for every case: GQA,
contexts that end inside a block, a prefill chunk after cached blocks, 16-bit K/V)."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine import triton_attention

pytest.importorskip("triton")  # torch's CUDA wheels bring it; it is a declared dependency

BLOCK = 16
# The interpreter runs on CPU tensors; compiled kernels (TRITON_INTERPRET=0) need the GPU.
DEVICE = "cpu" if triton_attention.interpreted() else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 compiles the kernels for a GPU, and none is visible",
                allow_module_level=True)


def on(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int],
              scale: float) -> torch.Tensor:
    """q [T, H, D] at `positions` over K/V [L, KVH, D]: each query sees keys <= its position."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, 1)
    v = v.float().repeat_interleave(group, 1)
    scores = torch.einsum("thd,lhd->htl", q.float(), k) * scale
    visible = torch.arange(k.shape[0])[None, :] <= torch.tensor(positions)[:, None]
    weights = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
    return torch.einsum("htl,lhd->thd", weights, v)


def cache_with(sequences: list[torch.Tensor], num_blocks: int, dtype: torch.dtype,
               generator: torch.Generator) -> tuple[torch.Tensor, list[list[int]]]:
    """A [num_blocks, BLOCK, KVH, D] cache holding each sequence in shuffled blocks (the
    rest random: a kernel reading past a context would show)."""
    kvh, dim = sequences[0].shape[1:]
    cache = torch.randn(num_blocks, BLOCK, kvh, dim, generator=generator).to(dtype)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for seq in sequences:
        blocks = [free.pop() for _ in range(-(-seq.shape[0] // BLOCK))]
        for i, b in enumerate(blocks):
            part = seq[i * BLOCK : (i + 1) * BLOCK]
            cache[b, : part.shape[0]] = part.to(dtype)
        tables.append(blocks)
    return cache, tables


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "dtype", "atol"), [
    (4, 2, 64, torch.float32, 1e-5),
    (8, 8, 32, torch.float32, 1e-5),
    (9, 3, 48, torch.float32, 1e-5),  # head_dim not a power of two: padded lanes
    (4, 1, 64, torch.bfloat16, 1e-5),  # K/V stored in 16 bits, computed in float32
    (4, 2, 64, torch.float16, 1e-5),
])
def test_decode_matches_the_reference(heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
                                      atol: float) -> None:
    g = torch.Generator().manual_seed(heads * dim)
    lengths = [1, 15, 16, 17, 70]
    ks = [torch.randn(n, kv_heads, dim, generator=g) for n in lengths]
    vs = [torch.randn(n, kv_heads, dim, generator=g) for n in lengths]
    k_cache, tables = cache_with(ks, 24, dtype, g)
    v_cache = k_cache.clone()
    for seq, blocks in zip(vs, tables, strict=True):
        for i, b in enumerate(blocks):
            part = seq[i * BLOCK : (i + 1) * BLOCK]
            v_cache[b, : part.shape[0]] = part.to(dtype)
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lengths), heads, dim, generator=g)
    scale = dim**-0.5
    out = triton_attention.TritonKernel().paged_decode_attention(
        *on(q, k_cache, v_cache, table, torch.tensor(lengths)), scale).cpu()
    for i, n in enumerate(lengths):
        expected = reference(q[i : i + 1], ks[i].to(dtype), vs[i].to(dtype), [n - 1], scale)
        assert torch.allclose(out[i : i + 1], expected, atol=atol), (i, n)


@pytest.mark.parametrize(("start", "num_tokens"), [(0, 5), (0, 33), (16, 20), (45, 7), (3, 1)])
def test_prefill_of_a_chunk_over_cached_blocks_matches_the_reference(start: int,
                                                                    num_tokens: int) -> None:
    g = torch.Generator().manual_seed(start * 100 + num_tokens)
    heads, kv_heads, dim = 6, 2, 64
    total = start + num_tokens
    k = torch.randn(total, kv_heads, dim, generator=g)
    v = torch.randn(total, kv_heads, dim, generator=g)
    k_cache, (blocks,) = cache_with([k], 12, torch.float32, g)
    v_cache = torch.randn(k_cache.shape, generator=g)
    for i, b in enumerate(blocks):
        part = v[i * BLOCK : (i + 1) * BLOCK]
        v_cache[b, : part.shape[0]] = part
    q = torch.randn(num_tokens, heads, dim, generator=g)
    q_, k_, v_, table = on(q, k_cache, v_cache, torch.tensor(blocks))
    out = triton_attention.TritonKernel().paged_prefill_attention(
        q_, k_, v_, table, start, dim**-0.5).cpu()
    expected = reference(q, k, v, list(range(start, total)), dim**-0.5)
    assert torch.allclose(out, expected, atol=1e-5)


def test_write_kv_stores_in_the_caches_dtype() -> None:
    cache_k, cache_v = on(torch.zeros(4, BLOCK, 2, 8, dtype=torch.bfloat16),
                          torch.zeros(4, BLOCK, 2, 8, dtype=torch.bfloat16))
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    triton_attention.TritonKernel().write_kv(*on(k, v, cache_k, cache_v,
                                                 torch.tensor([0, 17, 63])))
    cache_k, cache_v = cache_k.cpu(), cache_v.cpu()
    assert torch.equal(cache_k[1, 1], k[1].to(torch.bfloat16))
    assert torch.equal(cache_v[3, 15], v[2].to(torch.bfloat16))
