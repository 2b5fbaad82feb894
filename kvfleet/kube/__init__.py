"""The control plane's Kubernetes client and informers (shared by the operator and the
router; imports nothing else of kvfleet)."""
