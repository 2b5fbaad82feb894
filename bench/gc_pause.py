"""How long a full pass of Python's cyclic collector stalls an engine or a router, with and
without the start-up heap frozen (`gc.freeze()`, which `kvfleet serve` and `kvfleet router`
call once they have loaded).

    .venv/bin/python bench/gc_pause.py

Loads the embedded SmolLM2 as the engine does and imports the engine's server, then times
`gc.collect()` (the full pass the collector makes on its own whenever enough objects have
survived to the oldest generation) three times before `gc.freeze()` and three times after.
A full pass holds the GIL: every stream and decode step of the process waits for it.
"""

from __future__ import annotations

import gc
import importlib
import time


def timed_passes(n: int = 3) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> int:
    from kvfleet.engine.model.loader import default_model_path, load_model

    loaded = load_model(default_model_path())
    importlib.import_module("kvfleet.engine.server")  # (what a serving process also holds)

    print(f"{len(gc.get_objects()):,} objects tracked after loading {loaded.name}")
    before = timed_passes()
    gc.freeze()
    after = timed_passes()
    print("full pass ms, before freeze: " + ", ".join(f"{t:.1f}" for t in before))
    print("full pass ms, after freeze:  " + ", ".join(f"{t:.2f}" for t in after))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
