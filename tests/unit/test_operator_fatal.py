"""The operator's background loops are wired to `fatal_if_it_ends`: an informer that dies on
an exception nobody catches ends the process (here: the recorded reason), it does not leave
every reconcile waiting on a cache that no longer syncs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp_fakes import serving
from kopf._core.intents.causes import Activity
from kubeconfig_fakes import write_kubeconfig

from kvfleet.compat import default_matrix
from kvfleet.operator import cache
from kvfleet.operator.handlers import KOPF_INDEXED, OperatorConfig, build_registry


@pytest.mark.asyncio
async def test_an_informer_that_dies_ends_the_operator(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    async def listing(request: web.Request) -> web.Response:
        # A list item whose metadata is not an object: the informer's store raises
        # AttributeError, which no retry path catches (a bug of that kind must end the
        # process, not the informer alone).
        return web.json_response({"kind": "List", "metadata": {"resourceVersion": "1"},
                                  "items": [{"kind": "Pod", "metadata": "broken"}]})

    app = web.Application()
    app.router.add_get("/{tail:.*}", listing)
    fatal: list[str] = []
    registry = build_registry(OperatorConfig(matrix=default_matrix(), on_fatal=fatal.append))
    activities = registry._activities.get_all_handlers()
    # Called as kopf calls them, with only the keywords these handlers read.
    (login,) = [h.fn for h in activities if h.activity == Activity.AUTHENTICATION]
    (cleanup,) = [h.fn for h in activities if h.activity == Activity.CLEANUP]
    login_fn: Any = login
    cleanup_fn: Any = cleanup
    async with serving(app) as port:
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(
            tmp_path / "kc", {}, {"token": "t"}, server=f"http://127.0.0.1:{port}")))
        try:
            indices: dict[str, Any] = {cache.INDEX_IDS[k]: {} for k in KOPF_INDEXED.values()}
            await login_fn(**indices)
            for _ in range(200):
                if fatal:
                    break
                await asyncio.sleep(0.01)
        finally:
            await cleanup_fn()
    assert fatal, "an informer died and nothing noticed"
    assert all("died: AttributeError" in reason and "'informer " in reason
               for reason in fatal), fatal
