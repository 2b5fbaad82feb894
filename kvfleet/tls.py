"""A TLS server's certificate, reloaded in place when its files change: the webhook's (renewed
by cert-manager) and the engines' (from the pool's Secret). The kubelet swaps a mounted
Secret's files in place, so new connections get the new certificate without a restart (open
ones keep theirs)."""

from __future__ import annotations

import asyncio
import logging
import ssl
import tempfile
from pathlib import Path

LOG = logging.getLogger("kvfleet.tls")


def server_ssl_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


class ServingCertificate:
    """The serving certificate, reloaded into the same SSL context when its files change:
    cert-manager renews the Secret and the kubelet swaps the mounted files in place, so new
    connections get the new certificate without a restart (open ones keep theirs)."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = cert, key
        self.context = server_ssl_context(cert, key)
        self._seen = self._stamp()

    def _stamp(self) -> tuple[tuple[int, int], ...]:
        # stat follows the kubelet's ..data symlink, so a swapped Secret changes the stamp.
        return tuple((s.st_mtime_ns, s.st_size) for s in (self.cert.stat(), self.key.stat()))

    def reload_if_changed(self) -> bool:
        """True when a changed pair was loaded; a pair caught mid-write (key not matching the
        certificate) is left for the next look, the old one serving meanwhile."""
        try:
            stamp = self._stamp()
        except OSError as exc:
            LOG.warning("serving certificate: cannot stat %s or %s (%s)", self.cert, self.key,
                        exc)
            return False
        if stamp == self._seen:
            return False
        try:
            self._load_checked()
        except (OSError, ssl.SSLError) as exc:
            LOG.warning("serving certificate: %s changed but does not load yet (%s)",
                        self.cert, exc)
            return False
        self._seen = stamp
        LOG.info("serving certificate reloaded from %s", self.cert)
        return True

    def _load_checked(self) -> None:
        """Load a snapshot of the pair that a scratch context accepted: a failed
        load_cert_chain leaves a context with the new certificate and the old key, so the
        live context is only ever given a pair known to match."""
        with tempfile.TemporaryDirectory(prefix="kvfleet-cert-") as tmp:
            cert, key = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
            cert.write_bytes(self.cert.read_bytes())
            key.touch(mode=0o600)
            key.write_bytes(self.key.read_bytes())
            server_ssl_context(cert, key)  # raises when they do not match
            self.context.load_cert_chain(cert, key)

    async def watch(self, interval: float = 10.0) -> None:
        while True:
            await asyncio.sleep(interval)
            self.reload_if_changed()
