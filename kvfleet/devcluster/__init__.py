"""A real Kubernetes control plane for development and tests.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK fake GPU nodes, built
from pinned Go modules (`toolchain`), plus local GPU nodes whose pods really run as local
processes (`podrunner`) and a real Prometheus (`prometheus`). `cluster.DevCluster` starts and
stops the whole thing; `kvfleet dev-cluster` and the e2e fixtures are thin layers over it.

This package lives inside `kvfleet` (not only under e2e/) so that the CLI, the e2e tests and
the benchmarks share one typed, mypy-checked implementation.
"""
