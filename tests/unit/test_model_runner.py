"""ModelRunner over the paged KV cache vs a plain full-sequence forward of the same tiny model."""

from __future__ import annotations

import random
from types import MappingProxyType

import pytest
import torch
import torch.nn.functional as F
from tiny_llama import random_weights, tiny_config

from kvfleet.engine.model.llama import LlamaModel
from kvfleet.engine.model_runner import (
    DECODE_GROUP_COST,
    ModelRunner,
    decode_groups,
    kv_bytes_per_block,
    num_blocks_for_budget,
    padded_context_len,
)
from kvfleet.engine.scheduler_output import ScheduledChunk, SchedulerOutput

BLOCK_SIZE = 4
TOLERANCE = 1e-4  # float32 through different attention kernels; tiny-model logits are O(10)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    config = tiny_config()
    return LlamaModel(config, random_weights(config, seed=1)).eval()


class ContiguousAttention:
    """Reference attention for one sequence starting at position 0 (no cache, no paging)."""

    def __init__(self, model: LlamaModel) -> None:
        self.group = model.config.num_queries_per_kv

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        q_, k_, v_ = (t.transpose(0, 1) for t in (q, k, v))
        k_, v_ = (t.repeat_interleave(self.group, dim=0) for t in (k_, v_))
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
        return out.transpose(0, 1).reshape(q.shape[0], -1)


@torch.inference_mode()
def reference_logits(model: LlamaModel, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] of every position of `token_ids`."""
    ids = torch.tensor(token_ids)
    hidden = model(ids, torch.arange(len(token_ids)), ContiguousAttention(model))
    return model.compute_logits(hidden)


def make_step(*chunks: ScheduledChunk, copies: tuple[tuple[int, int], ...] = ()) -> SchedulerOutput:
    return SchedulerOutput(
        chunks=chunks,
        num_scheduled_tokens=sum(len(c.token_ids) for c in chunks),
        block_copies=copies,
    )


def chunk(
    request_id: str, known: list[int], start: int, blocks: list[int], sample: bool = True
) -> ScheduledChunk:
    """The chunk running `known[start:]`, with the blocks covering positions [0, len(known))."""
    return ScheduledChunk(
        request_id,
        tuple(known[start:]),
        start,
        tuple(blocks[: -(-len(known) // BLOCK_SIZE)]),
        sample,
    )


def random_tokens(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("attention_kernel", [True, False], ids=["kernel", "sdpa"])
@pytest.mark.parametrize("chunk_sizes", [[23], [1] * 23, [3, 5, 7, 8], [4, 4, 4, 11], [6, 1, 16]])
def test_chunked_prefill_matches_full_forward(
    model: LlamaModel, chunk_sizes: list[int], attention_kernel: bool
) -> None:
    tokens = random_tokens(sum(chunk_sizes), seed=7, vocab=model.config.vocab_size)
    expected = reference_logits(model, tokens)
    runner = ModelRunner(model, num_blocks=16, block_size=BLOCK_SIZE,
                         attention_kernel=attention_kernel)
    assert (runner.kernel is not None) == attention_kernel
    blocks = [9, 2, 14, 0, 5, 11, 3]  # non-contiguous on purpose
    start = 0
    for size in chunk_sizes:
        logits = runner.execute(make_step(chunk("r", tokens[: start + size], start, blocks)))
        torch.testing.assert_close(logits["r"], expected[start + size - 1], atol=TOLERANCE, rtol=0)
        start += size


@pytest.mark.parametrize("attention_kernel", [True, False], ids=["kernel", "sdpa"])
def test_mixed_step_of_prefills_and_decodes_matches_each_sequence_alone(
    model: LlamaModel, attention_kernel: bool
) -> None:
    vocab = model.config.vocab_size
    seqs = {f"r{i}": random_tokens(n, seed=i, vocab=vocab) for i, n in enumerate([9, 17, 5, 30])}
    tables = {"r0": [0, 1, 2], "r1": [3, 4, 5, 6, 7], "r2": [8, 9], "r3": list(range(10, 18))}
    runner = ModelRunner(model, num_blocks=18, block_size=BLOCK_SIZE,
                         attention_kernel=attention_kernel)
    # Step 1: prefill r0, r2 whole and r1, r3 partially.
    done = {"r0": 8, "r1": 10, "r2": 4, "r3": 13}
    runner.execute(
        make_step(*(chunk(r, seqs[r][:n], 0, tables[r], sample=False) for r, n in done.items()))
    )
    # Step 2: r0 and r2 decode one token, r1 and r3 finish their prefill, in one forward pass.
    step = [chunk(r, seqs[r], done[r], tables[r]) for r in seqs]
    logits = runner.execute(make_step(*step))
    for r, tokens in seqs.items():
        torch.testing.assert_close(
            logits[r], reference_logits(model, tokens)[-1], atol=TOLERANCE, rtol=0
        )


def test_batched_decode_is_bitwise_identical_to_decoding_alone(model: LlamaModel) -> None:
    """In batch-invariant mode; without it this fails (the unpadded one-row GEMM differs)."""
    vocab = model.config.vocab_size
    lengths = [3, 40, 17, 8, 25, 2, 33, 12]
    seqs = {f"r{i}": random_tokens(n, seed=100 + i, vocab=vocab) for i, n in enumerate(lengths)}
    tables = {r: list(range(12 * i, 12 * i + 12)) for i, r in enumerate(seqs)}
    batched = ModelRunner(model, num_blocks=12 * len(seqs), block_size=BLOCK_SIZE,
                          batch_invariant=True)
    assert batched.kernel is None  # decode must agree bitwise with prefill: SDPA only
    for r, tokens in seqs.items():
        batched.execute(make_step(chunk(r, tokens[:-1], 0, tables[r], sample=False)))
    together = batched.execute(
        make_step(*(chunk(r, t, len(t) - 1, tables[r]) for r, t in seqs.items()))
    )
    for r, tokens in seqs.items():
        alone = ModelRunner(model, num_blocks=12, block_size=BLOCK_SIZE, batch_invariant=True)
        alone.execute(make_step(chunk(r, tokens[:-1], 0, list(range(12)), sample=False)))
        logits = alone.execute(make_step(chunk(r, tokens, len(tokens) - 1, list(range(12)))))
        assert torch.equal(logits[r], together[r]), r


def test_block_copies_apply_before_the_forward_pass(model: LlamaModel) -> None:
    vocab = model.config.vocab_size
    prefix = random_tokens(6, seed=3, vocab=vocab)  # fills block 0, half of block 1
    runner = ModelRunner(model, num_blocks=8, block_size=BLOCK_SIZE)
    runner.execute(make_step(chunk("parent", prefix, 0, [0, 1], sample=False)))
    # Fork: the child shares block 0 and gets a private copy of the half-full block 1.
    a, b = [*prefix, 5], [*prefix, 11]
    logits = runner.execute(
        make_step(chunk("parent", a, 6, [0, 1]), chunk("child", b, 6, [0, 2]), copies=((1, 2),))
    )
    torch.testing.assert_close(
        logits["parent"], reference_logits(model, a)[-1], atol=TOLERANCE, rtol=0
    )
    torch.testing.assert_close(
        logits["child"], reference_logits(model, b)[-1], atol=TOLERANCE, rtol=0
    )


def test_only_sampled_chunks_return_logits(model: LlamaModel) -> None:
    runner = ModelRunner(model, num_blocks=4, block_size=BLOCK_SIZE)
    tokens = random_tokens(7, seed=5, vocab=model.config.vocab_size)
    assert runner.execute(make_step(chunk("r", tokens[:5], 0, [0, 1], sample=False))) == {}
    logits = runner.execute(make_step(chunk("r", tokens, 5, [0, 1])))
    assert set(logits) == {"r"}
    assert logits["r"].shape == (model.config.vocab_size,)
    assert logits["r"].dtype == torch.float32
    assert runner.execute(SchedulerOutput(chunks=(), num_scheduled_tokens=0)) == {}


def test_chunk_without_enough_blocks_is_rejected(model: LlamaModel) -> None:
    runner = ModelRunner(model, num_blocks=4, block_size=BLOCK_SIZE)
    bad = ScheduledChunk("r", tuple(range(9)), 0, (0, 1), True)
    with pytest.raises(ValueError, match="only 2 blocks"):
        runner.execute(make_step(bad))
    with pytest.raises(ValueError, match="outside"):
        runner.execute(make_step(ScheduledChunk("r", (1,), 0, (7,), True)))


def test_kv_sizing(model: LlamaModel) -> None:
    cfg = model.config
    per_block = kv_bytes_per_block(cfg, BLOCK_SIZE)
    assert per_block == cfg.num_layers * 2 * BLOCK_SIZE * cfg.num_kv_heads * cfg.head_dim * 4
    runner = ModelRunner(
        model,
        num_blocks=num_blocks_for_budget(cfg, BLOCK_SIZE, 10 * per_block + 1),
        block_size=BLOCK_SIZE,
    )
    assert runner.num_blocks == 10
    assert runner.kv_cache_bytes == 10 * per_block


@pytest.mark.parametrize(
    ("context_len", "block_size", "padded"),
    [
        (1, 16, 16),
        (16, 16, 16),
        (17, 16, 32),
        (256, 16, 256),
        (257, 16, 512),
        (512, 16, 512),
        (513, 16, 528),
        (780, 16, 1024),
        (5, 4, 16),
        (17, 32, 32),
    ],
)
def test_attention_padding_is_canonical(context_len: int, block_size: int, padded: int) -> None:
    assert padded_context_len(context_len, block_size) == padded


def test_decode_groups_partition_rows_and_keep_short_contexts_short() -> None:
    assert decode_groups([]) == []
    assert decode_groups([64] * 20) == [range(0, 20)]  # one length: one batch
    groups = decode_groups([48] * 10 + [512] * 10)
    assert groups == [range(0, 10), range(10, 20)]  # short rows not padded to 512
    # A lone long row is not worth an extra batch (DECODE_GROUP_COST): it pads the rest.
    assert decode_groups([48, 48, 48, 96]) == [range(0, 4)]
    mixed = sorted(16 * (3 + (7 * i) % 40) for i in range(64))
    groups = decode_groups(mixed)
    assert [r for g in groups for r in g] == list(range(64))  # every row once, in order
    cost = sum(len(g) * mixed[g[-1]] + DECODE_GROUP_COST for g in groups)
    assert cost < len(mixed) * mixed[-1] + DECODE_GROUP_COST  # cheaper than one batch


def test_a_released_weights_dict_gives_up_its_layer_matrices_and_the_same_model() -> None:
    # The loader passes its dict with release=True so a float32 load never holds each layer
    # twice (the original matrices and their fused, transposed copies).
    config = tiny_config()
    weights = random_weights(config)
    kept = LlamaModel(config, dict(weights))
    released = LlamaModel(config, weights, release=True)
    assert not [name for name in weights if name.endswith("_proj")]
    assert "embed_tokens" in weights and "layers.0.input_layernorm" in weights
    for ours, theirs in zip(released.parameters(), kept.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    with pytest.raises(TypeError, match="pass a dict"):
        LlamaModel(config, MappingProxyType(random_weights(config)), release=True)
