"""Kubernetes probes, run the way a kubelet runs them: one attempt, success or failure."""

from __future__ import annotations

import socket
import subprocess

import httpx

from kvfleet.devcluster.errors import DevClusterError
from kvfleet.devcluster.kube import JsonObj
from kvfleet.devcluster.podstate import LocalPod


def run_probe(http_client: httpx.Client, pod: LocalPod, container: JsonObj, probe: JsonObj) -> bool:
    """One attempt of a Kubernetes probe (httpGet, tcpSocket or exec) against the pod."""
    timeout = float(probe.get("timeoutSeconds", 1))
    if http := probe.get("httpGet"):
        host = http.get("host") or pod.ip
        port = container_port(container, http["port"])
        scheme = str(http.get("scheme", "HTTP")).lower()
        try:
            resp = http_client.get(
                f"{scheme}://{host}:{port}{http.get('path', '/')}", timeout=timeout
            )
        except httpx.HTTPError:
            return False
        return 200 <= resp.status_code < 400
    if tcp := probe.get("tcpSocket"):
        return tcp_connects(tcp.get("host") or pod.ip, container_port(container, tcp["port"]),
                            timeout)
    if exec_ := probe.get("exec"):
        try:
            done = subprocess.run(
                exec_["command"],
                timeout=timeout,
                capture_output=True,
                check=False,
                cwd=pod.folder,
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0
    return True


def tcp_connects(host: str, port: int, timeout: float = 1.0) -> bool:
    """A tcpSocket probe: does something accept connections there?"""
    try:
        with socket.create_connection((host, port), timeout):
            return True
    except OSError:
        return False


def container_port(container: JsonObj, port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise DevClusterError(f"container {container['name']}: probe names unknown port {port!r}")
