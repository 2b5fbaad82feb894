"""The environment of a local pod's process: the pod's env (values, downward API fields,
ConfigMap and Secret keys, $(VAR) expansion), in-cluster credentials for its service account,
and its volumes.

Volumes: an `emptyDir` is a folder of the pod's (`<pod folder>/volumes/<name>`, shared by its
containers, removed with the pod). A `secret` volume is such a folder holding one file per key
(or per `items` entry), kept in step with the Secret as a kubelet does (`sync_secret_volumes`,
every SECRET_SYNC_SECONDS: a changed key is replaced by a new file, so readers see a new inode;
a missing Secret fails the container's start unless the volume is `optional`). A local process
has no mount namespace, so a container sees a volume through its paths instead: an env value or
argument that is a volumeMount's `mountPath` (or lies under it) is rewritten to the volume's
folder. Other volume types are not emulated; their mounts are left as written.
"""

from __future__ import annotations

import base64
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import yaml

from kvfleet.api.quantity import QuantityError, whole_cpus
from kvfleet.devcluster.errors import DevClusterError, KubeApiError
from kvfleet.devcluster.kube import JsonObj, KubeClient
from kvfleet.devcluster.podstate import LocalPod, expand

TOKEN_SECONDS = 24 * 3600  # outlives any test session or dev-cluster day
# A kubelet refreshes mounted Secrets about every minute; the dev cluster every 10 s, still
# well after the API's watchers (a router) see a change, which is the race that matters.
SECRET_SYNC_SECONDS = 10.0


def resolve_program(program: str, project_root: Path) -> str:
    """`kvfleet` and `python` mean the project's virtualenv, as the image would provide them."""
    venv_bin = project_root / ".venv" / "bin"
    if program in ("python", "python3") or program == "kvfleet":
        candidate = venv_bin / program
        if candidate.exists():
            return str(candidate)
        return sys.executable if program != "kvfleet" else str(venv_bin / "kvfleet")
    return shutil.which(program) or program


def cpu_limit(spec: JsonObj) -> int | None:
    """Whole CPUs a container's `resources.limits.cpu` allows ("1500m" is 1, never below 1),
    or None without a CPU limit; DevClusterError (reported as the container's start error)
    for a value that is not a CPU quantity."""
    value = str(((spec.get("resources") or {}).get("limits") or {}).get("cpu") or "")
    if not value:
        return None
    try:
        return whole_cpus(value)
    except QuantityError as exc:
        raise DevClusterError(f"container {spec.get('name')}: resources.limits.cpu: {exc}"
                              ) from None


def pick_cpus(count: int, host: list[int], in_use: Counter[int]) -> frozenset[int]:
    """`count` of the host's CPUs, those the fewest running containers are pinned to first.

    The local stand-in for a kubelet's CPU limit: a real one sets a CFS quota in the
    container's cgroup; these processes share ours, so a limited container is pinned to as
    many CPUs instead, and the engine sizes its threads from either (`--cpu-threads`)."""
    ranked = sorted(host, key=lambda cpu: (in_use[cpu], cpu))
    return frozenset(ranked[:min(count, len(ranked))])


def volume_folder(pod: LocalPod, volume: str) -> Path:
    return pod.folder / "volumes" / volume


def mounts(pod: LocalPod, obj: JsonObj, spec: JsonObj) -> dict[str, Path]:
    """The container's mountPath -> folder, for its emptyDir and secret volumes (the folders
    exist)."""
    emulated = {v["name"] for v in obj["spec"].get("volumes") or []
                if "emptyDir" in v or "secret" in v}
    found: dict[str, Path] = {}
    for mount in spec.get("volumeMounts") or []:
        if mount["name"] in emulated:
            folder = volume_folder(pod, mount["name"])
            folder.mkdir(parents=True, exist_ok=True)
            found[mount["mountPath"].rstrip("/")] = folder
    return found


def sync_secret_volumes(api: KubeClient, pod: LocalPod, obj: JsonObj) -> None:
    """Each `secret` volume's folder holds the Secret's keys now; a key that changed is a new
    file (written beside, then renamed over the old). DevClusterError names a missing
    Secret or key (unless optional)."""
    for volume in obj["spec"].get("volumes") or []:
        source = volume.get("secret")
        if source is None:
            continue
        name, optional = source.get("secretName", ""), bool(source.get("optional"))
        try:
            data = api.get("Secret", name, pod.namespace).get("data") or {}
        except KubeApiError as exc:
            if exc.status == 404 and optional:
                continue
            raise DevClusterError(f"volume {volume['name']}: Secret {pod.namespace}/{name}: "
                                  f"{'not found' if exc.status == 404 else exc}") from None
        wanted = {i["key"]: i["path"] for i in source.get("items") or []} or \
            {key: key for key in data}
        folder = volume_folder(pod, volume["name"])
        folder.mkdir(parents=True, exist_ok=True)
        for key, path in wanted.items():
            if key not in data:
                if optional:
                    continue
                raise DevClusterError(f"volume {volume['name']}: Secret {pod.namespace}/{name} "
                                      f"has no key {key!r}")
            content, target = base64.b64decode(data[key]), folder / path
            if target.exists() and target.read_bytes() == content:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            fresh = target.with_name(f".{target.name}.new")
            fresh.write_bytes(content)
            fresh.chmod(0o400 if source.get("defaultMode") is None else
                        int(source["defaultMode"]) & 0o777)
            os.replace(fresh, target)


def mounted(value: str, where: dict[str, Path]) -> str:
    """`value` with a mount path (itself, or a path under it) replaced by its folder."""
    for path, folder in where.items():
        if value == path or value.startswith(path + "/"):
            return str(folder) + value[len(path):]
    return value


def container_env(
    api: KubeClient,
    pod: LocalPod,
    obj: JsonObj,
    spec: JsonObj,
    project_root: Path,
    extra_env: dict[str, str],
) -> dict[str, str]:
    # The harness's own environment plus the pod's: the processes are ours, on this machine.
    env = {**os.environ, **extra_env, "HOSTNAME": pod.name}
    venv_bin = str(project_root / ".venv" / "bin")
    env["PATH"] = f"{venv_bin}:{env.get('PATH', '/usr/bin:/bin')}"
    env["PYTHONPATH"] = str(project_root)
    env.pop("KUBECONFIG", None)
    if obj["spec"].get("automountServiceAccountToken", True):
        env.update(service_account_env(api, pod, obj))
    fields = {
        "status.podIP": pod.ip,
        "status.hostIP": "127.0.0.1",
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "metadata.uid": pod.uid,
        "spec.nodeName": pod.node,
        "spec.serviceAccountName": obj["spec"].get("serviceAccountName", "default"),
    }
    for item in spec.get("env", []):
        name = item["name"]
        if "value" in item:
            env[name] = expand(str(item["value"]), env)
        elif "fieldRef" in item.get("valueFrom", {}):
            env[name] = fields.get(item["valueFrom"]["fieldRef"]["fieldPath"], "")
        elif ref := item.get("valueFrom", {}).get("configMapKeyRef"):
            cm = api.get("ConfigMap", ref["name"], pod.namespace)
            env[name] = cm.get("data", {}).get(ref["key"], "")
        elif ref := item.get("valueFrom", {}).get("secretKeyRef"):
            secret = api.get("Secret", ref["name"], pod.namespace)
            env[name] = base64.b64decode(secret.get("data", {}).get(ref["key"], "")).decode()
    where = mounts(pod, obj, spec)
    for item in spec.get("env", []):
        env[item["name"]] = mounted(env[item["name"]], where)
    return env


def service_account_env(api: KubeClient, pod: LocalPod, obj: JsonObj) -> dict[str, str]:
    """In-cluster credentials: a token of the pod's service account, bound to the pod.

    There is no /var/run/secrets mount, so the token reaches the process as a kubeconfig
    ($KUBECONFIG, which kopf and the kubernetes client read) plus the usual
    KUBERNETES_SERVICE_HOST/PORT; the process then has exactly its RBAC permissions.
    """
    account = obj["spec"].get("serviceAccountName") or "default"
    review = api.request(
        "POST",
        f"/api/v1/namespaces/{pod.namespace}/serviceaccounts/{account}/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": TOKEN_SECONDS,
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": pod.name,
                    "uid": pod.uid,
                },
            },
        },
    )
    server = api.credentials.server
    cluster: JsonObj = {"server": server}
    if api.credentials.tls.ca:
        cluster["certificate-authority-data"] = base64.b64encode(api.credentials.tls.ca).decode()
    kubeconfig = pod.folder / "serviceaccount.kubeconfig"
    kubeconfig.touch(mode=0o600)
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "in-cluster",
        "clusters": [{"name": "in-cluster", "cluster": cluster}],
        "users": [{"name": account, "user": {"token": review["status"]["token"]}}],
        "contexts": [{"name": "in-cluster", "context": {
            "cluster": "in-cluster", "user": account, "namespace": pod.namespace}}],
    }))
    kubeconfig.chmod(0o600)
    host, _, port = server.removeprefix("https://").rpartition(":")
    return {
        "KUBECONFIG": str(kubeconfig),
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": port,
    }
