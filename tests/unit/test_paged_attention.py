"""The compiled attention kernels (decode, prefill) against SDPA over a gathered copy of the
same blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from native_helpers import warning_when_every_build_fails

from kvfleet.engine import paged_attention
from kvfleet.engine.paged_attention import Kernel, load_kernel

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    # The test machine has a C++ compiler and ninja: the kernel must build here, or every
    # other engine test would silently exercise only the SDPA fallback.
    built = load_kernel()
    assert built is not None, "the paged attention kernel did not build (see the log)"
    return built


def random_cache(num_blocks: int, kv_heads: int, head_dim: int, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              table: torch.Tensor, context: int) -> torch.Tensor:
    """[heads, head_dim] attention of one sequence's query over its first `context` slots."""
    heads, kv_heads = q.shape[0], k_cache.shape[2]
    k = k_cache.index_select(0, table).flatten(0, 1)[:context]  # [context, kv_heads, dim]
    v = v_cache.index_select(0, table).flatten(0, 1)[:context]
    k, v = (t.transpose(0, 1).repeat_interleave(heads // kv_heads, 0) for t in (k, v))
    return F.scaled_dot_product_attention(q[:, None], k, v)[:, 0]


# 7 sequences: on up to 3 threads, groups of 2-4 heads at head_dim 64 or 128 take tasks of a
# whole group (the kernel's grouped path); the rest one task per query head.
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(9, 3, 64), (8, 2, 128), (16, 4, 64), (4, 4, 32), (8, 1, 16)])
def test_matches_sdpa_over_gathered_blocks(
    kernel: Kernel, heads: int, kv_heads: int, head_dim: int
) -> None:
    num_blocks = 64
    k_cache, v_cache = random_cache(num_blocks, kv_heads, head_dim, seed=heads)
    gen = torch.Generator().manual_seed(1)
    contexts = [1, 15, 16, 17, 200, 333, 5]
    width = -(-max(contexts) // BLOCK_SIZE)
    # Each sequence's blocks are scattered across the pool; unused table slots are garbage
    # that the kernel must never read (block ids beyond the context are not checked).
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in contexts])
    q = torch.randn(len(contexts), heads, head_dim, generator=gen)
    out = kernel.paged_decode_attention(q, k_cache, v_cache, tables,
                                        torch.tensor(contexts), head_dim**-0.5)
    for b, context in enumerate(contexts):
        expected = reference(q[b], k_cache, v_cache, tables[b], context)
        torch.testing.assert_close(out[b], expected, atol=2e-6, rtol=1e-5)


def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch(kernel: Kernel) -> None:
    k_cache, v_cache = random_cache(96, 3, 64, seed=7)
    gen = torch.Generator().manual_seed(2)
    contexts = torch.randint(1, 400, (24,), generator=gen)
    tables = torch.stack([torch.randperm(96, generator=gen)[:25] for _ in range(24)])
    q = torch.randn(24, 9, 64, generator=gen)
    # 24 sequences run as tasks of a whole query group; one sequence alone on one thread as a
    # task per query head. A different split of tasks across threads changes nothing either.
    together = kernel.paged_decode_attention(q, k_cache, v_cache, tables, contexts, 0.125)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for b in (0, 7, 23):
            alone = kernel.paged_decode_attention(
                q[b : b + 1].clone(), k_cache, v_cache, tables[b : b + 1].clone(),
                contexts[b : b + 1].clone(), 0.125)
            assert torch.equal(alone[0], together[b])
    finally:
        torch.set_num_threads(threads)


def test_decode_reads_query_rows_in_place_from_a_wider_tensor(kernel: Kernel) -> None:
    # The runner passes a pure decode step's q as a view into the fused QKV projection.
    k_cache, v_cache = random_cache(32, 3, 64, seed=3)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (9 + 2 * 3) * 64, generator=gen)
    q = qkv[:, : 9 * 64].view(5, 9, 64)
    assert not q.is_contiguous()
    tables = torch.stack([torch.randperm(32, generator=gen)[:8] for _ in range(5)])
    contexts = torch.tensor([1, 16, 17, 100, 128])
    strided = kernel.paged_decode_attention(q, k_cache, v_cache, tables, contexts, 0.125)
    copied = kernel.paged_decode_attention(q.contiguous(), k_cache, v_cache, tables, contexts,
                                           0.125)
    assert strided.is_contiguous() and torch.equal(strided, copied)
    with pytest.raises(RuntimeError, match="q's rows may be strided"):
        kernel.paged_decode_attention(q.transpose(1, 2), k_cache, v_cache, tables, contexts, 0.1)


def test_rejects_a_context_beyond_the_block_table_or_a_block_outside_the_pool(
    kernel: Kernel,
) -> None:
    k_cache, v_cache = random_cache(4, 1, 16, seed=0)
    q = torch.randn(1, 1, 16)
    with pytest.raises(RuntimeError, match="context length 33 of sequence 0 outside"):
        kernel.paged_decode_attention(q, k_cache, v_cache, torch.tensor([[0, 1]]),
                                      torch.tensor([33]), 0.25)
    with pytest.raises(RuntimeError, match="block 9 of sequence 0 outside"):
        kernel.paged_decode_attention(q, k_cache, v_cache, torch.tensor([[0, 9]]),
                                      torch.tensor([20]), 0.25)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.paged_decode_attention(q.double(), k_cache, v_cache, torch.tensor([[0]]),
                                      torch.tensor([3]), 0.25)


def prefill_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      table: torch.Tensor, start: int, block_size: int = BLOCK_SIZE
                      ) -> torch.Tensor:
    """[n, heads, head_dim] causal attention of tokens at positions start.. (float64 SDPA)."""
    n, heads, _ = q.shape
    kv_heads = k_cache.shape[2]
    k, v = (c.index_select(0, table).flatten(0, 1)[: start + n].transpose(0, 1)
            .repeat_interleave(heads // kv_heads, 0).double() for c in (k_cache, v_cache))
    mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(), k, v, attn_mask=mask)
    return out.transpose(0, 1).float()


@pytest.mark.parametrize(
    ("n", "start", "heads", "kv_heads", "head_dim", "block_size"),
    [
        (103, 921, 9, 3, 64, 16),  # a prefix-cache hit of the shared-prefix benchmark
        (300, 0, 9, 3, 64, 16),  # a cold prompt: causal from position 0, many tiles
        (1, 0, 9, 3, 64, 16),
        (5, 3, 4, 4, 16, 4),  # no GQA, a block size other than the 16-lane chunk
        (37, 100, 8, 1, 128, 16),  # one kv head for 8 query heads
        (20, 40, 6, 2, 256, 8),  # the widest head the kernel takes
        (13, 17, 3, 3, 80, 32),  # a head of 5 lanes, positions ending mid-chunk
    ],
)
def test_prefill_matches_causal_sdpa_over_gathered_blocks(
    kernel: Kernel, n: int, start: int, heads: int, kv_heads: int, head_dim: int,
    block_size: int,
) -> None:
    gen = torch.Generator().manual_seed(n + start)
    num_blocks = 128
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    # Scattered blocks, plus table entries past the context that must never be read.
    table = torch.randperm(num_blocks, generator=gen)[: -(-(start + n) // block_size) + 2]
    # q as the model passes it: rows of a wider projection (Q, then K's heads), not contiguous.
    qk = torch.randn(n, heads + kv_heads, head_dim, generator=gen)
    q = qk[:, :heads]
    out = kernel.paged_prefill_attention(q, k_cache, v_cache, table, start, head_dim**-0.5)
    expected = prefill_reference(q, k_cache, v_cache, table, start, block_size)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_prefill_gives_a_token_the_same_bits_however_its_prompt_is_chunked(
    kernel: Kernel,
) -> None:
    k_cache, v_cache = random_cache(64, 3, 64, seed=3)
    gen = torch.Generator().manual_seed(4)
    table = torch.randperm(64, generator=gen)[:40]
    q = torch.randn(250, 9, 64, generator=gen)
    whole = kernel.paged_prefill_attention(q, k_cache, v_cache, table, 30, 0.125)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # another split of tiles across threads changes nothing either
    try:
        first = 0
        for size in (1, 17, 100, 5, 127):  # chunk edges inside tiles and inside 16-position chunks
            part = kernel.paged_prefill_attention(q[first : first + size].clone(), k_cache,
                                                  v_cache, table, 30 + first, 0.125)
            assert torch.equal(part, whole[first : first + size])
            first += size
    finally:
        torch.set_num_threads(threads)


def test_prefill_rejects_positions_beyond_the_block_table_or_a_block_outside_the_pool(
    kernel: Kernel,
) -> None:
    k_cache, v_cache = random_cache(4, 1, 16, seed=0)
    q = torch.randn(3, 1, 16)
    with pytest.raises(RuntimeError, match=r"positions \[31, 34\) outside the block table's 32"):
        kernel.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0, 1]), 31, 0.25)
    with pytest.raises(RuntimeError, match="block 9 outside"):
        kernel.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0, 9]), 20, 0.25)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.paged_prefill_attention(q.double(), k_cache, v_cache, torch.tensor([0]), 0, 0.25)


def test_write_kv_puts_each_token_in_its_slot_like_index_copy(kernel: Kernel) -> None:
    k_cache, v_cache = random_cache(6, 3, 32, seed=30)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    qkv = torch.randn(5, 400, generator=torch.Generator().manual_seed(31))  # strided rows
    k, v = qkv[:, 100:196].view(5, 3, 32), qkv[:, 196:292].view(5, 3, 32)
    slots = torch.tensor([17, 3, 95, 40, 41])
    want_k.view(-1, 3, 32).index_copy_(0, slots, k)
    want_v.view(-1, 3, 32).index_copy_(0, slots, v)
    kernel.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_a_bfloat16_cache_gives_what_float32_gives_on_the_same_values(kernel: Kernel) -> None:
    """A bfloat16 element widens to float32 exactly, so decode and prefill over a bfloat16
    cache match the float32 kernels over that cache converted, bit for bit; write_kv rounds
    as torch does."""
    gen = torch.Generator().manual_seed(40)
    k_cache, v_cache = (c.bfloat16() for c in random_cache(32, 3, 64, seed=41))
    k32, v32 = k_cache.float(), v_cache.float()
    table = torch.randperm(32, generator=gen)
    q = torch.randn(4, 9, 64, generator=gen)
    contexts = torch.tensor([1, 17, 200, 512])
    tables = table[None].repeat(4, 1)
    assert torch.equal(kernel.paged_decode_attention(q, k_cache, v_cache, tables, contexts, 0.125),
                       kernel.paged_decode_attention(q, k32, v32, tables, contexts, 0.125))
    assert torch.equal(kernel.paged_prefill_attention(q, k_cache, v_cache, table, 300, 0.125),
                       kernel.paged_prefill_attention(q, k32, v32, table, 300, 0.125))
    k, v = torch.randn(2, 5, 3, 64, generator=gen)
    slots = torch.tensor([3, 77, 500, 12, 13])
    kernel.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 3, 64)[slots], k.bfloat16())
    assert torch.equal(v_cache.view(-1, 3, 64)[slots], v.bfloat16())
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        kernel.paged_decode_attention(q, k_cache, v32, tables, contexts, 0.125)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        kernel.write_kv(k, v, k_cache.half(), v_cache.half(), slots)


def test_write_kv_rejects_a_slot_outside_the_pool_and_mismatched_shapes(kernel: Kernel) -> None:
    k_cache, v_cache = random_cache(2, 2, 16, seed=32)
    k = torch.randn(2, 2, 16)
    with pytest.raises(RuntimeError, match=r"write_kv: slot 32 outside \[0, 32\)"):
        kernel.write_kv(k, k, k_cache, v_cache, torch.tensor([0, 32]))
    with pytest.raises(RuntimeError, match="write_kv: k's heads and head_dim must match"):
        kernel.write_kv(torch.randn(2, 1, 16), torch.randn(2, 1, 16), k_cache, v_cache,
                        torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match=r"write_kv: slots must be a contiguous int64 \[2\]"):
        kernel.write_kv(k, k, k_cache, v_cache, torch.tensor([0]))


def test_switched_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paged_attention.ENV_SWITCH, "sdpa")
    assert load_kernel() is None


def test_a_failed_build_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    warning = warning_when_every_build_fails(load_kernel, monkeypatch, caplog, tmp_path)
    assert "uses SDPA" in warning
