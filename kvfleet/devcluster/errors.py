"""Errors of the development cluster harness.

DevClusterError
├── ToolsMissingError     a pinned binary is not built (or cannot be built)
├── StartupError          a component did not start or become ready in time
└── KubeApiError          the API server answered a request with an error status
"""

from __future__ import annotations


class DevClusterError(Exception):
    """Base of every error raised by kvfleet.devcluster."""


class ToolsMissingError(DevClusterError):
    """A control-plane binary is not in the cache; the message says how to build it."""


class StartupError(DevClusterError):
    """A component exited or did not become ready; the message names it and its log file."""


class KubeApiError(DevClusterError):
    """A Kubernetes API request failed; carries the HTTP status and the API's reason."""

    def __init__(self, method: str, path: str, status: int, reason: str, message: str) -> None:
        super().__init__(f"{method} {path}: {status} {reason}: {message}")
        self.status = status
        self.reason = reason
