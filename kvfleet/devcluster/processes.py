"""Child processes that cannot outlive the harness.

Every child runs in its own process group (so a terminal's Ctrl-C reaches only the harness,
which then stops the children in order) and asks the kernel for SIGTERM when the harness dies
(PR_SET_PDEATHSIG), so even a SIGKILLed test run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from kvfleet.devcluster.errors import StartupError

_PR_SET_PDEATHSIG = 1


def _child_setup(cpus: frozenset[int] | None = None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if cpus:  # before exec, so the program's first thread pool already sees its CPUs
        os.sched_setaffinity(0, cpus)


class ManagedProcess:
    """One child process with its output in a log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        cpus: frozenset[int] | None = None,
    ) -> None:
        """`cpus`: the CPUs the process may run on (its affinity; None: all of ours)."""
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = log_path.open("ab")
        try:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=functools.partial(_child_setup, cpus),
            )
        except (OSError, subprocess.SubprocessError) as exc:  # the latter: _child_setup failed
            self._log.close()
            raise StartupError(f"{name}: cannot start {self.argv[0]}: {exc}") from exc

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def wait_ready(self, check: Callable[[], bool], timeout: float) -> None:
        """Poll `check` until true; StartupError with the log tail if the child dies or stalls."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.running():
                raise StartupError(
                    f"{self.name} exited with {self.popen.returncode} during start-up "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            try:
                if check():
                    return
            except Exception:  # any failure of the probe means "not yet"
                pass
            if time.monotonic() > deadline:
                raise StartupError(
                    f"{self.name} not ready after {timeout:.0f}s (log {self.log_path}):\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.1)

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signum)

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL after `grace` seconds; returns the exit code."""
        if self.running():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(5)
        # The leader is gone; make sure no grandchild of its group lingers either.
        self.signal(signal.SIGKILL)
        self._log.close()
        return self.popen.returncode
