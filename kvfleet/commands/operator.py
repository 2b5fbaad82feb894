"""`kvfleet operator`: run the kopf operator that reconciles ModelArtifacts, ServingPools and
their Rollouts.

Flags follow `kopf run`: `--namespace` (repeatable, globs allowed) or `--all-namespaces`,
`--standalone` (no peering), `--priority`, `--peering`, `--liveness`; plus the Prometheus
metrics port, the drift-check interval, the engine image the pods run and the Prometheus the
Rollout analysis queries (`--prometheus-url`, or $KVFLEET_PROMETHEUS_URL).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import yaml

from kvfleet import __version__


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "operator",
        help="run the operator (ModelArtifact, ServingPool, Rollout)",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="serve this namespace (repeatable; globs like 'team-*' allowed)",
    )
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="serve the whole cluster (the default without --namespace)",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="do not coordinate with other operator replicas (no kopf peering)",
    )
    p.add_argument(
        "--leader-elect",
        action="store_true",
        help="run only while holding the Lease kvfleet-operator in --leader-election-namespace "
        "(replicas stand by meanwhile; a leader that cannot renew exits)",
    )
    p.add_argument(
        "--leader-election-namespace",
        default=os.environ.get("POD_NAMESPACE", "kvfleet-system"),
        help="namespace of the leader Lease (default $POD_NAMESPACE)",
    )
    p.add_argument("--priority", type=int, default=0, help="kopf peering priority")
    p.add_argument("--peering", default=None, help="kopf peering object name")
    p.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        help="port of the Prometheus /metrics endpoint (0: none)",
    )
    p.add_argument("--metrics-address", default="127.0.0.1",
                   help="address of /metrics (in a pod: its IP, as the chart passes $(POD_IP))")
    p.add_argument(
        "--drift-interval",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how often every pool is re-read and drift restored",
    )
    p.add_argument(
        "--autoscale-interval",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="how often the pools with spec.autoscaling are measured (one Prometheus query "
        "for all of them) and their replicas decided",
    )
    p.add_argument(
        "--max-concurrent-reconciles",
        type=int,
        default=4,
        metavar="N",
        help="reconciles running at once; a burst of changes queues beyond that",
    )
    p.add_argument(
        "--max-concurrent-rollouts",
        type=int,
        default=2,
        metavar="N",
        help="pools rolling to a new --engine-image at once (the fleet wave an operator "
        "upgrade starts); the first rollback stops the wave",
    )
    p.add_argument(
        "--engine-image",
        default=f"ghcr.io/kvfleet/kvfleet:{__version__}",
        help="image of the engine containers",
    )
    p.add_argument(
        "--router-namespace",
        metavar="NS",
        help="namespace of the kvfleet router pods, the only pods (with Prometheus') engine "
        "pods admit (default: each pool's own namespace)",
    )
    p.add_argument(
        "--prometheus-namespace",
        metavar="NS",
        help="namespace of the Prometheus pods that scrape engines (default: pods named "
        "prometheus in any namespace)",
    )
    p.add_argument(
        "--engine-tls",
        action="store_true",
        help="engines serve HTTPS with a certificate the operator issues per pool (in its "
        "router-token Secret, renewed 30 days before its end) and the router pins: the router "
        "token and prompts never cross the network in the clear",
    )
    p.add_argument(
        "--prometheus-url",
        default=os.environ.get("KVFLEET_PROMETHEUS_URL"),
        metavar="URL",
        help="Prometheus the Rollout analysis and autoscaling query (without one, every "
        "analysis is an error and rollouts pause, and autoscaled pools hold their count; "
        "default $KVFLEET_PROMETHEUS_URL)",
    )
    p.add_argument("--matrix", default=None, help="compatibility matrix file (default: bundled)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument(
        "--print-rbac",
        action="store_true",
        help="print the operator's ServiceAccount/ClusterRole/Binding YAML and exit",
    )
    p.add_argument(
        "--rbac-namespace",
        default="kvfleet-system",
        help="namespace of the ServiceAccount in --print-rbac",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import kopf
    from prometheus_client import start_http_server

    from kvfleet.compat import MatrixError, default_matrix, load_matrix
    from kvfleet.operator import gcsettings
    from kvfleet.operator.builders import EngineOptions
    from kvfleet.operator.handlers import OperatorConfig, build_registry
    from kvfleet.operator.rbac import install_rbac

    if args.print_rbac:
        yaml.safe_dump_all(install_rbac(args.rbac_namespace), sys.stdout, sort_keys=False)
        return 0
    if args.drift_interval <= 0 or args.autoscale_interval <= 0 or \
            args.max_concurrent_reconciles < 1 or args.max_concurrent_rollouts < 1:
        print(
            "kvfleet operator: --drift-interval and --autoscale-interval must be > 0 seconds "
            "and --max-concurrent-reconciles and --max-concurrent-rollouts >= 1",
            file=sys.stderr,
        )
        return 2
    try:
        matrix = load_matrix(Path(args.matrix)) if args.matrix else default_matrix()
    except MatrixError as exc:
        print(f"kvfleet operator: {exc}", file=sys.stderr)
        return 2
    # Every line about an object names it ([namespace/name]); handler ids name the kind and
    # the cause (servingpool-update), not the closure (build_registry.<locals>.pool_changed).
    kopf.configure(verbose=args.verbose, quiet=args.quiet, log_prefix=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_address)
    config = OperatorConfig(
        matrix=matrix,
        options=EngineOptions(image=args.engine_image, router_namespace=args.router_namespace,
                              prometheus_namespace=args.prometheus_namespace,
                              tls=args.engine_tls),
        drift_interval_seconds=args.drift_interval,
        autoscale_interval_seconds=args.autoscale_interval,
        max_concurrent_reconciles=args.max_concurrent_reconciles,
        max_concurrent_rollouts=args.max_concurrent_rollouts,
        prometheus_url=args.prometheus_url,
    )
    gcsettings.tune()
    leadership = None
    if args.leader_elect:
        from kvfleet.operator.leadership import Leadership

        leadership = Leadership(args.leader_election_namespace)
        leadership.acquire(args.liveness)
    try:
        kopf.run(
            registry=build_registry(config),
            standalone=args.standalone,
            priority=args.priority,
            peering_name=args.peering,
            liveness_endpoint=args.liveness,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
        )
    finally:
        if leadership is not None:
            leadership.release()
    return 0
