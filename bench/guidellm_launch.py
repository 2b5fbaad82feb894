"""guidellm's command line (run by `.venv-guidellm/bin/python`) with its Poisson arrivals made
Poisson: what `bench/vs_llama_cpp.py` runs. Two defects of guidellm 0.8.1 are mended here;
nothing else of guidellm changes.

1. Every worker process seeds its own generator with the same seed, so every worker draws the
   same gaps, and each gap is added to the shared arrival clock once per worker: with 10
   workers the arrivals come in runs of 10 at one spacing (a run of short gaps is a burst of
   10 within a fraction of a second), and a 30 s window at 1 req/s sent 51 requests where 30
   were due (read off the request start times of guidellm's report). Here each worker's
   generator is seeded with the seed and its own index, so the gaps are independent and the
   clock's increments are one Poisson process at the rate asked for.
2. The Poisson start sets the start time, which wakes the worker processes, and only then the
   shared arrival clock (`_offset`) to that time. A worker that wakes in between adds its
   first draws to the clock's initial -1.0: those arrivals fall due in 1970 and all go out at
   once until the main process sets the clock. Here the clock is set first.
"""

from __future__ import annotations

import random
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


async def _next_request_time_own_draws(self: Any, worker_index: int) -> float:
    await self.get_processes_start_time()  # the clock is set by then (see _start_clock_first)
    if self._random is None:
        # A str seed is hashed the same way in every process (an int tuple's hash() is not
        # guaranteed to be), so a run stays reproducible.
        self._random = random.Random(f"{self.random_seed}/{worker_index}")
    if self._offset is None:
        raise RuntimeError("_offset is None in next_request_time; was "
                           "init_processes_timings not called?")
    next_delay = self._random.expovariate(self.rate)
    with self._offset.get_lock():
        self._offset.value += next_delay
        return float(self._offset.value)


AsyncPoissonStrategy.init_processes_start = _start_clock_first  # type: ignore[method-assign]
AsyncPoissonStrategy.next_request_time = _next_request_time_own_draws  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.argv[0] = "guidellm"
    sys.exit(cli())
