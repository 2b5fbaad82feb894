"""guidellm's command line (run by `.venv-guidellm/bin/python`) with its Poisson arrivals made
Poisson, and the same for every server it measures: what `bench/vs_llama_cpp.py` runs.
guidellm 0.8.1's Poisson profile has the worker processes share one arrival clock, each adding
a gap it draws from its own generator. Three things about that are changed here; nothing else
of guidellm is.

1. Every worker seeds its generator with the same seed, so every worker draws the same gaps,
   each added to the clock once per worker: with 10 workers the arrivals come in runs of 10 at
   one spacing (a run of short gaps is a burst of 10 within a fraction of a second), and a
   30 s window at 1 req/s sent 51 requests where 30 were due (read off the request start
   times of guidellm's report).
2. Which worker draws next depends on when its requests finish, so even with a generator of
   its own per worker the n-th arrival's gap depends on the server measured: two servers are
   sent different schedules (measured: 25 and 27 requests in the same 1 req/s window).
3. The start wakes the workers before it sets the clock, so a worker that wakes first adds its
   draws to the clock's initial -1.0: arrivals due in 1970, all sent at once.

Here the n-th gap is drawn from a generator seeded with the seed and n, n counted on the clock
itself (a shared [clock, draws] pair), so the schedule is one Poisson process at the rate
asked for, the same for every server and run; and the clock is set before the workers wake.
"""

from __future__ import annotations

import random
import sys
from multiprocessing.context import BaseContext
from typing import Any

from guidellm.__main__ import cli
from guidellm.scheduler.strategies import AsyncPoissonStrategy, ThroughputStrategy

CLOCK, DRAWS = 0, 1  # the shared pair's slots


def _shared_clock_and_count(self: Any, worker_count: int, max_concurrency: int,
                            mp_context: BaseContext) -> None:
    self._offset = mp_context.Array("d", [-1.0, 0.0])
    ThroughputStrategy.init_processes_timings(self, worker_count, max_concurrency, mp_context)


def _start_clock_first(self: Any, start_time: float) -> None:
    with self._offset.get_lock():
        self._offset[CLOCK] = start_time
    ThroughputStrategy.init_processes_start(self, start_time)


async def _nth_gap(self: Any, worker_index: int) -> float:
    await self.get_processes_start_time()  # the clock is set by then (see _start_clock_first)
    with self._offset.get_lock():
        n = int(self._offset[DRAWS])
        self._offset[DRAWS] = n + 1
        # A str seed hashes alike in every process (an int tuple's hash() need not).
        self._offset[CLOCK] += random.Random(f"{self.random_seed}/{n}").expovariate(self.rate)
        return float(self._offset[CLOCK])


AsyncPoissonStrategy.init_processes_timings = _shared_clock_and_count  # type: ignore[method-assign]
AsyncPoissonStrategy.init_processes_start = _start_clock_first  # type: ignore[method-assign]
AsyncPoissonStrategy.next_request_time = _nth_gap  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.argv[0] = "guidellm"
    sys.exit(cli())
