"""`kvfleet router`: the fleet's front door (see `kvfleet.router.server`).

    kvfleet router --config router.yaml [--host 0.0.0.0] [--port 8080]

Clients send OpenAI requests with `Authorization: Bearer <key>` and `model: <pool>`; the router
authenticates the tenant, enforces its TenantQuota, picks the revision and replica and streams
the answer through. `--config` names the pools, their endpoints and the tenants (format in
`kvfleet.router.state`); the file is re-read when it changes (checked every second).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("kvfleet.router")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("router", help="the tenant-aware front door of the pools",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, required=True, metavar="FILE",
                   help="pools, endpoints and tenants (YAML)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--replicas", type=int, default=1,
                   help="router replicas sharing the limits (each enforces 1/N of each)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfleet.engine.request_log import configure_json_logging
    from kvfleet.router.state import ConfigError, load_config

    configure_json_logging(getattr(logging, args.log_level.upper()))
    try:
        state = load_config(args.config)
    except ConfigError as exc:
        print(f"kvfleet router: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(args, state))


async def _watch(path: Path, router: Any) -> None:
    """Re-read the config file when it changes; a bad edit is logged and the old one kept."""
    from kvfleet.router.state import ConfigError, load_config

    seen = path.stat().st_mtime_ns
    while True:
        await asyncio.sleep(1.0)
        with contextlib.suppress(OSError):
            mtime = path.stat().st_mtime_ns
            if mtime == seen:
                continue
            seen = mtime
            try:
                router.update(load_config(path))
                log.info("router config %s reloaded", path)
            except ConfigError as exc:
                log.error("router config %s not reloaded (the previous one stays): %s", path, exc)


async def _serve(args: argparse.Namespace, state: Any) -> int:
    import uvicorn

    from kvfleet.router.server import Router, build_app

    router = Router(state)
    router.ledger.set_replicas(args.replicas, 0.0)
    app = build_app(router)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_config=None, access_log=False))
    tasks = [asyncio.create_task(router.scrape_forever()),
             asyncio.create_task(_watch(args.config, router))]
    try:
        await server.serve()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await router.close()
    return 0
