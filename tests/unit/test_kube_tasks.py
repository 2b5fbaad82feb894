"""A background loop that ends (an uncaught exception, or a return) is fatal, never silent;
one cancelled at shut-down is not."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.kube.tasks import fatal_if_it_ends


@pytest.mark.asyncio
async def test_a_loop_that_dies_or_returns_is_fatal_and_a_cancelled_one_is_not() -> None:
    fatal: list[str] = []

    async def dies() -> None:
        raise KeyError("a bug in an informer's handler")

    async def returns() -> None:
        return

    async def forever() -> None:
        await asyncio.sleep(3600)

    tasks = [fatal_if_it_ends(asyncio.create_task(f(), name=f.__name__), fatal.append)
             for f in (dies, returns, forever)]
    await asyncio.sleep(0.01)
    tasks[2].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert fatal == ["background task 'dies' died: KeyError(\"a bug in an informer's handler\")",
                     "background task 'returns' ended"]


@pytest.mark.asyncio
async def test_a_routers_informer_that_dies_is_fatal() -> None:
    """The router's informers (here on no API at all: the first list raises AttributeError,
    which no retry path catches) end the process instead of leaving it serving stale state."""
    from kvfleet.router.cluster import ClusterSource
    from kvfleet.router.server import Router
    from kvfleet.router.state import parse_config

    source = ClusterSource(api=None, router=Router(parse_config({})),  # type: ignore[arg-type]
                           namespace="llm")
    fatal: list[str] = []
    source.on_fatal = fatal.append
    await _until_fatal(asyncio.create_task(source.run()), fatal)
    assert fatal and all("died: AttributeError" in f for f in fatal), fatal
    assert any("'informer pools'" in f for f in fatal)


@pytest.mark.asyncio
async def test_a_routers_watch_loop_that_dies_is_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuild that raises ended the loop that turns watch events into the routing state:
    the router served the state of that moment for ever, /ready still 200."""
    from kvfleet.router.cluster import ClusterSource
    from kvfleet.router.server import Router
    from kvfleet.router.state import parse_config

    source = ClusterSource(api=None, router=Router(parse_config({})),  # type: ignore[arg-type]
                           namespace="llm")
    fatal: list[str] = []
    source.on_fatal = fatal.append

    async def watching() -> None:
        await asyncio.sleep(3600)

    def broken() -> None:
        raise ValueError("a ServingPool the rebuild did not expect")

    for informer in source.informers.values():
        monkeypatch.setattr(informer, "run", watching)
    monkeypatch.setattr(source, "synced", lambda: True)
    monkeypatch.setattr(source, "rebuild", broken)
    running = source.start()
    source._changed(None, {})
    await _until_fatal(running, fatal)
    assert fatal == ["background task 'cluster state' died: ValueError('a ServingPool the "
                     "rebuild did not expect')"], fatal


async def _until_fatal(running: asyncio.Task[None], fatal: list[str]) -> None:
    """Waits (at most a second) for a fatal report, then stops `running`."""
    for _ in range(100):
        if fatal:
            break
        await asyncio.sleep(0.01)
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
