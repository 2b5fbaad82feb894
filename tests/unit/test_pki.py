"""kvfleet.pki: leaves chain to their CA, SANs split IP vs DNS, usages, key files 0600."""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import (
    ClientVerifier,
    Criticality,
    ExtensionPolicy,
    PolicyBuilder,
    Store,
    VerificationError,
)

import kvfleet.pki
from kvfleet.devcluster.pki import create_pki
from kvfleet.pki import PkiError, Usage, issue, make_ca, new_key, write_cert_and_key
from kvfleet.webhooks.certs import make_serving_certs


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _policy(ca: x509.Certificate) -> PolicyBuilder:
    return PolicyBuilder().store(Store([ca]))


def _client_verifier(ca: x509.Certificate) -> ClientVerifier:
    """The web PKI profile, but a client certificate may go without SANs: Kubernetes names the
    user in the subject (CN, O), and its client certificates carry none."""
    ee = ExtensionPolicy.webpki_defaults_ee().may_be_present(
        x509.SubjectAlternativeName, Criticality.AGNOSTIC, None
    )
    return (
        _policy(ca)
        .extension_policies(ca_policy=ExtensionPolicy.webpki_defaults_ca(), ee_policy=ee)
        .build_client_verifier()
    )


def test_server_leaf_verifies_against_its_ca_for_each_host() -> None:
    ca = make_ca("test-ca")
    leaf = issue(ca, "svc", Usage.SERVER, hosts=["127.0.0.1", "svc.ns.svc"])
    leaf.cert.verify_directly_issued_by(ca.cert)
    for name in (x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("svc.ns.svc")):
        chain = _policy(ca.cert).build_server_verifier(name).verify(leaf.cert, [])
        assert chain[-1] == ca.cert
    with pytest.raises(VerificationError):
        _policy(ca.cert).build_server_verifier(x509.DNSName("other.example")).verify(leaf.cert, [])


def test_leaf_does_not_verify_against_another_ca() -> None:
    ca, other = make_ca("ca-a"), make_ca("ca-a")  # same name: only the signature tells them apart
    leaf = issue(ca, "svc", Usage.SERVER, hosts=["localhost"])
    with pytest.raises(InvalidSignature):
        leaf.cert.verify_directly_issued_by(other.cert)
    with pytest.raises(VerificationError):
        _policy(other.cert).build_server_verifier(x509.DNSName("localhost")).verify(leaf.cert, [])


def test_hosts_become_ip_or_dns_sans() -> None:
    ca = make_ca("test-ca")
    hosts = ["10.96.0.1", "localhost", "::1", "kubernetes.default.svc", "1.2.3.4.nip.io"]
    sans = (
        issue(ca, "s", Usage.SERVER, hosts=hosts)
        .cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value
    )
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.96.0.1"),
        ipaddress.ip_address("::1"),
    ]
    assert sans.get_values_for_type(x509.DNSName) == [
        "localhost",
        "kubernetes.default.svc",
        "1.2.3.4.nip.io",
    ]


def test_server_and_client_usage() -> None:
    ca = make_ca("test-ca")
    server = issue(ca, "svc", Usage.SERVER, hosts=["localhost"])
    client = issue(ca, "kubernetes-admin", Usage.CLIENT, organization="system:masters")

    def eku(cert: x509.Certificate) -> list[x509.ObjectIdentifier]:
        return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)

    assert eku(server.cert) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert eku(client.cert) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    # Kubernetes takes the user from CN and the groups from O.
    assert client.cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == (
        "system:masters"
    )
    verified = _client_verifier(ca.cert).verify(client.cert, [])
    assert verified.chain[-1] == ca.cert
    # A client certificate cannot stand in for a server, even one naming the host, nor a
    # server's for a client: the EKU decides.
    named_client = issue(ca, "svc", Usage.CLIENT, hosts=["localhost"])
    with pytest.raises(VerificationError, match="EKU"):
        _policy(ca.cert).build_server_verifier(x509.DNSName("localhost")).verify(
            named_client.cert, []
        )
    with pytest.raises(VerificationError, match="EKU"):
        _client_verifier(ca.cert).verify(server.cert, [])


def test_ca_signs_leaves_only() -> None:
    ca = make_ca("test-ca")
    constraints = ca.cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert (constraints.ca, constraints.path_length) == (True, 0)
    leaf = issue(ca, "svc", Usage.SERVER, hosts=["localhost"])
    assert not leaf.cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_unusable_requests_are_refused() -> None:
    ca = make_ca("test-ca")
    with pytest.raises(PkiError, match="no hosts"):
        issue(ca, "svc", Usage.SERVER)
    with pytest.raises(PkiError, match="days=0"):
        issue(ca, "admin", Usage.CLIENT, days=0)


def test_written_pair_round_trips_and_key_is_owner_only(tmp_path: Path) -> None:
    ca = make_ca("test-ca")
    leaf = issue(ca, "svc", Usage.SERVER, hosts=["localhost"])
    cert_path, key_path = tmp_path / "tls.crt", tmp_path / "tls.key"
    key_path.write_text("stale, world-readable\n")
    key_path.chmod(0o644)  # an old file's mode must not survive (Path.touch(mode=) keeps it)
    old_umask = os.umask(0)  # and a permissive umask must not widen a new file either
    try:
        write_cert_and_key(leaf, cert_path, key_path)
        write_cert_and_key(ca, tmp_path / "ca.crt", tmp_path / "ca.key")
    finally:
        os.umask(old_umask)
    assert _mode(key_path) == 0o600
    assert _mode(tmp_path / "ca.key") == 0o600
    assert x509.load_pem_x509_certificate(cert_path.read_bytes()) == leaf.cert
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert key.public_key() == leaf.key.public_key()
    assert key_path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")


def test_key_is_0600_before_its_bytes_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "k.key"
    path.write_bytes(b"")
    path.chmod(0o644)
    modes_at_write: list[int] = []
    real_fdopen = os.fdopen

    class Spy:
        def __init__(self, file: Any) -> None:
            self.file = file

        def __enter__(self) -> Spy:
            self.file.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.__exit__(*exc)

        def fileno(self) -> int:
            return int(self.file.fileno())

        def write(self, data: bytes) -> int:
            modes_at_write.append(stat.S_IMODE(os.fstat(self.file.fileno()).st_mode))
            return int(self.file.write(data))

    monkeypatch.setattr(os, "fdopen", lambda *a, **k: Spy(real_fdopen(*a, **k)))
    kvfleet.pki.write_private_key(path, new_key())
    assert modes_at_write == [0o600]


def test_public_surface_is_complete() -> None:
    public = {
        name
        for name, value in vars(kvfleet.pki).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == "kvfleet.pki"
    }
    assert public == set(kvfleet.pki.__all__)


def test_devcluster_and_webhook_pkis_chain_and_protect_keys(tmp_path: Path) -> None:
    cluster = create_pki(tmp_path / "cluster", "10.96.0.1")
    ca = x509.load_pem_x509_certificate(cluster.ca.cert.read_bytes())
    apiserver = x509.load_pem_x509_certificate(cluster.apiserver.cert.read_bytes())
    for name in (
        x509.IPAddress(ipaddress.ip_address("10.96.0.1")),
        x509.DNSName("kubernetes.default.svc.cluster.local"),
    ):
        _policy(ca).build_server_verifier(name).verify(apiserver, [])
    admin = x509.load_pem_x509_certificate(cluster.admin.cert.read_bytes())
    _client_verifier(ca).verify(admin, [])
    sa_key = cluster.service_account_key.read_bytes()
    assert sa_key.startswith(b"-----BEGIN EC PRIVATE KEY-----")
    webhook = make_serving_certs(tmp_path / "webhook", ["127.0.0.1"])
    webhook_ca = x509.load_pem_x509_certificate(webhook.ca_cert.read_bytes())
    serving = x509.load_pem_x509_certificate(webhook.cert.read_bytes())
    _policy(webhook_ca).build_server_verifier(
        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
    ).verify(serving, [])
    keys = [*(tmp_path / "cluster").glob("*.key"), webhook.key]
    assert len(keys) == 7  # ca, apiserver, admin, controller-manager, scheduler, sa; tls
    assert {_mode(k) for k in keys} == {0o600}
