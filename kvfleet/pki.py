"""X.509 building blocks for throwaway PKIs: the dev cluster's (kvfleet.devcluster.pki) and the
webhook's serving certificate (kvfleet.webhooks.certs) are both a CA plus leaves issued by it.

Bottom layer: imports nothing else from kvfleet, so any layer may use it. ECDSA P-256 keys
because they generate in microseconds; every certificate is back-dated five minutes so a
verifier whose clock runs a little behind still accepts it.

Errors:

    ValueError
    └── PkiError    a request that cannot make a usable certificate (no SANs, no validity)
"""

from __future__ import annotations

import datetime as dt
import enum
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CertAndKey",
    "PkiError",
    "Usage",
    "issue",
    "make_ca",
    "new_key",
    "subject_alt_names",
    "write_cert",
    "write_cert_and_key",
    "write_private_key",
]

_CLOCK_SKEW = dt.timedelta(minutes=5)


class PkiError(ValueError):
    """A certificate request that would produce an unusable certificate."""


class Usage(enum.Enum):
    """What a leaf certificate proves: a TLS server's identity or a TLS client's."""

    SERVER = ExtendedKeyUsageOID.SERVER_AUTH
    CLIENT = ExtendedKeyUsageOID.CLIENT_AUTH


@dataclass(frozen=True)
class CertAndKey:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str, organization: str | None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        # Kubernetes reads O= of a client certificate as the user's groups.
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def subject_alt_names(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    """SANs for `hosts`, in order: a host that parses as an IPv4/IPv6 address becomes an IP
    SAN (clients connecting by IP match only those), anything else a DNS SAN."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, days: int
) -> x509.CertificateBuilder:
    if days < 1:
        raise PkiError(f"days={days}: a certificate must be valid for at least 1 day")
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
    )


def make_ca(common_name: str, days: int = 365) -> CertAndKey:
    """A self-signed CA that may sign leaves only (path length 0)."""
    key = new_key()
    name = _name(common_name, None)
    cert = (
        _builder(name, name, key, days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return CertAndKey(cert, key)


def issue(
    ca: CertAndKey,
    common_name: str,
    usage: Usage,
    *,
    organization: str | None = None,
    hosts: Sequence[str] = (),
    days: int = 365,
) -> CertAndKey:
    """A leaf signed by `ca` with a fresh key; `hosts` (DNS names or IPs) become its SANs."""
    if usage is Usage.SERVER and not hosts:
        # Modern TLS clients (Go, Python) ignore the common name and match only SANs.
        raise PkiError(
            f"server certificate {common_name!r} has no hosts: pass the DNS names or IPs "
            "clients connect to"
        )
    key = new_key()
    builder = (
        _builder(_name(common_name, organization), ca.cert.subject, key, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage.value]), critical=False)
        # RFC 5280 requires the authority key identifier on an issued certificate (and the
        # subject's on a CA); strict verifiers (cryptography's, webpki) refuse a leaf without.
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
    )
    if hosts:
        builder = builder.add_extension(subject_alt_names(hosts), critical=False)
    return CertAndKey(builder.sign(ca.key, hashes.SHA256()), key)


def write_private_key(
    path: Path,
    key: ec.EllipticCurvePrivateKey,
    private_format: serialization.PrivateFormat = serialization.PrivateFormat.PKCS8,
) -> None:
    """Write `key` unencrypted as PEM to `path`, readable by the owner only.

    The mode is set on the open descriptor before any key bytes are written: O_CREAT's mode
    applies only to a new file (and through the umask), so an existing, wider file is narrowed
    with fchmod first rather than chmod-ed after the secret is already on disk.
    """
    data = key.private_bytes(
        serialization.Encoding.PEM, private_format, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        os.fchmod(file.fileno(), 0o600)
        file.write(data)


def write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def write_cert_and_key(pair: CertAndKey, cert_path: Path, key_path: Path) -> None:
    """Write the certificate (PEM, public) and its key (PKCS#8 PEM, mode 0600)."""
    write_cert(cert_path, pair.cert)
    write_private_key(key_path, pair.key)
