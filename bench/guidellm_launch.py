"""guidellm's command line (run by `.venv-guidellm/bin/python`), with its Poisson arrivals
started in order: what `bench/vs_llama_cpp.py` runs.

guidellm 0.8.1 starts a Poisson benchmark by setting the start time, which wakes its worker
processes, and only then the shared arrival clock (`_offset`) to that time. A worker that wakes
in between adds its first draws to the clock's initial -1.0: those arrivals fall due in 1970,
so they all go out at once, as fast as the worker can draw them, until the main process sets
the clock. On 2 busy cores the main process can be off the CPU for milliseconds right there:
Poisson windows at 1-2 req/s sent 166-411 requests where 30-60 were due, to both servers.
Here the clock is set first. Nothing else of guidellm changes.
"""

from __future__ import annotations

import sys
from typing import Any

from guidellm.__main__ import cli
from guidellm.scheduler.strategies import AsyncPoissonStrategy, ThroughputStrategy


def _start_clock_first(self: Any, start_time: float) -> None:
    if self._offset is None:
        raise RuntimeError("_offset is None in init_processes_start; was "
                           "init_processes_timings not called?")
    with self._offset.get_lock():
        self._offset.value = start_time
    ThroughputStrategy.init_processes_start(self, start_time)


AsyncPoissonStrategy.init_processes_start = _start_clock_first  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.argv[0] = "guidellm"
    sys.exit(cli())
