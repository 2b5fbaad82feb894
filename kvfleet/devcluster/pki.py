"""A throwaway PKI for one dev cluster: a CA, the API server's serving certificate, client
certificates per component, and the service-account signing key. The X.509 work is
kvfleet.pki's; this module decides the names, file layout and kubeconfig."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from kvfleet.pki import (
    CertAndKey,
    Usage,
    issue,
    make_ca,
    new_key,
    write_cert_and_key,
    write_private_key,
)

# In-cluster names of the API server; the service IP is the first of the service CIDR.
APISERVER_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterPki:
    ca: CertPair
    apiserver: CertPair
    admin: CertPair  # system:masters
    controller_manager: CertPair
    scheduler: CertPair
    service_account_key: Path  # private; the API server verifies with the same file


def create_pki(folder: Path, service_ip: str, extra_ips: tuple[str, ...] = ()) -> ClusterPki:
    """Write a fresh CA and every certificate the control plane needs into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)

    def write(stem: str, pair: CertAndKey) -> CertPair:
        files = CertPair(folder / f"{stem}.crt", folder / f"{stem}.key")
        write_cert_and_key(pair, files.cert, files.key)
        return files

    ca = make_ca("kvfleet-dev-ca")
    apiserver_hosts = (*APISERVER_DNS_NAMES, "127.0.0.1", service_ip, *extra_ips)
    sa_path = folder / "service-account.key"
    # SEC1 ("EC PRIVATE KEY") rather than the PKCS#8 of the certificate keys: the API server
    # reads this one file both to sign and to verify tokens, and this is the form the e2e
    # control plane has been started with.
    write_private_key(sa_path, new_key(), serialization.PrivateFormat.TraditionalOpenSSL)
    return ClusterPki(
        ca=write("ca", ca),
        apiserver=write(
            "apiserver", issue(ca, "kube-apiserver", Usage.SERVER, hosts=apiserver_hosts)
        ),
        admin=write(
            "admin",
            issue(ca, "kubernetes-admin", Usage.CLIENT, organization="system:masters"),
        ),
        controller_manager=write(
            "controller-manager", issue(ca, "system:kube-controller-manager", Usage.CLIENT)
        ),
        scheduler=write("scheduler", issue(ca, "system:kube-scheduler", Usage.CLIENT)),
        service_account_key=sa_path,
    )


def kubeconfig_yaml(server: str, ca: Path, client: CertPair, user: str) -> str:
    """A kubeconfig that points at `server` and authenticates with a client certificate."""
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: kvfleet-dev\n  cluster:\n    server: {server}\n"
        f"    certificate-authority: {ca}\n"
        f"users:\n- name: {user}\n  user:\n"
        f"    client-certificate: {client.cert}\n    client-key: {client.key}\n"
        f"contexts:\n- name: kvfleet-dev\n  context:\n    cluster: kvfleet-dev\n    user: {user}\n"
        "current-context: kvfleet-dev\n"
    )
