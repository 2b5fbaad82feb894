"""The certificate a pool's engines serve HTTPS with (`--engine-tls`): one per pool, issued by
the operator for the pool's name (`engine_server_name`), kept in the pool's router-token
Secret, pinned by the router. Renewed RENEW_BEFORE its end; the certificate it replaces stays
in the Secret (`previous.crt`) so the router trusts both while the engines' mounted files
catch up."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from kvfleet.operator.builders import EngineCertificate
from kvfleet.pki import Usage, issue, make_ca

RENEW_BEFORE = timedelta(days=30)
VALID_DAYS = 365


def issue_engine_certificate(server_name: str) -> EngineCertificate:
    """A fresh certificate for `server_name`; its one-off CA is thrown away (the router pins
    the certificate itself)."""
    pair = issue(make_ca(f"kvfleet engines {server_name}", VALID_DAYS), server_name,
                 Usage.SERVER, hosts=[server_name], days=VALID_DAYS)
    key = pair.key.private_bytes(serialization.Encoding.PEM,
                                 serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
    return EngineCertificate(pair.cert.public_bytes(serialization.Encoding.PEM).decode(),
                             key.decode())


def _valid_for(cert: str, server_name: str, now: datetime) -> timedelta | None:
    """How long `cert` is still good for `server_name` (None: unreadable or another name)."""
    try:
        parsed = x509.load_pem_x509_certificate(cert.encode())
        names = parsed.extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    except (ValueError, x509.ExtensionNotFound):
        return None
    if server_name not in names:
        return None
    return parsed.not_valid_after_utc - now


def wanted_certificate(current: EngineCertificate | None, server_name: str, now: datetime,
                       new: Callable[[str], EngineCertificate]) -> EngineCertificate:
    """The pool's certificate: the current one while it is good for more than RENEW_BEFORE,
    else a new one that remembers it."""
    left = None if current is None else _valid_for(current.cert, server_name, now)
    if current is not None and left is not None and left > RENEW_BEFORE:
        return current
    fresh = new(server_name)
    return replace(fresh, previous=current.cert if current is not None and left is not None
                   else "")
