"""One engine server process: serve HTTP at once, load and warm up, drain on SIGTERM.

The HTTP listener starts before the model loads, so `/health` answers (state LOADING) while
weights are read and a slow load is not mistaken for a dead process. The model loads in a
worker thread; a warm-up generation then moves the instance to READY.

SIGTERM (or SIGINT) starts a drain: the instance leaves READY at once (new requests get 503
`not_ready`, `/ready` turns 503 so endpoints are removed), in-flight requests get
`grace_seconds` to finish, the rest end with finish_reason `cancelled`, then the listener
closes and the process exits 0. A second SIGINT forces an immediate exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TypeVar

import uvicorn

from kvfleet.engine.async_engine import AsyncEngine
from kvfleet.engine.chat_template import ChatTemplate
from kvfleet.engine.errors import KvfleetEngineError
from kvfleet.engine.faults import FAULTS_ENV
from kvfleet.engine.lifecycle import Lifecycle, LifecycleState, WarmupError, warm_up
from kvfleet.engine.server import ServerSettings, Serving, create_app
from kvfleet.tls import ServingCertificate

logger = logging.getLogger("kvfleet.engine.runtime")


@dataclass(frozen=True, slots=True)
class LoadedEngine:
    engine: AsyncEngine
    chat_template: ChatTemplate | None
    warmup_prompt_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    grace_seconds: float = 30.0
    stall_seconds: float = 60.0  # the engine watchdog's limit (`AsyncEngine.check`)
    settings: ServerSettings = field(default_factory=ServerSettings)
    # HTTPS with this (certificate, key) pair, reloaded when the files change; None: HTTP.
    tls: tuple[Path, Path] | None = None


class _DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains instead of closing at once."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], object]) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self.draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.draining:
            self.draining = True
            logger.info("signal %d: draining", sig,
                        extra={"fields": {"event": "drain_start", "signal": sig}})
            self._on_signal()
        elif sig == signal.SIGINT:
            self.force_exit = self.should_exit = True
        # Unlike uvicorn, the signal is not re-raised after shutdown: draining is the
        # handling, and the process exits 0.


T = TypeVar("T")


async def in_own_thread(fn: Callable[[], T], name: str) -> T:
    """`fn()` on a thread of its own that ends with it (not an executor thread, which stays).

    Why: loading runs torch ops in parallel regions, and GNU OpenMP keeps a team of worker
    threads for every thread that has run one, for as long as that thread lives. With the
    loading thread's team still alive next to the engine thread's, libgomp manages more threads
    than there are CPUs (it then cuts its spin-waiting short), and the parallel regions of
    every step wait on workers that are asleep or descheduled: a one-request decode step took
    55-60 ms instead of 34-37 (2 cores; the same load kept alive vs exited), and a served
    request's time per output token fell from 62-65 ms to 39-41 ms with this."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting coroutine, which re-raises it
            loop.call_soon_threadsafe(_set_exception, done, exc)
        else:
            loop.call_soon_threadsafe(_set_result, done, result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done


def _crash(after: float) -> None:
    """The injected crash (`faults.exit_after`): no drain, no goodbye, as an OOM kill."""
    logger.error("injected crash %.0f s after ready (%s exit_after)", after, FAULTS_ENV,
                 extra={"fields": {"event": "fault_exit"}})
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


def _set_result(future: asyncio.Future[T], result: T) -> None:
    if not future.cancelled():
        future.set_result(result)


def _set_exception(future: asyncio.Future[T], exc: BaseException) -> None:
    if not future.cancelled():
        future.set_exception(exc)


async def run_server(load: Callable[[], LoadedEngine], options: RuntimeOptions) -> int:
    """Serve until drained; the exit code (0 after a drain, 1 if loading/warm-up failed)."""
    lifecycle = Lifecycle()
    serving = Serving(lifecycle)
    app = create_app(serving, options.settings)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_config=None,
                            access_log=False, lifespan="off",
                            timeout_graceful_shutdown=int(options.grace_seconds) + 5)
    loop = asyncio.get_running_loop()
    watch_certificate = None
    if options.tls is not None:
        # uvicorn loads its config once; its SSL context is then swapped for one whose
        # certificate reloads in place (a renewed Secret) without a restart.
        certificate = ServingCertificate(*options.tls)
        config.load()
        config.ssl = certificate.context
        watch_certificate = loop.create_task(certificate.watch())

    async def drain() -> None:
        lifecycle.advance(LifecycleState.DRAINING)
        try:
            if serving.engine is not None:
                cancelled = await serving.engine.drain(options.grace_seconds)
                logger.info("drained; %d requests cancelled after the grace period", cancelled,
                            extra={"fields": {"event": "drain_done", "cancelled": cancelled}})
        except Exception:  # the process must still exit; uvicorn's own timeout is the backstop
            logger.exception("drain failed")
        finally:
            server.should_exit = True

    server = _DrainingServer(config, lambda: loop.call_soon_threadsafe(
        lambda: loop.create_task(drain())))
    serve_task = asyncio.create_task(server.serve())
    exit_code = 0
    start_error: Exception | None = None
    try:
        loaded = await in_own_thread(load, "kvfleet-load")
        serving.chat_template = loaded.chat_template
        serving.engine = loaded.engine
        loaded.engine.start(options.stall_seconds)
        if lifecycle.state is LifecycleState.LOADING:
            await warm_up(loaded.engine, lifecycle, loaded.warmup_prompt_ids)
            loaded.engine.step_delay = options.settings.faults.token_delay
            if options.settings.faults.stall_after:
                loaded.engine.stall_after = int(options.settings.faults.stall_after)
            if options.settings.faults.exit_after:
                loop.call_later(options.settings.faults.exit_after, _crash,
                                options.settings.faults.exit_after)
            logger.info("ready", extra={"fields": {"event": "ready",
                                                   "model": loaded.engine.model.name,
                                                   "revision": loaded.engine.model.revision}})
    except (KvfleetEngineError, WarmupError, ValueError) as exc:
        start_error = exc
        exit_code = 1
        server.should_exit = True
    await serve_task
    if start_error is not None:
        # Logged after the listener's shutdown lines, so the reason is the process's last
        # line: Kubernetes turns the log tail into the termination message the operator shows.
        logger.error("engine failed to start: %s", start_error,
                     extra={"fields": {"event": "start_failed"}})
    if serving.engine is not None:
        await serving.engine.stop()
    if watch_certificate is not None:
        watch_certificate.cancel()
    if not server.started and exit_code == 0:
        exit_code = 1  # e.g. the port was taken; uvicorn logged why
    return exit_code
