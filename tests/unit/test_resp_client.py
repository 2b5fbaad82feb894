"""The ledger's Redis client when Redis does not answer a connect (a blackholed port): the
callers queued behind one failed connect fail with it, not one connect timeout each in turn."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvfleet.router.resp import Redis


@pytest.mark.asyncio
async def test_callers_queued_behind_a_hung_connect_fail_with_it() -> None:
    loop = asyncio.get_running_loop()
    attempts = 0

    async def hangs(*_: Any, **__: Any) -> Any:
        nonlocal attempts
        attempts += 1
        await asyncio.sleep(3600)

    client = Redis("10.0.0.1", connect_timeout=0.2, timeout=0.1)
    original = loop.create_connection
    loop.create_connection = hangs  # type: ignore[method-assign]
    try:
        started = time.monotonic()
        results = await asyncio.gather(*(client.execute("PING") for _ in range(5)),
                                       return_exceptions=True)
        took = time.monotonic() - started
    finally:
        loop.create_connection = original  # type: ignore[method-assign]
    assert all(isinstance(r, (TimeoutError, ConnectionError)) for r in results), results
    assert attempts == 1 and took < 0.6, (attempts, took)  # was 5 attempts, 1 s
