"""Background tasks that must never end: informers, the drift loop, status writers.

Each runs for the life of the process; one that ends (an exception nobody caught, or a return)
would otherwise end silently, and every reconcile after it would wait for ever on an informer
that no longer syncs while the liveness probe still answers. `fatal_if_it_ends` turns such an
end into a logged, non-zero exit, so the kubelet restarts the pod (restartPolicy Always) and a
fresh process lists everything again. A cancelled task (shut-down) is not a failure.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvfleet.kube.tasks")

FATAL_EXIT_CODE = 4


def exit_process(reason: str) -> None:
    log.critical("%s; exiting (code %d) so that the pod restarts with a fresh process", reason,
                 FATAL_EXIT_CODE)
    logging.shutdown()
    os._exit(FATAL_EXIT_CODE)


def fatal_if_it_ends(task: asyncio.Task[Any],
                     on_fatal: Callable[[str], None] = exit_process) -> asyncio.Task[Any]:
    def done(finished: asyncio.Task[Any]) -> None:
        if finished.cancelled():
            return
        exc = finished.exception()
        if exc is not None:
            log.critical("background task %r died", finished.get_name(), exc_info=exc)
        on_fatal(f"background task {finished.get_name()!r} "
                 + (f"died: {exc!r}" if exc is not None else "ended"))

    task.add_done_callback(done)
    return task
