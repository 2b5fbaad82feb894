"""Kubeconfig files for tests of the clients' credentials."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def write_kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any],
                     server: str = "https://127.0.0.1:6443") -> Path:
    """One context `c`: cluster `k` at `server` (plus `cluster`'s fields), user `u`."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": server, **cluster}}],
        "users": [{"name": "u", "user": user}],
    }))  # fmt: skip
    return path
