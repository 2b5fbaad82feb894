"""`kvfleet dev-cluster build|up|demo|down|status`: a real control plane on this machine.

`up` runs in the foreground (Ctrl-C or `down` stops it and removes everything) and records its
pid and kubeconfig in a state file so `down` and `status` from another shell can find it.
`demo` does the same with the operator, the router, three revisions of the embedded model and
two rollouts to watch (see `kvfleet.devcluster.demo`); it stays up afterwards until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STATE_ENV = "KVFLEET_DEVCLUSTER_STATE"


def state_path() -> Path:
    env = os.environ.get(STATE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "kvfleet" / "devcluster.json"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "dev-cluster",
        help="run a local Kubernetes control plane with fake GPU nodes",
        description=__doc__,
    )
    sub = parser.add_subparsers(dest="dev_cluster_command", metavar="ACTION", required=True)
    build = sub.add_parser("build", help="build (or find cached) the pinned binaries")
    build.set_defaults(func=_build)
    up = sub.add_parser("up", help="start the cluster and keep it running until Ctrl-C")
    up.add_argument("--h100-nodes", type=int, default=2, help="fake 8x H100-80GB nodes")
    up.add_argument("--a100-nodes", type=int, default=2, help="fake 8x A100-40GB nodes")
    up.add_argument("--l4-nodes", type=int, default=2, help="fake 1x L4 nodes")
    up.add_argument("--local-nodes", type=int, default=1, help="nodes whose pods really run")
    up.add_argument("--no-prometheus", action="store_true", help="do not start Prometheus")
    up.set_defaults(func=_up)
    demo = sub.add_parser("demo", help="a cluster with the operator, router and two rollouts "
                          "to watch (a good revision promoted, a slow one rolled back)")
    demo.set_defaults(func=_demo)
    down = sub.add_parser("down", help="stop the cluster started by `up` or `demo`")
    down.set_defaults(func=_down)
    status = sub.add_parser("status", help="say whether a cluster is up and where")
    status.set_defaults(func=_status)


def _build(args: argparse.Namespace) -> int:
    from kvfleet.devcluster import toolchain

    return toolchain.main([])


def _up(args: argparse.Namespace) -> int:
    from kvfleet.devcluster import fleet
    from kvfleet.devcluster.cluster import ClusterOptions

    groups = (
        fleet.NodeGroup(fleet.H100_80GB, args.h100_nodes, 8),
        fleet.NodeGroup(fleet.A100_40GB, args.a100_nodes, 8),
        fleet.NodeGroup(fleet.L4, args.l4_nodes, 1),
    )
    options = ClusterOptions(
        node_groups=groups, local_nodes=args.local_nodes, prometheus=not args.no_prometheus
    )
    return _serve(options, None)


def _demo(args: argparse.Namespace) -> int:
    from kvfleet.devcluster import fleet
    from kvfleet.devcluster.cluster import ClusterOptions

    # No fake L4s: every L4 pod lands on the local node, whose GPUs really run engines.
    options = ClusterOptions(node_groups=(fleet.NodeGroup(fleet.H100_80GB, 1, 8),))
    return _serve(options, _run_demo)


def _run_demo(cluster: Any, stop: threading.Event) -> None:
    from kvfleet.devcluster.demo import run_demo
    from kvfleet.devcluster.processes import ManagedProcess

    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    if cluster.prometheus is not None:
        env["KVFLEET_PROMETHEUS_URL"] = cluster.prometheus.url
    log = cluster.workdir / "operator.log"

    def start_operator() -> None:
        print(f"Operator starting (log: {log})")
        cluster.processes.append(ManagedProcess(
            "operator", [sys.executable, "-m", "kvfleet", "operator", "--all-namespaces",
                         "--standalone", "--metrics-port", "0"], log, env=env))

    run_demo(cluster.api, cluster.kubeconfig,
             cluster.prometheus.url if cluster.prometheus else None,
             cluster.local_node_names[0], start_operator)
    print("\nDone. The cluster stays up to look around; Ctrl-C stops it all.", flush=True)


def _serve(options: Any, body: Callable[[Any, threading.Event], None] | None) -> int:
    from kvfleet.devcluster import toolchain
    from kvfleet.devcluster.cluster import DevCluster
    from kvfleet.devcluster.errors import DevClusterError

    if _read_state() is not None:
        print(f"a dev cluster is already up (see {state_path()}); run `kvfleet dev-cluster down`")
        return 1
    stop = threading.Event()
    # SIGTERM (from `down`) and Ctrl-C both end the wait below; teardown happens in `finally`.
    # SIGINT is set explicitly: a shell starts background jobs with it ignored.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    cluster = DevCluster(options)
    try:
        try:
            cluster.start()
        except (DevClusterError, TimeoutError) as exc:
            print(f"dev-cluster: {exc}", file=sys.stderr)
            return 1
        state = {
            "pid": os.getpid(),
            "kubeconfig": str(cluster.kubeconfig),
            "server": cluster.server,
            "prometheus": cluster.prometheus.url if cluster.prometheus else None,
            "workdir": str(cluster.workdir),
        }
        state_path().parent.mkdir(parents=True, exist_ok=True)
        state_path().write_text(json.dumps(state, indent=2))
        print(f"dev cluster up in {cluster.startup_seconds:.1f}s")
        print(f"  export KUBECONFIG={cluster.kubeconfig}")
        # The kubectl built with the control plane (same version), and `kubectl kvfleet`.
        kubectl = toolchain.locate()["kubectl"].parent
        print(f"  export PATH={kubectl}:{Path(sys.executable).parent}:$PATH")
        if cluster.prometheus:
            print(f"  export KVFLEET_PROMETHEUS_URL={cluster.prometheus.url}")
        print("Ctrl-C or `kvfleet dev-cluster down` stops it.", flush=True)
        if body is not None:
            worker = threading.Thread(target=_guarded, args=(body, cluster, stop), daemon=True)
            worker.start()
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        state_path().unlink(missing_ok=True)
        cluster.stop()
        print("dev cluster stopped")
    return 0


def _guarded(body: Callable[[Any, threading.Event], None], cluster: Any,
             stop: threading.Event) -> None:
    try:
        body(cluster, stop)
    except Exception as exc:  # say it; the cluster stays up to look at until Ctrl-C
        if not stop.is_set():
            print(f"dev-cluster: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _read_state() -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads(state_path().read_text())
    except (OSError, ValueError):
        return None
    try:
        os.kill(int(state["pid"]), 0)
    except (ProcessLookupError, KeyError, ValueError):
        state_path().unlink(missing_ok=True)  # left by a process that is gone
        return None
    return state


def _down(args: argparse.Namespace) -> int:
    state = _read_state()
    if state is None:
        print("no dev cluster is up")
        return 0
    pid = int(state["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print("dev cluster stopped")
            return 0
        time.sleep(0.2)
    print(f"dev cluster (pid {pid}) did not stop within 60s", file=sys.stderr)
    return 1


def _status(args: argparse.Namespace) -> int:
    from kvfleet.devcluster.kube import connect

    state = _read_state()
    if state is None:
        print("no dev cluster is up")
        return 1
    api = connect(Path(state["kubeconfig"]), timeout=5)
    try:
        ready = api.get_raw("/readyz").status_code == 200
        nodes = api.list("Node")
    finally:
        api.close()
    print(f"dev cluster pid {state['pid']}: apiserver {'ready' if ready else 'NOT ready'}")
    print(f"  export KUBECONFIG={state['kubeconfig']}")
    print(f"  {len(nodes)} nodes; prometheus: {state.get('prometheus') or 'off'}")
    return 0 if ready else 1
