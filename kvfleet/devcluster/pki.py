"""A throwaway PKI for one dev cluster: a CA, the API server's serving certificate, client
certificates per component, and the service-account signing key. Pure apart from writing PEM
files; ECDSA P-256 keys because they generate in microseconds."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

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


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def _write(pair: CertPair, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> CertPair:
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pair.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    pair.key.chmod(0o600)
    return pair


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, days: int
) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
    )


def create_pki(folder: Path, service_ip: str, extra_ips: tuple[str, ...] = ()) -> ClusterPki:
    """Write a fresh CA and every certificate the control plane needs into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = _name("kvfleet-dev-ca")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key, 365)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca = _write(CertPair(folder / "ca.crt", folder / "ca.key"), ca_cert, ca_key)

    def issue(stem: str, subject: x509.Name, server: bool) -> CertPair:
        key = _key()
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = _builder(subject, ca_name, key, 365).add_extension(
            x509.ExtendedKeyUsage([usage]), critical=False
        )
        if server:
            ips = ("127.0.0.1", service_ip, *extra_ips)
            sans: list[x509.GeneralName] = [x509.DNSName(n) for n in APISERVER_DNS_NAMES]
            sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return _write(CertPair(folder / f"{stem}.crt", folder / f"{stem}.key"), cert, key)

    sa_key = _key()
    sa_path = folder / "service-account.key"
    sa_path.write_bytes(
        sa_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    sa_path.chmod(0o600)
    return ClusterPki(
        ca=ca,
        apiserver=issue("apiserver", _name("kube-apiserver"), server=True),
        admin=issue("admin", _name("kubernetes-admin", "system:masters"), server=False),
        controller_manager=issue(
            "controller-manager", _name("system:kube-controller-manager"), server=False
        ),
        scheduler=issue("scheduler", _name("system:kube-scheduler"), server=False),
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
