"""EngineCore and LLM over a fake runner and tokenizer: the step loop, stop strings, errors."""

from __future__ import annotations

import pytest
import torch
from engine_fakes import EOS_TOKEN_ID, FakeRunner, FakeTokenizer, make_request, next_token

from kvfleet.engine.config import CacheConfig, SchedulerConfig
from kvfleet.engine.engine import EngineCore
from kvfleet.engine.errors import InvalidRequestError
from kvfleet.engine.llm import LLM
from kvfleet.engine.request import FinishReason, SamplingParams
from kvfleet.engine.sampler import Sampler
from kvfleet.engine.scheduler import Scheduler
from kvfleet.engine.scheduler_output import SchedulerOutput


def make_core(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256,
              **scheduler_options: object) -> EngineCore:
    scheduler = Scheduler(SchedulerConfig(**scheduler_options),  # type: ignore[arg-type]
                          CacheConfig(block_size=block_size), num_blocks=num_blocks,
                          max_model_len=max_model_len, eos_token_ids=[EOS_TOKEN_ID])
    runner = FakeRunner(num_blocks, block_size,
                        expected_tokens=lambda rid: scheduler.requests[rid].all_token_ids)
    return EngineCore(runner, scheduler, Sampler([EOS_TOKEN_ID]), model_hash="m")


def make_llm(**options: object) -> LLM:
    return LLM.from_core(make_core(**options), FakeTokenizer())  # type: ignore[arg-type]


def greedy(max_tokens: int, **options: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **options)  # type: ignore[arg-type]


def test_step_runs_schedule_execute_sample_update() -> None:
    core = make_core()
    request = make_request("r", (3, 4, 5), max_tokens=3)
    core.add_request(request)
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    assert request.output_token_ids[0] == next_token([3, 4, 5])
    assert request.finish_reason is FinishReason.LENGTH and steps == 4  # 3 + the freeing one
    assert core.stats().kv_cache_usage == 0.0


def test_the_salt_scopes_the_cache_by_tenant_and_model() -> None:
    core = make_core()
    a, b = make_request("a", 8, tenant="x"), make_request("b", 8, tenant="y", cache_salt="y")
    core.add_request(a)
    core.add_request(b)
    assert a.cache_salt != b.cache_salt and "m" in a.cache_salt.split("\x1f")


def test_stats_snapshot() -> None:
    core = make_core(max_num_running=1)
    core.add_request(make_request("a", 8, max_tokens=2))
    core.add_request(make_request("b", 8, max_tokens=2))
    core.step()
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert 0 < stats.kv_cache_usage <= 1 and stats.num_prefix_cache_queries == 8


def test_llm_generates_in_prompt_order_with_timings() -> None:
    llm = make_llm()
    outputs = llm.generate(["abc", "hello world"], greedy(5), use_tqdm=False)
    assert [o.prompt for o in outputs] == ["abc", "hello world"]
    for output in outputs:
        expected = []
        tokens = list(output.prompt_token_ids)
        for _ in range(5):
            expected.append(next_token(tokens))
            tokens.append(expected[-1])
        assert list(output.token_ids) == expected
        assert output.text == FakeTokenizer().decode(expected)
        assert output.finish_reason == "length"
        assert output.first_token_time is not None and output.finish_time is not None
        assert output.arrival_time <= output.first_token_time <= output.finish_time


def test_stop_string_truncates_the_text_and_stops_early() -> None:
    llm = make_llm()
    (full,) = llm.generate("abc", greedy(12), use_tqdm=False)
    stop = full.text[3:5]
    (stopped,) = llm.generate("abc", greedy(12, stop=(stop,)), use_tqdm=False)
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:full.text.index(stop)]
    assert len(stopped.token_ids) < 12


def test_chat_messages_need_a_template() -> None:
    llm = make_llm()
    with pytest.raises(InvalidRequestError, match="no chat template") as exc:
        llm.generate([[{"role": "user", "content": "hi"}]], use_tqdm=False)
    assert exc.value.field == "prompts[0]"


@pytest.mark.parametrize(("prompts", "params", "field", "match"), [
    ([""], greedy(4), "prompt", "is empty"),
    (["abc", ""], greedy(4), "prompt", r"prompts\[1\]"),
    (["abc"], greedy(300), "sampling_params.max_tokens", "exceeds the model's context"),
    ([], greedy(4), "prompts", "empty list"),
])
def test_bad_input_names_the_field_and_queues_nothing(prompts: list[str],
                                                      params: SamplingParams, field: str,
                                                      match: str) -> None:
    llm = make_llm()
    with pytest.raises(InvalidRequestError, match=match) as exc:
        llm.generate(prompts, params, use_tqdm=False)
    assert exc.value.field == field
    assert not llm.core.has_unfinished_requests()


def test_sampling_params_per_prompt_must_match_the_prompt_count() -> None:
    with pytest.raises(InvalidRequestError, match="has 1 entries for 2 prompts"):
        make_llm().generate(["a", "b"], [greedy(2)], use_tqdm=False)


def test_token_id_prompts() -> None:
    (output,) = make_llm().generate(prompt_token_ids=[[7, 8, 9]], sampling_params=greedy(1),
                                    use_tqdm=False)
    assert output.token_ids == (next_token([7, 8, 9]),) and output.prompt is None


def test_a_failing_step_frees_everything_and_the_engine_stays_usable() -> None:
    llm = make_llm()
    runner = llm.core.runner
    assert isinstance(runner, FakeRunner)
    real_execute = runner.execute
    calls = 0

    def flaky(output: SchedulerOutput) -> dict[str, torch.Tensor]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("device lost")
        return real_execute(output)

    runner.execute = flaky  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(["abc", "def"], greedy(5), use_tqdm=False)
    assert not llm.core.has_unfinished_requests()
    assert llm.stats().kv_cache_usage == 0.0
    (output,) = llm.generate("abc", greedy(2), use_tqdm=False)
    assert output.finish_reason == "length"
