"""`kvfleet router`: the fleet's front door (see `kvfleet.router.server`).

    kvfleet router -n NAMESPACE [--host 0.0.0.0] [--port 8080] [--metrics-port 9091]
    kvfleet router -A                                            # every namespace
    kvfleet router --config router.yaml                          # no cluster: a file

Clients send OpenAI requests with `Authorization: Bearer <key>` and `model: <pool>`; the router
authenticates the tenant, enforces its TenantQuota, picks the revision and replica and streams
the answer through. In a cluster it watches ServingPools, engine pods, key Secrets and
TenantQuotas (in a pod: its service account; else $KUBECONFIG; see `kvfleet.router.cluster`).
`--config` names the pools, their endpoints and the tenants instead (format in
`kvfleet.router.state`); the file is re-read when it changes (checked every second).
`/metrics` is served on `--metrics-port` only, never on the clients' port.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("kvfleet.router")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("router", help="the tenant-aware front door of the pools",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--print-manifests", action="store_true",
                   help="print the router's install manifests for -n NAMESPACE (YAML) and exit")
    p.add_argument("--redis-secret", metavar="SECRET",
                   help="with --print-manifests: the Secret whose key `url` holds the shared "
                        "quota ledger's redis:// URL (the pods get it as $KVFLEET_REDIS_URL)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("-n", "--namespace", help="route the pools of this namespace")
    where.add_argument("-A", "--all-namespaces", action="store_true",
                       help="route the pools of every namespace (`model`: name or ns/name)")
    where.add_argument("--config", type=Path, metavar="FILE",
                       help="pools, endpoints and tenants from a file (YAML), no cluster")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--metrics-port", type=int, default=9091,
                   help="where /metrics is served (on --host): a port of its own, for "
                        "Prometheus, which the clients' port does not answer")
    p.add_argument("--replicas", type=int, default=1,
                   help="with --config: router replicas sharing the limits without a shared "
                        "ledger (each enforces its share); in a cluster the router counts its "
                        "Ready pods")
    p.add_argument("--replica-index", type=int, default=None, metavar="I",
                   help="with --config and --replicas N: this router's index, 0..N-1, so that "
                        "the shares sum to each limit (without it each share is rounded up: "
                        "the routers may admit up to N-1 over a limit)")
    p.add_argument("--own-namespace", metavar="NS",
                   help="with -A: the namespace of the router's own pods, the only router pods "
                        "counted as its replicas (default: $POD_NAMESPACE, which the manifests "
                        "set, else the pod's service account namespace; else every namespace's)")
    p.add_argument("--name", default=os.environ.get("POD_NAME") or socket.gethostname(),
                   help="this replica's name in the TenantQuotas' router reports (default: "
                        "$POD_NAME, which the manifests set, else the host name); a restarted "
                        "router with the same name starts from its own last report")
    p.add_argument("--pick", choices=["affinity", "round-robin"], default="affinity",
                   help="replica choice: load then prefix affinity (default), or round-robin "
                        "(a baseline for benchmarks)")
    p.add_argument("--scrape-interval", type=float, default=0.2, metavar="SECONDS",
                   help="how often each engine replica's load is read (default 0.2)")
    p.add_argument("--stream-idle-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="fail a stream whose engine sends nothing for this long (its first "
                        "byte comes after queueing and prefill); default 120")
    p.add_argument("--answer-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="fail a non-streamed request whose engine has not answered in this "
                        "long (the whole generation); default 900")
    p.add_argument("--send-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="drop a streaming client that takes no data for this long (billed "
                        "what was relayed); default 60")
    p.add_argument("--max-connections", type=int, metavar="N",
                   help="connections the router holds at once; more are closed as they open; "
                        "default 8192")
    p.add_argument("--max-connections-per-client", type=int, metavar="N",
                   help="connections from one client address; set it above what a NAT or "
                        "proxy in front sends from one address; default 512")
    p.add_argument("--default-quota", type=Path, metavar="FILE",
                   help="a TenantQuota spec (YAML: limits, allowedPools, priorityClass, ...) "
                        "for tenants that have none; without it such tenants are refused "
                        "(403 no_tenant_quota)")
    p.add_argument("--redis", metavar="URL", default=os.environ.get("KVFLEET_REDIS_URL"),
                   help="the shared quota ledger (redis://[:password@]host:port/db): every "
                        "router replica enforces the fleet-wide limits on the same buckets; "
                        "without it, or while it is unreachable, each enforces its 1/N share "
                        "(default: $KVFLEET_REDIS_URL, which keeps a password out of ps)")
    p.add_argument("--redis-prefix", metavar="PREFIX",
                   default=os.environ.get("KVFLEET_REDIS_PREFIX") or "kvfleet",
                   help="prefix of the ledger's keys, for fleets sharing one Redis "
                        "(default kvfleet)")
    p.add_argument("--redis-timeout", type=float, default=0.1, metavar="SECONDS",
                   help="how long a ledger command may take before the router falls back to "
                        "its share of each limit (a hung Redis adds at most this to the "
                        "requests in flight); default 0.1")
    p.add_argument("--hold-seconds", type=float, default=300.0, metavar="SECONDS",
                   help="how long a request for a pool at zero replicas waits for one to wake "
                   "(a client may ask for less: x-kvfleet-max-wait-seconds); then 503 with "
                   "Retry-After")
    p.add_argument("--hold-per-pool", type=int, default=64, metavar="N",
                   help="requests held at most per pool while it wakes (more: 503)")
    p.add_argument("--hold-per-tenant", type=int, default=16, metavar="N",
                   help="requests held at most per tenant (one tenant cannot fill a pool's "
                   "hold)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def _own_namespace() -> str | None:
    """The namespace this process runs in as a pod, if it can tell."""
    if namespace := os.environ.get("POD_NAMESPACE"):
        return namespace
    try:
        from kvfleet.kube.credentials import SERVICE_ACCOUNT

        return (SERVICE_ACCOUNT / "namespace").read_text().strip() or None
    except OSError:
        return None


def run(args: argparse.Namespace) -> int:
    from kvfleet.engine.request_log import configure_json_logging
    from kvfleet.router.state import ConfigError, RouterState, load_config

    if args.print_manifests:
        import yaml

        from kvfleet.router.manifests import build_manifests

        if not args.namespace:
            print("kvfleet router --print-manifests: name the namespace with -n", file=sys.stderr)
            return 2
        secret = f" --redis-secret {args.redis_secret}" if args.redis_secret else ""
        print("# Generated by `kvfleet router --print-manifests -n "
              f"{args.namespace}{secret}`; do not edit.")
        print(yaml.safe_dump_all(build_manifests(args.namespace, redis_secret=args.redis_secret),
                                 sort_keys=False), end="")
        return 0
    configure_json_logging(getattr(logging, args.log_level.upper()))
    try:
        default = None if args.default_quota is None else _default_quota(args.default_quota)
        state = RouterState() if args.config is None else load_config(args.config)
        if args.redis:
            _check_redis_url(args.redis)
        if args.metrics_port == args.port:
            raise ConfigError(f"--metrics-port {args.metrics_port}: it must differ from --port "
                              "(clients must not read the router's metrics)")
        if args.replica_index is not None and not 0 <= args.replica_index < args.replicas:
            raise ConfigError(f"--replica-index {args.replica_index}: it must be from 0 to "
                              f"{args.replicas - 1} (--replicas {args.replicas})")
    except ConfigError as exc:
        print(f"kvfleet router: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(args, state, default))


def _default_quota(path: Path) -> Any:
    import yaml

    from kvfleet.router.state import ConfigError, parse_default_quota

    try:
        return parse_default_quota(yaml.safe_load(path.read_text()), f"--default-quota {path}")
    except OSError as exc:
        raise ConfigError(f"--default-quota {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--default-quota {path}: not YAML ({exc})") from None


def _check_redis_url(url: str) -> None:
    from kvfleet.router.resp import Redis
    from kvfleet.router.state import ConfigError

    try:
        Redis.from_url(url)
    except ValueError as exc:
        raise ConfigError(f"--redis: {exc}") from None


def _cluster_api() -> Any:
    from kvfleet.kube.api import login

    return login("kvfleet-router", "kvfleet router")


async def _watch(path: Path, router: Any) -> None:
    """Re-read the config file when it or a token file it names changes; a bad edit is
    logged and the old one kept."""
    from kvfleet.router.state import ConfigError, config_files, load_config

    def stamp(files: list[Path]) -> list[tuple[int, int] | None]:
        found: list[tuple[int, int] | None] = []
        for file in files:
            try:
                st = file.stat()
                found.append((st.st_ino, st.st_mtime_ns))
            except OSError:
                found.append(None)
        return found

    files = config_files(path)
    seen = stamp(files)
    while True:
        await asyncio.sleep(1.0)
        now = stamp(files)
        if now == seen:
            continue
        files = config_files(path)
        seen = stamp(files)
        try:
            router.update(load_config(path))
            log.info("router config %s reloaded", path)
        except ConfigError as exc:
            log.error("router config %s not reloaded (the previous one stays): %s", path, exc)


async def _serve(args: argparse.Namespace, state: Any, default_quota: Any = None) -> int:
    import uvicorn

    from kvfleet.router.connections import bounded
    from kvfleet.router.server import Router, RouterOptions, build_app, build_metrics_app

    router = Router(state, RouterOptions(
        pick_policy=args.pick, default_quota=default_quota,
        stream_idle_timeout=args.stream_idle_timeout, answer_timeout=args.answer_timeout,
        send_timeout=args.send_timeout,
        # A load read older than a few intervals is stale (the replica counts as saturated).
        scrape_interval=args.scrape_interval, stale_after=max(1.0, 5 * args.scrape_interval),
        redis_url=args.redis, redis_prefix=args.redis_prefix, redis_timeout=args.redis_timeout,
        hold_seconds=args.hold_seconds,
        hold_per_pool=args.hold_per_pool, hold_per_tenant=args.hold_per_tenant))
    from kvfleet.kube.tasks import exit_process, fatal_if_it_ends

    # A loop that dies is a fatal error, as an informer's is: routing without the replicas'
    # load, or on a config that no longer reloads, must not go on silently.
    tasks = [fatal_if_it_ends(asyncio.create_task(router.scrape_forever(),
                                                  name="replica load scrape")),
             fatal_if_it_ends(asyncio.create_task(router.synthesize_forever(),
                                                  name="synthetic requests"))]
    if router.shared is not None:
        tasks.append(fatal_if_it_ends(asyncio.create_task(router.shared.keep_leases(),
                                                          name="quota slot leases")))
    api = None
    if args.config is not None:
        router.ledger.set_replicas(args.replicas, 0.0, args.replica_index)
        tasks.append(fatal_if_it_ends(asyncio.create_task(_watch(args.config, router),
                                                          name="config watch")))
        app = build_app(router)
    else:
        from kvfleet.router.cluster import ClusterSource

        api = _cluster_api()
        source = ClusterSource(api, router, None if args.all_namespaces else args.namespace,
                               name=args.name,
                               own_namespace=args.own_namespace or _own_namespace())
        tasks.append(source.start())
        app = build_app(router, ready=source.synced)
    # Keep-alive longer than clients' and load balancers' idle timeouts (60 s is common; httpx
    # drops its own after 5 s): a server that closes first races a client reusing the
    # connection, and that request fails with "server disconnected" (uvicorn's default is 5 s).
    # (`bounded`: a request's headers have a deadline, and connections a cap, which uvicorn
    # lacks.)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_config=None, access_log=False,
                                           timeout_keep_alive=75, http=bounded(**{
                                               key: value for key, value in (
                                                   ("max_connections", args.max_connections),
                                                   ("max_per_client",
                                                    args.max_connections_per_client),
                                                   ("send_seconds", args.send_timeout))
                                               if value is not None})))
    # What is loaded by now lives as long as the router: out of the cyclic collector's reach,
    # whose full pass over it stalled every request in flight 43-63 ms (bench/README, router
    # overhead). Objects made later (reloaded state, requests) are still collected; garbage of
    # the start-up goes first (frozen, a cycle would be kept for ever).
    gc.collect()
    gc.freeze()
    metrics = uvicorn.Server(uvicorn.Config(build_metrics_app(router), host=args.host,
                                            port=args.metrics_port, log_config=None,
                                            access_log=False))
    # (Whichever server installed its signal handlers last takes a SIGTERM first and, ending,
    # raises it again for the other: both end. The metrics server ending alone is fatal.)
    metrics_task = asyncio.create_task(metrics.serve(), name="metrics server")

    def metrics_ended(task: asyncio.Task[Any]) -> None:
        if not server.should_exit and not task.cancelled():
            # (Serving clients unseen by Prometheus would blind every Rollout's analysis.)
            exit_process("the metrics server ended while the router serves")

    metrics_task.add_done_callback(metrics_ended)
    try:
        await server.serve()
    finally:
        metrics.should_exit = True
        await asyncio.gather(metrics_task, return_exceptions=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await router.close()
        if api is not None:
            await api.close()
    return 0
