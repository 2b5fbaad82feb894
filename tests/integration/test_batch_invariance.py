"""Batch invariance on the real SmolLM2-135M: a request's greedy output does not depend on
what else is scheduled with it, on prefix caching, or on being preempted and recomputed."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvfleet.engine.config import CacheConfig, SchedulerConfig
from kvfleet.engine.engine import build_engine_core
from kvfleet.engine.llm import LLM
from kvfleet.engine.model.loader import LoadedModel, load_model
from kvfleet.engine.request import Request, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> Iterator[LoadedModel]:
    yield load_model(show_progress=False)


def make_llm(model: LoadedModel, *, num_blocks: int = 256, prefix: bool = True,
             max_num_batched_tokens: int = 512) -> LLM:
    core = build_engine_core(
        model, CacheConfig(num_blocks=num_blocks, enable_prefix_caching=prefix),
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                        long_prefill_token_threshold=128),
        batch_invariant=True)
    return LLM.from_core(core, model.tokenizer, model.chat_template)


@pytest.fixture(scope="module")
def targets(model: LoadedModel) -> list[list[int]]:
    """A short prompt and a chat-templated one longer than three blocks (> 48 tokens)."""
    assert model.chat_template is not None
    chat = model.chat_template.render([{"role": "user", "content": (
        "Explain in two sentences why a Kubernetes operator reconciles desired state "
        "instead of applying one-off changes, and what happens when a pod disappears.")}])
    long = model.tokenizer.encode(chat, add_special_tokens=False)
    assert len(long) > 48
    return [model.tokenizer.encode("The capital of France is"), long]


@pytest.fixture(scope="module")
def alone(model: LoadedModel, targets: list[list[int]]) -> list[tuple[int, ...]]:
    llm = make_llm(model, prefix=False)
    return [llm.generate(prompt_token_ids=[t], sampling_params=GREEDY, use_tqdm=False)[0]
            .token_ids for t in targets]


def mixed_batch(model: LoadedModel, targets: list[list[int]], size: int = 32
                ) -> list[list[int]]:
    """`size` prompts of 4..64 tokens with the targets among them; some share prefixes."""
    rng = random.Random(7)
    words = model.tokenizer.encode(" ".join(["cluster", "node", "pod", "replica", "token",
                                             "cache", "rollout", "tenant"] * 10))
    batch = [words[: rng.randint(4, 64)] for _ in range(size - 2)]
    batch[1:1] = [targets[0]]
    batch[size // 2:size // 2] = [targets[1]]
    return batch


def outputs_of(llm: LLM, prompts: list[list[int]], targets: list[list[int]]
               ) -> list[tuple[int, ...]]:
    results = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return [results[prompts.index(t)].token_ids for t in targets]


def test_alone_equals_in_a_batch_of_32_with_and_without_prefix_caching(
        model: LoadedModel, targets: list[list[int]], alone: list[tuple[int, ...]]) -> None:
    batch = mixed_batch(model, targets)
    assert len(batch) == 32
    for prefix in (False, True):
        llm = make_llm(model, prefix=prefix)
        assert outputs_of(llm, batch, targets) == alone, f"prefix caching {prefix}"
    # The prefix-cache run really hit the cache (the batch shares prefixes).
    assert llm.stats().num_prefix_cache_hits > 0


def test_alone_equals_after_a_prefix_cache_hit(model: LoadedModel, targets: list[list[int]],
                                               alone: list[tuple[int, ...]]) -> None:
    llm = make_llm(model, prefix=True)
    llm.generate(prompt_token_ids=targets, sampling_params=GREEDY, use_tqdm=False)
    hits_before = llm.stats().num_prefix_cache_hits
    again = [o.token_ids for o in llm.generate(prompt_token_ids=targets,
                                                 sampling_params=GREEDY, use_tqdm=False)]
    assert llm.stats().num_prefix_cache_hits - hits_before >= 48
    assert again == alone


def test_alone_equals_after_a_hit_that_leaves_the_cache_inside_a_block(
        model: LoadedModel, targets: list[list[int]], alone: list[tuple[int, ...]]) -> None:
    llm = make_llm(model, prefix=True)
    long = targets[1]
    # Shares 40 tokens with the long target: blocks 0-1 whole, then 8 of block 2's 16.
    other = [*long[:40], *model.tokenizer.encode(" node pod replica cache" * 5)]
    llm.generate(prompt_token_ids=[other], sampling_params=GREEDY, use_tqdm=False)
    hits_before = llm.stats().num_prefix_cache_hits
    (again,) = llm.generate(prompt_token_ids=[long], sampling_params=GREEDY, use_tqdm=False)
    assert llm.stats().num_prefix_cache_hits - hits_before == 40
    assert again.token_ids == alone[1]


def test_alone_equals_after_preemption_and_recompute(
        model: LoadedModel, targets: list[list[int]], alone: list[tuple[int, ...]]) -> None:
    # 8 blocks of 16 tokens. The targets take 1 + 5 blocks and are admitted first; the
    # fillers (28 prompt tokens: 2 blocks, a third one at token 33) must grow while the pool
    # is full, and the targets have the lowest priority: the long target is preempted.
    assert len(targets[1]) + MAX_TOKENS <= 5 * 16
    core = build_engine_core(model, CacheConfig(num_blocks=8, enable_prefix_caching=False),
                             batch_invariant=True)
    words = model.tokenizer.encode(" ".join(["pod", "node", "cache", "tenant"] * 20))
    fillers = [words[i:i + 28] for i in range(6)]
    requests = [Request(f"r{i}", prompt, sampling_params=GREEDY,
                        priority=1 if prompt in targets else 0)
                for i, prompt in enumerate([*targets, *fillers])]
    for request in requests:
        core.add_request(request)
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        core.step()
    by_prompt = {tuple(r.prompt_token_ids): r for r in requests}
    target_requests = [by_prompt[tuple(t)] for t in targets]
    assert target_requests[1].num_preemptions > 0
    assert [tuple(r.output_token_ids) for r in target_requests] == alone
    assert core.stats().kv_cache_usage == 0.0


def test_a_prefill_cap_starts_a_burst_step_by_step_and_keeps_every_output(
        model: LoadedModel, targets: list[list[int]], alone: list[tuple[int, ...]]) -> None:
    # 32 prompts at once: without a cap the first step prefills them all (4-64 tokens each,
    # within its 2,048-token budget); with 32 prompt tokens a step they start a few at a time,
    # some from chunks the cap cut short, and each still decodes exactly as it does alone.
    batch = mixed_batch(model, targets)
    first_token_steps: dict[int | None, list[int]] = {}
    for cap in (None, 32):
        core = build_engine_core(
            model, CacheConfig(num_blocks=256, enable_prefix_caching=False),
            SchedulerConfig(max_num_batched_tokens=2048, long_prefill_token_threshold=128,
                            max_prefill_tokens_per_step=cap),
            batch_invariant=True)
        requests = [Request(f"r{i}", prompt, sampling_params=GREEDY)
                    for i, prompt in enumerate(batch)]
        for request in requests:
            core.add_request(request)
        started: dict[str, int] = {}
        for number in range(1, 2000):
            if not core.has_unfinished_requests():
                break
            core.step()
            started.update((r.request_id, number) for r in requests
                           if r.num_output_tokens and r.request_id not in started)
        first_token_steps[cap] = [started[r.request_id] for r in requests]
        by_prompt = {tuple(r.prompt_token_ids): r for r in requests}
        assert [tuple(by_prompt[tuple(t)].output_token_ids) for t in targets] == alone
        assert core.stats().kv_cache_usage == 0.0
    assert set(first_token_steps[None]) == {1}
    spread = first_token_steps[32]
    assert spread == sorted(spread) and len(set(spread)) >= 10, spread
