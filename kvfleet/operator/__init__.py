"""kvfleet.operator: the kopf operator that serves ModelArtifacts and ServingPools.

Pure core (no I/O):
  servingpool.reconcile(pool, artifact, observed) -> Plan    what to apply/delete, the status
  modelartifact.reconcile_artifact(artifact) -> status       manifest hash, Verified, Compatible
  builders.build_deployment/_service/_pdb                    the manifests
  revisions.parts_of(pool, manifest_hash, image)             a revision: artifact+image+settings
  waves.hold(pool, wave, rollouts, limit)                    an operator upgrade, a few at a time
  placement                                                  node selection, scheduling reasons
  podwatch                                                   which pod events concern a pool
  changes.Changes                                            which pool events need a reconcile
  drift.has_drifted(desired, observed)                       what counts as drift
Edges:
  runtime.Runtime     reads what exists, runs the reconcilers, carries out plans
  cache.Cache         what exists, as the watches delivered it (no GETs per reconcile)
  informer.Informer   list-and-watch of the child kinds and engine pods (re-lists after 410)
  handlers            kopf wiring (when reconciles run; pools as events, retried by the runtime)
  kube.KubeApi        the operator's apiserver client (server-side apply, status, events)
  metrics, rbac       Prometheus metrics; the ClusterRole as data

Errors: kube.KubeError (an apiserver request failed), runtime.InvalidObjectError (an object
the API models reject).
"""

from kvfleet.operator.builders import EngineOptions
from kvfleet.operator.modelartifact import reconcile_artifact
from kvfleet.operator.servingpool import Observed, Plan, reconcile

__all__ = ["EngineOptions", "Observed", "Plan", "reconcile", "reconcile_artifact"]
