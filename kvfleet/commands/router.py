"""`kvfleet router`: the fleet's front door (see `kvfleet.router.server`).

    kvfleet router -n NAMESPACE [--host 0.0.0.0] [--port 8080]   # the pools of one namespace
    kvfleet router -A                                            # every namespace
    kvfleet router --config router.yaml                          # no cluster: a file

Clients send OpenAI requests with `Authorization: Bearer <key>` and `model: <pool>`; the router
authenticates the tenant, enforces its TenantQuota, picks the revision and replica and streams
the answer through. In a cluster it watches ServingPools, engine pods, key Secrets and
TenantQuotas (in a pod: its service account; else $KUBECONFIG; see `kvfleet.router.cluster`).
`--config` names the pools, their endpoints and the tenants instead (format in
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
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("-n", "--namespace", help="route the pools of this namespace")
    where.add_argument("-A", "--all-namespaces", action="store_true",
                       help="route the pools of every namespace (`model`: name or ns/name)")
    where.add_argument("--config", type=Path, metavar="FILE",
                       help="pools, endpoints and tenants from a file (YAML), no cluster")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--replicas", type=int, default=1,
                   help="with --config: router replicas sharing the limits (each enforces 1/N "
                        "of each); in a cluster the router counts its Ready pods")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfleet.engine.request_log import configure_json_logging
    from kvfleet.router.state import ConfigError, RouterState, load_config

    configure_json_logging(getattr(logging, args.log_level.upper()))
    if args.config is None:
        return asyncio.run(_serve(args, RouterState()))
    try:
        state = load_config(args.config)
    except ConfigError as exc:
        print(f"kvfleet router: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(args, state))


def _cluster_api() -> Any:
    import kopf

    from kvfleet.kube.api import KubeApi, connection_from_kopf

    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
        settings=settings)
    if info is None:
        raise SystemExit("kvfleet router: no credentials: run in a pod with a service account, "
                         "or set KUBECONFIG")
    return KubeApi(connection_from_kopf(info), field_manager="kvfleet-router")


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
    tasks = [asyncio.create_task(router.scrape_forever())]
    api = None
    if args.config is not None:
        router.ledger.set_replicas(args.replicas, 0.0)
        tasks.append(asyncio.create_task(_watch(args.config, router)))
        app = build_app(router)
    else:
        from kvfleet.router.cluster import ClusterSource

        api = _cluster_api()
        source = ClusterSource(api, router, None if args.all_namespaces else args.namespace)
        tasks.append(asyncio.create_task(source.run()))
        app = build_app(router, ready=source.synced)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_config=None, access_log=False))
    try:
        await server.serve()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await router.close()
        if api is not None:
            await api.close()
    return 0
