"""The local pod runner's emptyDir volumes: a folder per pod, seen through rewritten paths."""

from __future__ import annotations

from pathlib import Path

from kvfleet.devcluster.podenv import mounted, mounts, volume_folder
from kvfleet.devcluster.podstate import LocalPod


def test_a_mount_path_in_env_or_args_becomes_the_pods_volume_folder(tmp_path: Path) -> None:
    pod = LocalPod(uid="u", namespace="ns", name="p", node="n", ip="10.0.0.1",
                   folder=tmp_path / "ns_p", containers=[], init_containers=[])
    obj = {"spec": {"volumes": [{"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}},
                                {"name": "token", "secret": {"secretName": "s"}}]}}
    spec = {"volumeMounts": [{"name": "cache", "mountPath": "/var/cache/kvfleet/"},
                             {"name": "token", "mountPath": "/var/run/token"}]}
    where = mounts(pod, obj, spec)
    folder = volume_folder(pod, "cache")
    assert where == {"/var/cache/kvfleet": folder} and folder.is_dir()
    assert mounted("/var/cache/kvfleet", where) == str(folder)
    assert mounted("/var/cache/kvfleet/models/x.gguf", where) == f"{folder}/models/x.gguf"
    # Not under the mount (a shared prefix is not a parent), and volumes not emulated.
    assert mounted("/var/cache/kvfleet-other", where) == "/var/cache/kvfleet-other"
    assert mounted("/var/run/token", where) == "/var/run/token"
