"""The operator process's garbage-collector settings.

A full collection walks every container object the process holds: at 5,000 pools, the cached
pools' dicts and lists, about 0.9 s with the event loop stopped. With Python's default
thresholds (700, 10, 10) one ran every 10 s during a burst of creates (60 in 600 s, 55 s in
all), because a watch event or an apiserver reply lives for milliseconds, long enough to
outlast the two young collections that 700 allocations apiece bring, and each promoted object
brings the next full collection closer. Young collections every 50,000 allocations let such
objects die young; what the imports built is frozen out of every walk. Measured in
bench/README.md ("Session 35").
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000  # allocations between young collections (Python's default: 700)


def tune() -> None:
    """Call once, after the imports and before the operator starts its work."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 20, 10)
