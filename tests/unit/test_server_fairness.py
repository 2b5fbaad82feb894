"""Fairness as the serving layer relies on it, on the real Scheduler with a fake runner.

Regression tests for two ways a flooding tenant could still push another tenant back:
- credit carried over an idle period: a tenant that was alone for a while must not return to
  find a newcomer that started at virtual time 0 ahead of it for hundreds of tokens;
- priority aging letting the flood's old requests outrank the other tenant's fresh requests
  of the SAME priority (aging exists to lift lower priorities, not to turn a deep queue into
  FCFS).
"""

from __future__ import annotations

from engine_fakes import FakeRunner, make_request

from kvfleet.engine.config import CacheConfig, SchedulerConfig
from kvfleet.engine.scheduler import Scheduler


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(policy: str, clock: Clock, max_num_running: int = 2) -> tuple[Scheduler, FakeRunner]:
    scheduler = Scheduler(SchedulerConfig(policy=policy, max_num_running=max_num_running,  # type: ignore[arg-type]
                                          priority_aging_seconds=1.0),
                          CacheConfig(block_size=4), num_blocks=256, max_model_len=1024,
                          clock=clock)
    return scheduler, FakeRunner(256, 4)


def admissions(scheduler: Scheduler, runner: FakeRunner, clock: Clock,
               max_steps: int = 500) -> list[str]:
    admitted: list[str] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        logits = runner.execute(output)
        scheduler.update_from_output(output, {r: int(x.argmax()) for r, x in logits.items()})
        # First scheduled chunk = admission (a prefix-cache hit starts past position 0).
        admitted.extend(c.request_id for c in output.chunks if c.request_id not in admitted)
        clock.now += 0.1
    return admitted


def test_a_tenant_back_from_idle_is_not_behind_a_newcomer() -> None:
    for policy in ("fcfs", "priority"):
        clock = Clock()
        scheduler, runner = make(policy, clock)
        for i in range(10):  # the victim works alone for a while...
            scheduler.add_request(make_request(f"v-old{i}", 16, max_tokens=8, tenant="victim"))
        admissions(scheduler, runner, clock)
        for i in range(20):  # ...then a new tenant floods...
            scheduler.add_request(make_request(f"f{i}", 16, max_tokens=8, tenant="flood"))
        admissions(scheduler, runner, clock, max_steps=3)
        scheduler.add_request(make_request("v-new", 16, max_tokens=8, tenant="victim"))
        admitted = admissions(scheduler, runner, clock)
        # ...and the victim's next request is among the next admissions, not after the flood.
        assert admitted.index("v-new") <= 2, (policy, admitted)


def test_aging_does_not_let_a_deep_same_priority_queue_outrank_another_tenant() -> None:
    clock = Clock()
    scheduler, runner = make("priority", clock)
    for i in range(30):
        scheduler.add_request(make_request(f"f{i}", 16, max_tokens=8, tenant="flood",
                                           arrival_time=clock.now))
    admissions(scheduler, runner, clock, max_steps=60)  # the flood's queue ages ~6 s
    scheduler.add_request(make_request("victim", 16, max_tokens=8, tenant="victim",
                                       arrival_time=clock.now))
    admitted = admissions(scheduler, runner, clock)
    assert admitted.index("victim") <= 2, admitted
