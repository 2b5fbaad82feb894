"""The local pod runner's termination messages: what a kubelet writes when a container fails
under `terminationMessagePolicy: FallbackToLogsOnError` (the tail of its output), and where."""

from __future__ import annotations

from pathlib import Path

from kvfleet.devcluster.podrunner import read_output_tail
from kvfleet.devcluster.podstate import (
    TERMINATION_LOG_BYTES,
    TERMINATION_LOG_LINES,
    Container,
    LocalPod,
    falls_back_to_logs,
    pod_status,
    terminated_state,
    termination_message,
)

FALLBACK = {"name": "engine", "terminationMessagePolicy": "FallbackToLogsOnError"}


def _pod(*containers: Container) -> LocalPod:
    return LocalPod("u", "ns", "p", "n", "127.64.0.2", Path("/nonexistent"), list(containers), [])


def test_only_a_failure_under_the_fallback_policy_reads_the_log() -> None:
    assert falls_back_to_logs(FALLBACK, 1)
    assert falls_back_to_logs(FALLBACK, 137)  # killed by SIGKILL
    assert not falls_back_to_logs(FALLBACK, 0)
    assert not falls_back_to_logs({"name": "a"}, 1)  # the default policy is File
    assert not falls_back_to_logs({"name": "a", "terminationMessagePolicy": "File"}, 1)


def test_message_is_the_last_80_lines_cut_to_2_kib() -> None:
    short = b"".join(f"line {i}\n".encode() for i in range(100))
    message = termination_message(short)
    assert message.splitlines() == [f"line {i}" for i in range(100 - TERMINATION_LOG_LINES, 100)]
    long = b"".join(f"{i:04d} {'x' * 95}\n".encode() for i in range(60))
    message = termination_message(long)
    assert len(message.encode()) == TERMINATION_LOG_BYTES
    assert message.endswith(f"0059 {'x' * 95}\n")  # the end survives: that is the reason
    # A multi-byte character cut by the byte limit does not break decoding.
    assert termination_message("é".encode() * TERMINATION_LOG_BYTES).endswith("é")


def test_a_suffix_of_the_output_gives_the_same_message() -> None:
    output = b"".join(f"{i} {'y' * (i % 50)}\n".encode() for i in range(500))
    assert termination_message(output[-TERMINATION_LOG_BYTES:]) == termination_message(output)


def test_only_the_current_run_is_read_from_a_shared_log(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"first run: crashed for reason A\n")
    start = log.stat().st_size
    with log.open("ab") as f:
        f.write(b"second run: crashed for reason B\n")
    assert read_output_tail(log, start) == b"second run: crashed for reason B\n"
    with log.open("ab") as f:
        f.write(b"z" * 5000)
    assert read_output_tail(log, start) == b"z" * TERMINATION_LOG_BYTES
    assert read_output_tail(tmp_path / "never-started.log", 0) == b""


def test_crash_looping_container_reports_the_reason_in_last_state() -> None:
    reason = "engine failed to start: sha256 abc does not match the manifest's def\n"
    c = Container(FALLBACK, restart_count=1, started_at="2026-01-01T00:00:00Z", exit_code=1)
    c.finished_at, c.termination_message = "2026-01-01T00:00:03Z", reason
    c.last_terminated = terminated_state(c)
    (state,) = pod_status(_pod(c), {})["containerStatuses"]
    assert state["state"] == {"waiting": {"reason": "CrashLoopBackOff"}}
    assert state["lastState"]["terminated"]["message"] == reason
    assert state["lastState"]["terminated"]["exitCode"] == 1


def test_finished_container_carries_its_message_and_a_clean_exit_none() -> None:
    failed = Container(FALLBACK, done=True, exit_code=2, termination_message="boom\n")
    (state,) = pod_status(_pod(failed), {})["containerStatuses"]
    assert state["state"]["terminated"]["message"] == "boom\n"
    clean = Container({"name": "a"}, done=True, exit_code=0)
    (state,) = pod_status(_pod(clean), {})["containerStatuses"]
    assert "message" not in state["state"]["terminated"]
