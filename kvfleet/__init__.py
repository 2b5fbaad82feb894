"""kvfleet: a Kubernetes operator and control plane for LLM serving fleets, with its own engine."""

__version__ = "0.1.0"
