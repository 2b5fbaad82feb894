"""Scheduler tests: no model at all, a fake runner over a fake KV cache (see engine_fakes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from engine_fakes import EOS_TOKEN_ID, FakeRunner, make_request, next_token
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvfleet.engine.config import CacheConfig, SchedulerConfig
from kvfleet.engine.errors import InvalidRequestError
from kvfleet.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from kvfleet.engine.scheduler import Scheduler
from kvfleet.engine.scheduler_output import SchedulerOutput


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 1024,
                   clock: Clock | None = None, prefix: bool = True,
                   **scheduler_options: object) -> tuple[Scheduler, FakeRunner]:
    scheduler = Scheduler(
        SchedulerConfig(**scheduler_options),  # type: ignore[arg-type]
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix),
        num_blocks=num_blocks, max_model_len=max_model_len, eos_token_ids=[EOS_TOKEN_ID],
        clock=clock or Clock())
    runner = FakeRunner(num_blocks, block_size,
                        expected_tokens=lambda rid: scheduler.requests[rid].all_token_ids)
    return scheduler, runner


def step(scheduler: Scheduler, runner: FakeRunner,
         divergent: frozenset[str] | set[str] = frozenset()) -> SchedulerOutput:
    """One engine step; requests in `divergent` sample a different token than the model's
    choice, so a forked child writes other tokens than its parent into shared blocks."""
    output = scheduler.schedule()
    config = scheduler.config
    assert output.num_scheduled_tokens == sum(len(c.token_ids) for c in output.chunks)
    assert output.num_scheduled_tokens <= config.max_num_batched_tokens
    assert all(len(c.token_ids) <= config.long_prefill_token_threshold for c in output.chunks)
    assert len(scheduler.running) <= config.max_num_running
    logits = runner.execute(output)
    sampled = {rid: int(row.argmax()) for rid, row in logits.items()}
    for rid in divergent & sampled.keys():
        sampled[rid] = 1 + sampled[rid] % (len(logits[rid]) - 1)
    scheduler.update_from_output(output, sampled)
    scheduler.kv.check_invariants()
    return output


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000,
                      divergent: frozenset[str] | set[str] = frozenset()) -> int:
    for num_steps in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return num_steps
        step(scheduler, runner, divergent)
    raise AssertionError("requests did not finish")


def expected_output(prompt: Sequence[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def test_chunked_prefill_spreads_a_long_prompt_and_samples_once() -> None:
    scheduler, runner = make_scheduler(long_prefill_token_threshold=8)
    request = make_request("r", 20, max_tokens=2)
    scheduler.add_request(request)
    chunks = [step(scheduler, runner).chunks[0] for _ in range(3)]
    assert [(c.start_position, len(c.token_ids), c.sample) for c in chunks] == [
        (0, 8, False), (8, 8, False), (16, 4, True)]
    assert request.status is RequestStatus.DECODING and request.num_output_tokens == 1


def test_running_requests_are_served_before_waiting_ones_within_the_budget() -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("old", 4, max_tokens=5))
    step(scheduler, runner)
    scheduler.add_request(make_request("new", 30, max_tokens=5))
    output = step(scheduler, runner)
    assert [(c.request_id, len(c.token_ids)) for c in output.chunks] == [("old", 1), ("new", 9)]
    assert output.num_scheduled_tokens == 10


def test_the_prefill_cap_spreads_a_burst_so_its_requests_start_one_after_another() -> None:
    scheduler, runner = make_scheduler(max_prefill_tokens_per_step=8)
    requests = [make_request(name, 12, max_tokens=10) for name in "abc"]
    for request in requests:
        scheduler.add_request(request)
    # The first chunk of a step is never held back (12 > 8); nothing else fits beside it.
    chunks = [[(c.request_id, len(c.token_ids)) for c in step(scheduler, runner).chunks]
              for _ in range(3)]
    assert chunks == [[("a", 12)], [("a", 1), ("b", 12)], [("a", 1), ("b", 1), ("c", 12)]]
    # Short prompts share the cap: 4 + 4 tokens, the third waits a step.
    requests += [make_request(name, 4, max_tokens=2) for name in "def"]
    for request in requests[3:]:
        scheduler.add_request(request)
    prefills = [(c.request_id, len(c.token_ids)) for c in step(scheduler, runner).chunks
                if len(c.token_ids) > 1]
    assert prefills == [("d", 4), ("e", 4)]
    run_to_completion(scheduler, runner)
    assert [r.output_token_ids for r in requests] == [
        expected_output(r.prompt_token_ids, r.sampling_params.max_tokens) for r in requests]


def test_a_prompt_in_progress_beyond_the_first_waits_for_the_next_step() -> None:
    scheduler, runner = make_scheduler(max_prefill_tokens_per_step=4,
                                       long_prefill_token_threshold=8)
    scheduler.add_request(make_request("a", 20, max_tokens=2))
    scheduler.add_request(make_request("b", 20, max_tokens=2))
    first = [(c.request_id, len(c.token_ids)) for c in step(scheduler, runner).chunks]
    assert first == [("a", 8)]  # a's 8 spent the cap, so b was not admitted
    second = [(c.request_id, len(c.token_ids)) for c in step(scheduler, runner).chunks]
    assert second == [("a", 8)]  # a is the step's first prefill again
    third = [(c.request_id, len(c.token_ids)) for c in step(scheduler, runner).chunks]
    assert third == [("a", 4)]  # 4 left of a's prompt spend the whole cap
    fourth = [(c.request_id, len(c.token_ids)) for c in step(scheduler, runner).chunks]
    assert fourth == [("a", 1), ("b", 8)]


def test_the_prefill_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_prefill_tokens_per_step must be positive"):
        SchedulerConfig(max_prefill_tokens_per_step=0)


def test_outputs_match_the_model_alone_and_the_pool_ends_all_free() -> None:
    scheduler, runner = make_scheduler(num_blocks=32, max_num_batched_tokens=16)
    requests = [make_request(f"r{i}", 3 + 5 * i, max_tokens=6) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    run_to_completion(scheduler, runner)
    for request in requests:
        assert request.output_token_ids == expected_output(request.prompt_token_ids, 6)
        assert request.finish_reason is FinishReason.LENGTH
    assert scheduler.kv.pool.num_free_blocks == 32 and not scheduler.requests


def test_preemption_recomputes_the_newest_request_and_keeps_outputs_exact() -> None:
    # Two requests that each need 4 blocks at the end, in a pool of 6: one must yield.
    scheduler, runner = make_scheduler(num_blocks=6, block_size=4)
    first = make_request("first", 6, max_tokens=10)
    second = make_request("second", 6, max_tokens=10)
    scheduler.add_request(first)
    scheduler.add_request(second)
    preempted: list[str] = []
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        preempted.extend(step(scheduler, runner).preempted_request_ids)
    assert preempted and set(preempted) == {"second"}
    assert scheduler.num_preemptions == second.num_preemptions == len(preempted)
    for request in (first, second):
        assert request.output_token_ids == expected_output(request.prompt_token_ids, 10)


def test_lower_priority_is_preempted_before_newer_higher_priority() -> None:
    scheduler, runner = make_scheduler(num_blocks=6, block_size=4, policy="priority")
    low = make_request("low", 6, max_tokens=10, priority=5)
    high = make_request("high", 6, max_tokens=10, priority=0)
    scheduler.add_request(low)
    scheduler.add_request(high)
    preempted: set[str] = set()
    while scheduler.has_unfinished_requests():
        preempted.update(step(scheduler, runner).preempted_request_ids)
    assert preempted == {"low"}


def test_priority_policy_admits_urgent_requests_first() -> None:
    scheduler, runner = make_scheduler(policy="priority", max_num_running=1)
    for name, priority in (("bulk", 10), ("urgent", 0), ("normal", 5)):
        scheduler.add_request(make_request(name, 4, max_tokens=1, priority=priority))
    order: list[str] = []
    while scheduler.has_unfinished_requests():
        order.extend(c.request_id for c in step(scheduler, runner).chunks)
    assert order == ["urgent", "normal", "bulk"]


def test_aging_lets_low_priority_overtake_newer_high_priority() -> None:
    clock = Clock()
    scheduler, runner = make_scheduler(policy="priority", max_num_running=1, clock=clock,
                                       priority_aging_seconds=1.0)
    scheduler.add_request(make_request("blocker", 4, max_tokens=3, arrival_time=clock.now))
    step(scheduler, runner)
    scheduler.add_request(make_request("low", 4, max_tokens=1, priority=3,
                                       arrival_time=clock.now))
    step(scheduler, runner)
    clock.now += 10.0  # "low" has waited 10 levels' worth
    scheduler.add_request(make_request("high", 4, max_tokens=1, priority=0,
                                       arrival_time=clock.now))
    admitted: list[str] = []
    while scheduler.has_unfinished_requests():
        output = step(scheduler, runner)
        admitted.extend(c.request_id for c in output.chunks if c.start_position == 0)
    assert admitted == ["low", "high"]


def test_a_flooding_tenant_does_not_starve_another() -> None:
    scheduler, runner = make_scheduler(max_num_running=2, max_num_batched_tokens=64)
    for i in range(20):
        scheduler.add_request(make_request(f"a{i}", 8, max_tokens=4, tenant="a"))
    step(scheduler, runner)
    for i in range(2):
        scheduler.add_request(make_request(f"b{i}", 8, max_tokens=4, tenant="b"))
    admitted: list[str] = []
    while scheduler.has_unfinished_requests():
        admitted.extend(c.request_id for c in step(scheduler, runner).chunks
                        if c.start_position == 0)
    # Both of b's requests get in among the next few admissions, not after a's 20.
    assert admitted.index("b1") <= 5, admitted


def test_a_tenant_holding_every_slot_yields_one_to_a_newcomer_within_a_step() -> None:
    scheduler, runner = make_scheduler(max_num_running=4)
    flood = [make_request(f"a{i}", 8, max_tokens=20, tenant="a") for i in range(8)]
    for request in flood:
        scheduler.add_request(request)
    step(scheduler, runner)
    step(scheduler, runner)
    newcomer = make_request("b0", 8, max_tokens=5, tenant="b")
    scheduler.add_request(newcomer)
    output = step(scheduler, runner)
    assert [c.request_id for c in output.chunks if c.start_position == 0] == ["b0"]
    assert output.preempted_request_ids == ("a3",)  # the flooder's newest running request
    run_to_completion(scheduler, runner)
    for request in [*flood, newcomer]:
        assert request.output_token_ids == expected_output(request.prompt_token_ids,
                                                           request.sampling_params.max_tokens)


def test_tenants_at_their_share_do_not_take_slots_back_and_forth() -> None:
    scheduler, runner = make_scheduler(max_num_running=4)
    for i in range(6):
        scheduler.add_request(make_request(f"a{i}", 8, max_tokens=6, tenant="a"))
        scheduler.add_request(make_request(f"b{i}", 8, max_tokens=6, tenant="b"))
    run_to_completion(scheduler, runner)
    assert scheduler.num_preemptions == 0


def test_fairness_never_preempts_a_more_important_request() -> None:
    scheduler, runner = make_scheduler(max_num_running=2, policy="priority")
    for i in range(2):
        scheduler.add_request(make_request(f"a{i}", 8, max_tokens=6, tenant="a", priority=0))
    step(scheduler, runner)
    scheduler.add_request(make_request("b0", 8, max_tokens=6, tenant="b", priority=5))
    output = step(scheduler, runner)
    assert output.preempted_request_ids == () and scheduler.waiting[0].request_id == "b0"


def test_tenant_weights_split_admissions_by_share() -> None:
    scheduler, runner = make_scheduler(max_num_running=1, tenant_weights={"gold": 3.0})
    for i in range(12):
        scheduler.add_request(make_request(f"gold{i}", 8, max_tokens=2, tenant="gold"))
        scheduler.add_request(make_request(f"free{i}", 8, max_tokens=2, tenant="free"))
    admitted: list[str] = []
    while len(admitted) < 12:
        admitted.extend(c.request_id for c in step(scheduler, runner).chunks
                        if c.start_position == 0)
    num_gold = sum(r.startswith("gold") for r in admitted[:12])
    assert 8 <= num_gold <= 10, admitted


def test_cancel_is_idempotent_and_frees_blocks_at_the_next_boundary() -> None:
    scheduler, runner = make_scheduler(num_blocks=16)
    request = make_request("r", 10, max_tokens=50)
    scheduler.add_request(request)
    step(scheduler, runner)
    assert scheduler.kv.pool.num_free_blocks < 16
    scheduler.abort_request("r")
    scheduler.abort_request("r")
    assert request.status.value == "decoding"  # nothing changes mid-step
    output = scheduler.schedule()
    assert output.finished_request_ids == ("r",) and output.is_empty
    assert request.status is RequestStatus.CANCELLED
    assert request.finish_reason is FinishReason.CANCELLED
    assert scheduler.kv.pool.num_free_blocks == 16
    scheduler.abort_request("r")  # long gone: nothing happens
    assert not scheduler.has_unfinished_requests() or scheduler.schedule().is_empty
    assert request.status is RequestStatus.CANCELLED


def test_cancelling_a_finished_request_changes_nothing() -> None:
    scheduler, runner = make_scheduler()
    request = make_request("r", 4, max_tokens=1)
    scheduler.add_request(request)
    step(scheduler, runner)
    scheduler.abort_request("r")
    run_to_completion(scheduler, runner)
    assert request.finish_reason is FinishReason.LENGTH
    assert request.status is RequestStatus.COMPLETED


def test_deadline_ends_waiting_and_running_requests() -> None:
    clock = Clock()
    scheduler, runner = make_scheduler(clock=clock, max_num_running=1)
    running = make_request("running", 4, max_tokens=100, deadline=clock.now + 5)
    waiting = make_request("waiting", 4, max_tokens=100, deadline=clock.now + 5)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler, runner)
    clock.now += 10
    run_to_completion(scheduler, runner)
    assert running.finish_reason is waiting.finish_reason is FinishReason.DEADLINE
    assert running.num_output_tokens == 1 and waiting.num_output_tokens == 0
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks


def run_single(request: Request) -> Request:
    scheduler, runner = make_scheduler()
    scheduler.add_request(request)
    run_to_completion(scheduler, runner)
    return request


def test_stop_conditions() -> None:
    prompt = (5, 6, 7)
    natural = expected_output(prompt, 8)
    stop_id = natural[2]
    by_id = run_single(make_request("a", prompt, sampling_params=SamplingParams(
        max_tokens=8, temperature=0, stop_token_ids=(stop_id,))))
    assert by_id.output_token_ids == natural[:natural.index(stop_id) + 1]
    assert by_id.finish_reason is FinishReason.STOP
    late = run_single(make_request("b", prompt, sampling_params=SamplingParams(
        max_tokens=8, temperature=0, stop_token_ids=(natural[0],), min_tokens=4)))
    # The stop id is the very first token, but min_tokens=4 defers stopping to its first
    # occurrence from the 4th token on (or to max_tokens).
    later = [i + 1 for i in range(3, 8) if natural[i] == natural[0]]
    assert late.num_output_tokens == (later[0] if later else 8)
    assert late.finish_reason is (FinishReason.STOP if later else FinishReason.LENGTH)


def test_eos_stops_unless_ignored() -> None:
    scheduler, _runner = make_scheduler()
    for name, ignore_eos in (("stops", False), ("ignores", True)):
        scheduler.add_request(make_request(name, 4, sampling_params=SamplingParams(
            max_tokens=3, temperature=0, ignore_eos=ignore_eos)))
    output = scheduler.schedule()
    scheduler.update_from_output(output, {"stops": EOS_TOKEN_ID, "ignores": EOS_TOKEN_ID})
    stops, ignores = scheduler.requests["stops"], scheduler.requests["ignores"]
    assert stops.finish_reason is FinishReason.STOP and ignores.finish_reason is None


def test_admission_rejects_what_can_never_run() -> None:
    scheduler, _runner = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(InvalidRequestError, match="KV blocks but the pool has 4") as exc:
        scheduler.add_request(make_request("big", 10, max_tokens=10))
    assert exc.value.field == "sampling_params.max_tokens"
    with pytest.raises(InvalidRequestError, match="exceeds the model's context") as exc:
        scheduler.add_request(make_request("long", 90, max_tokens=20))
    assert exc.value.field == "sampling_params.max_tokens"
    with pytest.raises(InvalidRequestError) as exc:
        scheduler.add_request(make_request("huge", 100, max_tokens=1))
    assert exc.value.field == "prompt"
    scheduler.add_request(make_request("ok", 8, max_tokens=8))
    with pytest.raises(InvalidRequestError, match="already exists"):
        scheduler.add_request(make_request("ok", 8, max_tokens=8))


def test_fork_shares_the_prefix_and_diverges_by_copy_on_write() -> None:
    scheduler, runner = make_scheduler(num_blocks=16, block_size=4)
    parent = make_request("p", 6, max_tokens=6)
    scheduler.add_request(parent)
    step(scheduler, runner)
    child = scheduler.fork_request("p", "c")
    assert scheduler.kv.block_ids("c") == scheduler.kv.block_ids("p")
    output = step(scheduler, runner, divergent={"c"})
    assert len(output.block_copies) == 1
    run_to_completion(scheduler, runner, divergent={"c"})  # the fake runner checks the KV
    assert parent.output_token_ids == expected_output(parent.prompt_token_ids, 6)
    assert child.output_token_ids[:1] == parent.output_token_ids[:1]
    assert child.output_token_ids[1] != parent.output_token_ids[1]
    assert scheduler.kv.pool.num_free_blocks == 16


def test_fork_respects_the_running_cap() -> None:
    scheduler, runner = make_scheduler(max_num_running=1)
    scheduler.add_request(make_request("p", 6, max_tokens=6))
    step(scheduler, runner)
    with pytest.raises(InvalidRequestError, match="running slots are taken"):
        scheduler.fork_request("p", "c")


def test_prefix_cache_hits_skip_computing_shared_blocks() -> None:
    scheduler, runner = make_scheduler(block_size=4)
    shared = tuple(range(1, 13))
    scheduler.add_request(make_request("a", shared, max_tokens=1))
    run_to_completion(scheduler, runner)
    second = make_request("b", (*shared, 40), max_tokens=1)
    scheduler.add_request(second)
    output = step(scheduler, runner)
    assert output.chunks[0].start_position == 12 and second.num_cached_tokens == 12
    assert scheduler.kv.prefix_cache_hits == 12


def test_prompt_leaving_the_cache_mid_block_starts_after_the_shared_tokens() -> None:
    scheduler, runner = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", tuple(range(1, 13)), max_tokens=1))
    run_to_completion(scheduler, runner)
    second = make_request("b", (*range(1, 11), 50, 51), max_tokens=3)
    scheduler.add_request(second)
    output = step(scheduler, runner)  # the fake runner checks every position's KV
    assert output.chunks[0].start_position == 10 and second.num_cached_tokens == 10
    assert len(output.block_copies) == 1
    run_to_completion(scheduler, runner)
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks


# -- property-based: random add / step / cancel / finish / fork --------------------------

add_op = st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 24),
                   st.sampled_from(["a", "b"]), st.integers(0, 3))
step_op = st.tuples(st.just("step"))
operations = st.lists(
    # Weighted towards steps and forks: interesting states need several steps to reach.
    st.one_of(add_op, add_op, step_op, step_op, step_op, step_op,
              st.tuples(st.sampled_from(["cancel", "finish", "fork", "fork"]),
                        st.integers(0, 50))),
    min_size=10,
    max_size=80,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, num_blocks=st.integers(12, 40), block_size=st.sampled_from([2, 4]),
       prefix=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]),
       prefill_cap=st.sampled_from([None, 3, 8]))
def test_random_operations_never_leak_double_free_or_wrongly_share_blocks(
        ops: list[tuple[Any, ...]], num_blocks: int, block_size: int, prefix: bool,
        policy: str, prefill_cap: int | None) -> None:
    scheduler, runner = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                                       prefix=prefix, policy=policy,
                                       max_num_batched_tokens=24,
                                       long_prefill_token_threshold=8,
                                       max_prefill_tokens_per_step=prefill_cap)
    counter = 0
    forked: set[str] = set()
    # Prompts from a few shared stems so that prefix hits really happen.
    stems = [tuple((s * 5 + i) % 60 + 1 for i in range(40)) for s in range(3)]
    for op in ops:
        ids = sorted(scheduler.requests)
        if op[0] == "add":
            _, length, max_tokens, tenant, stem = op
            prompt = stems[stem % 3][:length] if stem < 3 else tuple(range(1, length + 1))
            counter += 1
            request = make_request(f"r{counter}", prompt, max_tokens=max_tokens,
                                   tenant=tenant, cache_salt=tenant)
            if scheduler.kv.can_ever_fit(request.max_num_tokens):
                scheduler.add_request(request)
        elif op[0] == "step":
            output = step(scheduler, runner, forked)
            if output.block_copies:
                event("copy-on-write")
            if output.preempted_request_ids:
                event("preemption")
            check_salts_disjoint(scheduler)
        elif ids and op[0] == "cancel":
            scheduler.abort_request(ids[op[1] % len(ids)])
        elif ids and op[0] == "finish":
            scheduler.finish_request(ids[op[1] % len(ids)], FinishReason.STOP)
        elif op[0] == "fork":
            candidates = scheduler.running
            if candidates:
                counter += 1
                scheduler.fork_request(candidates[op[1] % len(candidates)].request_id,
                                       f"r{counter}")
                forked.add(f"r{counter}")
                check_salts_disjoint(scheduler)
        scheduler.kv.check_invariants()
    run_to_completion(scheduler, runner, max_steps=2000, divergent=forked)
    assert scheduler.kv.pool.num_free_blocks == num_blocks
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting


def check_salts_disjoint(scheduler: Scheduler) -> None:
    owners: dict[int, str] = {}
    for request_id, request in scheduler.requests.items():
        for block_id in scheduler.kv.block_ids(request_id):
            salt = owners.setdefault(block_id, request.cache_salt)
            assert salt == request.cache_salt, f"block {block_id} shared across tenants"
