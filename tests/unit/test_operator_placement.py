"""Which line of a container's termination message the pool shows as the reason."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from kvfleet.operator.placement import pod_problem, reason_line, restarts


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("sha256 mismatch for model-00001\n", "sha256 mismatch for model-00001"),
        (
            'Traceback (most recent call last):\n  File "x.py", line 1\n'
            "OSError: /models/a.gguf: no such file\n\n",
            "OSError: /models/a.gguf: no such file",
        ),
        (
            '{"level":"error","msg":"engine failed to start: bad sha256"}',
            "engine failed to start: bad sha256",
        ),
        ('{"level":"error","message":"no msg key"}', '{"level":"error","message":"no msg key"}'),
        ("[1, 2]", "[1, 2]"),
        ("  \n\n", ""),
    ],
)
def test_reason_is_the_last_non_empty_line_and_a_json_records_msg(
    message: str, expected: str
) -> None:
    assert reason_line(message) == expected


def _engine(
    state: Mapping[str, object], *, ready: bool, restarts: int, exit_code: int | None
) -> dict[str, object]:
    last = {} if exit_code is None else {"terminated": {"exitCode": exit_code, "message": "boom"}}
    status = {"name": "engine", "state": state, "ready": ready, "restartCount": restarts,
              "lastState": last}  # fmt: skip
    return {"metadata": {"name": "p"}, "status": {"containerStatuses": [status]}}


def test_a_crash_loop_is_reported_between_back_offs_too() -> None:
    expected = ("CrashLoopBackOff", "container engine CrashLoopBackOff (last exit code 1): boom")
    waiting = {"waiting": {"reason": "CrashLoopBackOff"}}
    assert pod_problem(_engine(waiting, ready=False, restarts=2, exit_code=1)) == expected
    running = {"running": {"startedAt": "2026-11-29T09:00:00Z"}}
    assert pod_problem(_engine(running, ready=False, restarts=2, exit_code=1)) == expected
    # Ready again, never failed, or stopped on purpose (exit 0): nothing to report.
    assert pod_problem(_engine(running, ready=True, restarts=2, exit_code=1)) is None
    assert pod_problem(_engine(running, ready=False, restarts=0, exit_code=None)) is None
    assert pod_problem(_engine(running, ready=False, restarts=1, exit_code=0)) is None


def test_a_failing_init_container_is_the_pods_problem() -> None:
    """The model fetch (the init step) failing keeps the engine from ever starting: its exit,
    whether just terminated, backing off or running again, is what the pool shows."""
    failed = {"terminated": {"exitCode": 1, "message": "error: m.gguf: sha256 is 1, not 2"}}
    fetch = {"name": "fetch-model", "state": failed, "ready": False, "restartCount": 0,
             "lastState": {}}
    engine = {"name": "engine", "state": {"waiting": {"reason": "PodInitializing"}},
              "ready": False, "restartCount": 0, "lastState": {}}
    pod = {"metadata": {"name": "p"},
           "status": {"initContainerStatuses": [fetch], "containerStatuses": [engine]}}
    assert pod_problem(pod) == ("CrashLoopBackOff", "init container fetch-model CrashLoopBackOff "
                                "(last exit code 1): error: m.gguf: sha256 is 1, not 2")
    fetch.update(state={"running": {}}, restartCount=1, lastState=failed)
    assert pod_problem(pod) is not None
    fetch.update(state={"terminated": {"exitCode": 0}})  # fetched at last
    assert pod_problem(pod) is None


def test_restarts_are_counted_over_the_pods_and_the_latest_named() -> None:
    """What a rollout's restart watch reads: an OOM kill that came back Ready counts too."""
    running = {"running": {}}
    oom = _engine(running, ready=True, restarts=1, exit_code=137)
    oom["metadata"] = {"name": "chat-b-1"}
    last = oom["status"]["containerStatuses"][0]["lastState"]["terminated"]  # type: ignore[index]
    last.update(reason="OOMKilled", finishedAt="2026-12-07T10:03:00Z", message="")
    crash = _engine(running, ready=False, restarts=2, exit_code=1)
    crash["status"]["containerStatuses"][0]["lastState"]["terminated"]["finishedAt"] = \
        "2026-12-07T10:01:00Z"  # type: ignore[index]
    healthy = _engine(running, ready=True, restarts=0, exit_code=None)
    assert restarts([healthy]) == (0, "")
    assert restarts([crash, oom, healthy]) == (
        3, "pod chat-b-1 container engine OOMKilled (exit code 137)")
    assert restarts([crash]) == (2, "pod p container engine restarted (exit code 1): boom")
