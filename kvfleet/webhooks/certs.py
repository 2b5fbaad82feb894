"""A CA and a serving certificate for the webhook (the apiserver verifies it via caBundle).

For a cluster, cert-manager or the chart usually provides these; this module makes them for
`kvfleet webhook certs`, the e2e tests and local runs against a dev cluster. The X.509 work
is kvfleet.pki's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvfleet.pki import Usage, issue, make_ca, write_cert, write_cert_and_key


@dataclass(frozen=True)
class CertFiles:
    ca_cert: Path
    cert: Path
    key: Path


def make_serving_certs(
    directory: Path, hosts: list[str], days: int = 365, common_name: str = "kvfleet-webhook"
) -> CertFiles:
    """Write ca.crt, tls.crt, tls.key into `directory`; `hosts` are DNS names or IPs (SANs).

    Raises kvfleet.pki.PkiError when `hosts` is empty or `days` < 1.
    """
    ca = make_ca(f"{common_name}-ca", days=days)
    serving = issue(ca, common_name, Usage.SERVER, hosts=hosts, days=days)
    directory.mkdir(parents=True, exist_ok=True)
    files = CertFiles(directory / "ca.crt", directory / "tls.crt", directory / "tls.key")
    write_cert(files.ca_cert, ca.cert)
    write_cert_and_key(serving, files.cert, files.key)
    return files
