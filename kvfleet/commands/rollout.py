"""`kvfleet rollout status|promote|abort|retry|pause|resume|undo POOL`: see and steer a pool's
rollout. Also a kubectl plugin: `kubectl kvfleet rollout status POOL` (the package installs
`kubectl-kvfleet`).

Requests are written into the pool's Rollout as the `kvfleet.io/rollout-request` annotation
(JSON with a fresh id; a promote names the step it was made for), never into its spec: Git
keeps owning the spec, and the operator acts on each id once, so a repeated command or a
second click never skips two steps. With no Rollout, `retry` writes the pool's
`kvfleet.io/retry-revision` annotation instead: the revision its artifactRef names, refused
since a Rollout rolled it back, may roll out again. `undo`, after a promotion and while the
revision that served before it is kept (`spec.keepPreviousSeconds`), sends all traffic back to
that revision and rolls the promoted one back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from typing import Any

from kvfleet.api.rollout import REQUEST_ANNOTATION, RequestAction, RolloutRequest
from kvfleet.api.servingpool import RETRY_ANNOTATION

ACTIONS = ("status", "promote", "abort", "retry", "pause", "resume", "undo")


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "rollout", help="see and steer a pool's rollout", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=ACTIONS)
    p.add_argument("pool", help="ServingPool name")
    p.add_argument("-n", "--namespace", default=None,
                   help="namespace (default: the kubeconfig context's, else default)")
    p.add_argument("--full", action="store_true",
                   help="promote: skip the remaining steps and analysis (to 100%%, then promote)")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text",
                   help="status: text or the Rollout's status as JSON")
    p.set_defaults(func=run)


def _namespace(given: str | None) -> str:
    if given:
        return given
    try:
        import kopf

        info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
        if info is not None and info.default_namespace:
            return str(info.default_namespace)
    except Exception:  # no kubeconfig: the login below says so
        pass
    return "default"


def run(args: argparse.Namespace) -> int:
    if args.full and args.action != "promote":
        print("kvfleet rollout: --full goes with promote", file=sys.stderr)
        return 2
    from kvfleet.kube.api import KubeError, login

    namespace = _namespace(args.namespace)

    async def main() -> int:
        api = login("kvfleet-rollout", "kvfleet rollout")
        try:
            return await _act(api, args, namespace)
        except KubeError as exc:
            print(f"kvfleet rollout: {exc}", file=sys.stderr)
            return 1
        finally:
            await api.close()

    return asyncio.run(main())


async def _act(api: Any, args: argparse.Namespace, namespace: str) -> int:
    rollouts = [r for r in await api.list("Rollout", namespace)
                if (r.get("spec", {}).get("poolRef") or {}).get("name") == args.pool]
    if not rollouts and args.action == "retry":
        return await _retry_ungoverned(api, args.pool, namespace)
    if not rollouts:
        print(f"kvfleet rollout: no Rollout in namespace {namespace!r} names pool "
              f"{args.pool!r} (spec.poolRef.name)", file=sys.stderr)
        return 1
    rollouts.sort(key=lambda r: (r["metadata"].get("creationTimestamp", ""),
                                 r["metadata"]["name"]))
    rollout = rollouts[0]
    name, status = rollout["metadata"]["name"], rollout.get("status") or {}
    if args.action == "status":
        if args.output == "json":
            print(json.dumps(status, indent=2, sort_keys=True))
        else:
            print(describe(name, rollout.get("spec") or {}, status))
        return 0
    action = RequestAction.PROMOTE_FULL if args.full else RequestAction(args.action)
    step = status.get("currentStep") if action == RequestAction.PROMOTE else None
    if action == RequestAction.PROMOTE and step is None:
        print(f"kvfleet rollout: Rollout {name} has no step to promote (phase "
              f"{status.get('phase', 'Idle')})", file=sys.stderr)
        return 1
    if action == RequestAction.UNDO and not status.get("previousRevision"):
        print(f"kvfleet rollout: Rollout {name} keeps no previous revision to undo to (phase "
              f"{status.get('phase', 'Idle')}; one is kept for spec.keepPreviousSeconds after "
              "a promotion)", file=sys.stderr)
        return 1
    request = RolloutRequest(action=action, id=uuid.uuid4().hex[:12], step=step)
    await api.patch("Rollout", namespace, name,
                    {"metadata": {"annotations": {REQUEST_ANNOTATION: request.to_annotation()}}})
    where = f" of step {step}" if step is not None else ""
    print(f"rollout/{name}: {action.value}{where} requested (id {request.id}); "
          f"`kvfleet rollout status {args.pool}` shows when it is applied")
    return 0


async def _retry_ungoverned(api: Any, pool: str, namespace: str) -> int:
    """With no Rollout, a retry is the pool's kvfleet.io/retry-revision annotation naming the
    refused revision its spec asks for, status.revision (the operator acts on each value
    once)."""
    obj = await api.get("ServingPool", namespace, pool)
    if obj is None:
        print(f"kvfleet rollout: no ServingPool {pool!r} and no Rollout for it in namespace "
              f"{namespace!r}", file=sys.stderr)
        return 1
    ref = obj["spec"]["artifactRef"]["name"]
    revision = (obj.get("status") or {}).get("revision")
    if not revision:
        print(f"kvfleet rollout: pool {pool!r} has no status.revision yet (its artifact "
              f"{ref!r} missing, or the operator has not reconciled it): nothing to retry",
              file=sys.stderr)
        return 1
    refused = [r["revision"] for r in (obj.get("status") or {}).get("refusedRevisions", [])]
    if revision not in refused:
        print(f"kvfleet rollout: pool {pool!r} does not refuse revision {revision[:12]} "
              f"(artifact {ref}); nothing to retry", file=sys.stderr)
        return 1
    value = f"{revision}@{uuid.uuid4().hex[:12]}"
    await api.patch("ServingPool", namespace, pool,
                    {"metadata": {"annotations": {RETRY_ANNOTATION: value}}})
    print(f"servingpool/{pool}: retry of revision {revision[:12]} ({ref}) requested; with no "
          "Rollout it rolls over ungoverned")
    return 0


def describe(name: str, spec: dict[str, Any], status: dict[str, Any]) -> str:
    """What a person reads first: where the rollout stands and the last evaluations."""
    steps = spec.get("steps") or []
    step = status.get("currentStep")
    lines = [
        f"Rollout:   {name} (pool {spec.get('poolRef', {}).get('name')})",
        f"Phase:     {status.get('phase', 'Idle')}"
        + (f" ({status['pauseReason']})" if status.get("pauseReason") else ""),
        f"Message:   {status.get('message', '')}",
        f"Stable:    {(status.get('stableRevision') or '-')[:12]}",
        f"Canary:    {(status.get('canaryRevision') or '-')[:12]} "
        f"({status.get('canaryArtifact', '-')})",
        *([f"Previous:  {status['previousRevision'][:12]} kept until "
           f"{status.get('previousKeptUntil')} (`kvfleet rollout undo` goes back to it)"]
          if status.get("previousRevision") else []),
        *([f"Changes:   {status['canaryChange']}"] if status.get("canaryChange") else []),
        "Step:      " + ("shadow" if step == -1 else f"{step + 1}/{len(steps)}"
                         if isinstance(step, int) else "-")
        + f", weight {status.get('currentWeight', 0)}%"
        + (f", shadow {status['shadowPercent']}%" if status.get("shadowPercent") else ""),
    ]
    evaluations = status.get("evaluations") or []
    if evaluations:
        lines.append("Evaluations (latest last):")
        for e in evaluations[-8:]:
            metrics = "; ".join(m.get("message") or f"{m['name']} {m['outcome']}"
                                for m in e.get("metrics", []))
            where = "shadow" if e["step"] == -1 else f"step {e['step'] + 1}"
            lines.append(f"  {where} #{e['index']} {e['windowStart']}..{e['windowEnd']} "
                         f"{e['outcome']}: {metrics}")
    return "\n".join(lines)
