"""The local pod runner's emptyDir and secret volumes: a folder per pod, seen through rewritten
paths; a secret volume's files follow its Secret."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from kvfleet.devcluster.errors import DevClusterError, KubeApiError
from kvfleet.devcluster.podenv import mounted, mounts, sync_secret_volumes, volume_folder
from kvfleet.devcluster.podstate import LocalPod


def test_a_mount_path_in_env_or_args_becomes_the_pods_volume_folder(tmp_path: Path) -> None:
    pod = LocalPod(uid="u", namespace="ns", name="p", node="n", ip="10.0.0.1",
                   folder=tmp_path / "ns_p", containers=[], init_containers=[])
    obj = {"spec": {"volumes": [{"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}},
                                {"name": "token", "secret": {"secretName": "s"}},
                                {"name": "data", "persistentVolumeClaim": {"claimName": "c"}}]}}
    spec = {"volumeMounts": [{"name": "cache", "mountPath": "/var/cache/kvfleet/"},
                             {"name": "token", "mountPath": "/var/run/token"},
                             {"name": "data", "mountPath": "/data"}]}
    where = mounts(pod, obj, spec)
    folder = volume_folder(pod, "cache")
    assert where == {"/var/cache/kvfleet": folder, "/var/run/token": volume_folder(pod, "token")}
    assert folder.is_dir()
    assert mounted("/var/cache/kvfleet", where) == str(folder)
    assert mounted("/var/cache/kvfleet/models/x.gguf", where) == f"{folder}/models/x.gguf"
    # Not under the mount (a shared prefix is not a parent), and volumes not emulated.
    assert mounted("/var/cache/kvfleet-other", where) == "/var/cache/kvfleet-other"
    assert mounted("/data/x", where) == "/data/x"


class Secrets:
    """The one call sync_secret_volumes makes of the API."""

    def __init__(self, data: dict[str, dict[str, str]]) -> None:
        self.data = data

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        assert kind == "Secret"
        if name not in self.data:
            raise KubeApiError("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}", 404,
                               "NotFound", f'secrets "{name}" not found')
        return {"data": {k: base64.b64encode(v.encode()).decode()
                         for k, v in self.data[name].items()}}


def test_a_secret_volume_holds_its_keys_and_follows_the_secret(tmp_path: Path) -> None:
    pod = LocalPod(uid="u", namespace="ns", name="p", node="n", ip="10.0.0.1",
                   folder=tmp_path / "ns_p", containers=[], init_containers=[])
    obj = {"spec": {"volumes": [{"name": "token", "secret": {"secretName": "tok"}},
                                {"name": "only", "secret": {"secretName": "tok", "items": [
                                    {"key": "token", "path": "sub/t"}]}}]}}
    api = Secrets({"tok": {"token": "first-0123456789abcdef", "other": "x"}})
    sync_secret_volumes(api, pod, obj)  # type: ignore[arg-type]
    token = volume_folder(pod, "token") / "token"
    assert token.read_text() == "first-0123456789abcdef"
    assert (volume_folder(pod, "token") / "other").read_text() == "x"
    assert (volume_folder(pod, "only") / "sub" / "t").read_text() == "first-0123456789abcdef"
    assert not (volume_folder(pod, "only") / "other").exists()
    inode = token.stat().st_ino
    sync_secret_volumes(api, pod, obj)  # type: ignore[arg-type]
    assert token.stat().st_ino == inode  # unchanged: not rewritten
    api.data["tok"]["token"] = "second-0123456789abcdef"
    sync_secret_volumes(api, pod, obj)  # type: ignore[arg-type]
    assert token.read_text() == "second-0123456789abcdef" and token.stat().st_ino != inode


def test_a_missing_secret_or_key_names_it_unless_optional(tmp_path: Path) -> None:
    pod = LocalPod(uid="u", namespace="ns", name="p", node="n", ip="10.0.0.1",
                   folder=tmp_path / "ns_p", containers=[], init_containers=[])
    api = Secrets({"tok": {"token": "t"}})
    for source, error in (({"secretName": "gone"}, "Secret ns/gone: not found"),
                          ({"secretName": "tok", "items": [{"key": "nope", "path": "n"}]},
                           "has no key 'nope'")):
        obj = {"spec": {"volumes": [{"name": "v", "secret": source}]}}
        with pytest.raises(DevClusterError, match=error):
            sync_secret_volumes(api, pod, obj)  # type: ignore[arg-type]
        optional = {"spec": {"volumes": [{"name": "v", "secret": {**source, "optional": True}}]}}
        sync_secret_volumes(api, pod, optional)  # type: ignore[arg-type]
