"""A real Prometheus server (built from its Go module by the toolchain: Debian's package lacks
kubernetes_sd_configs) that discovers pods through the dev cluster's API server and scrapes the
ones annotated `prometheus.io/scrape: "true"`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import yaml

from kvfleet.devcluster.pki import CertPair
from kvfleet.devcluster.processes import ManagedProcess

SCRAPE_INTERVAL_S = 2


def build_config(api_server: str, ca: Path, client: CertPair) -> dict[str, Any]:
    """Pod discovery with the usual prometheus.io/* annotations.

    Only loopback pod IPs are kept: those are the local runner's real processes. KWOK's fake
    pods have no process behind them, and scraping outside loopback is never wanted here.
    """
    tls = {"ca_file": str(ca), "cert_file": str(client.cert), "key_file": str(client.key)}
    annotation = "__meta_kubernetes_pod_annotation_prometheus_io_"
    return {
        "global": {
            "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
            "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
        },
        "scrape_configs": [
            {
                "job_name": "kubernetes-pods",
                # A pod's own labels win over the target's: the router's series carry the
                # ServingPool's `namespace`, not the router pod's (kvfleet.router.metrics).
                "honor_labels": True,
                # Accept plain-text exposition served without the Prometheus content type.
                "fallback_scrape_protocol": "PrometheusText0.0.4",
                "kubernetes_sd_configs": [
                    {"role": "pod", "api_server": api_server, "tls_config": tls}
                ],
                # Engines with TLS (the operator's --engine-tls) serve metrics over HTTPS with
                # a certificate only the router checks (it pins it).
                "tls_config": {"insecure_skip_verify": True},
                "relabel_configs": [
                    {"source_labels": [f"{annotation}scrape"], "action": "keep", "regex": "true"},
                    {
                        "source_labels": ["__meta_kubernetes_pod_ip"],
                        "action": "keep",
                        "regex": r"127\..*",
                    },
                    {
                        "source_labels": [f"{annotation}scheme"],
                        "action": "replace",
                        "target_label": "__scheme__",
                        "regex": "(https?)",
                    },
                    {
                        "source_labels": [f"{annotation}path"],
                        "action": "replace",
                        "target_label": "__metrics_path__",
                        "regex": "(.+)",
                    },
                    {
                        "source_labels": ["__meta_kubernetes_pod_ip", f"{annotation}port"],
                        "action": "replace",
                        "regex": "(.+);(\\d+)",
                        "replacement": "$1:$2",
                        "target_label": "__address__",
                    },
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                    {"action": "labelmap", "regex": "__meta_kubernetes_pod_label_(.+)"},
                ],
            }
        ],
    }


PROMETHEUS_URL_ENV = "KVFLEET_PROMETHEUS_URL"


class PrometheusClient:
    """Queries one Prometheus server over its HTTP API."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def active_targets(self) -> list[dict[str, Any]]:
        resp = httpx.get(f"{self.url}/api/v1/targets", params={"state": "active"}, timeout=5)
        resp.raise_for_status()
        targets: list[dict[str, Any]] = resp.json()["data"]["activeTargets"]
        return targets

    def query(self, promql: str) -> list[dict[str, Any]]:
        resp = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        resp.raise_for_status()
        result: list[dict[str, Any]] = resp.json()["data"]["result"]
        return result


class Prometheus(PrometheusClient):
    """The server process the harness runs, plus the query client."""

    def __init__(
        self, binary: Path, workdir: Path, port: int, api_server: str, ca: Path, client: CertPair
    ) -> None:
        super().__init__(f"http://127.0.0.1:{port}")
        workdir.mkdir(parents=True, exist_ok=True)
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(build_config(api_server, ca, client)))
        self.process = ManagedProcess(
            "prometheus",
            [
                str(binary),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--web.enable-lifecycle",
                "--log.level=warn",
            ],
            workdir / "prometheus.log",
        )

    def wait_ready(self, timeout: float) -> None:
        self.process.wait_ready(
            lambda: httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200, timeout
        )

    def stop(self) -> None:
        self.process.stop()

    def restart(self, timeout: float = 60) -> ManagedProcess:
        """Start it again after `stop` (an outage in a test), on the same data folder; the
        new process (whoever tracks the old one must track this one instead)."""
        old = self.process
        old.stop()
        self.process = ManagedProcess(old.name, old.argv, old.log_path)
        self.wait_ready(timeout)
        return self.process
