"""Who kvfleet is to the apiserver: one loader for every client it has (the operator and kopf,
the router, the webhook, the dev-cluster harness and the tests).

The loading is the `kubernetes` package's own, so kvfleet reads credentials as kubectl and
client-go do: kubeconfig files (a `$KUBECONFIG` list is merged), CA and client certificates as
files or inline data, tokens and `tokenFile`, basic auth, exec credential plugins, and the
in-cluster service account. Where they come from, in order: the `kubeconfig` given, then
`$KUBECONFIG`, then the pod's service account, then `~/.kube/config`.

What the package loads is kept here as PEM bytes in memory and an Authorization header that
stays current:

- a projected service-account token (the kubelet rewrites the file, hourly by default) is read
  again each minute;
- an exec plugin's token is fetched again when it expires;
- after a 401, `reload` reads everything again: a rotated `tokenFile`, a kubeconfig edited in
  place, a new client certificate. Each client retries the refused request once.

The package writes inline certificate data to files for Python's `ssl`; here they go to a
private folder (0700, files 0600) that is removed as soon as the material is read, so no key
stays on disk.

CredentialsError    none found, or what was found cannot be read (names the source)
"""

from __future__ import annotations

import os
import shutil
import ssl
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = Path("~/.kube/config")


class CredentialsError(RuntimeError):
    """No credentials, or credentials that cannot be read; the message names the source."""


@contextmanager
def private_folder() -> Iterator[Path]:
    """A folder only this user can read, removed on the way out whatever happens."""
    folder = Path(tempfile.mkdtemp(prefix="kvfleet-credentials-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class Tls:
    """How to trust the apiserver and prove who we are to it, as PEM bytes."""

    ca: bytes | None = None  # None: the system's trust store
    cert: bytes | None = None
    key: bytes | None = None
    insecure: bool = False

    def context(self) -> ssl.SSLContext:
        # With a cluster CA, trust only it (as kubectl does); without one, the system's.
        context = ssl.create_default_context(cadata=self.ca.decode() if self.ca else None)
        if self.cert is not None:
            # ssl loads a certificate chain only from files: the key is on disk for this call.
            with private_folder() as folder:
                cert, key = folder / "tls.crt", folder / "tls.key"
                cert.write_bytes(self.cert)
                if self.key is not None:
                    key.touch(mode=0o600)
                    key.write_bytes(self.key)
                context.load_cert_chain(cert, key if self.key is not None else None)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


class Credentials:
    """The apiserver's address, its TLS material and a current Authorization header.

    Thread-safe: the operator's event loop, its worker threads and kopf share one instance.
    `generation` counts loads; a client passes the generation its refused request used to
    `reload`, so a burst of 401s reloads once. `tls_generation` changes only when the TLS
    material does: a client rebuilds its connection pool then.
    """

    def __init__(self, kubeconfig: Path | str | None = None, *,
                 service_account: Path = SERVICE_ACCOUNT) -> None:
        explicit = kubeconfig if kubeconfig is not None else os.environ.get("KUBECONFIG")
        self._kubeconfig = str(explicit) if explicit else None
        self._service_account = service_account
        self._lock = threading.Lock()
        self.generation = 0
        self.tls_generation = 0
        self.tls = Tls()
        self._context: ssl.SSLContext | None = None
        self._load()

    @property
    def source(self) -> str:
        """Where the credentials come from, for messages."""
        if self._kubeconfig is not None:
            return f"kubeconfig {self._kubeconfig}"
        if self._in_cluster():
            return f"service account {self._service_account}"
        return f"kubeconfig {DEFAULT_KUBECONFIG}"

    def _in_cluster(self) -> bool:
        return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and \
            (self._service_account / "token").is_file()

    def _load(self) -> None:
        # Imported here: the generated client under it costs ~0.3 s and ~30 MB, paid only by
        # processes that talk to an apiserver.
        from kubernetes.client import Configuration
        from kubernetes.config.config_exception import ConfigException
        from kubernetes.config.incluster_config import InClusterConfigLoader
        from kubernetes.config.kube_config import load_kube_config

        config = Configuration()
        source = self.source
        with private_folder() as folder:
            try:
                if self._kubeconfig is None and self._in_cluster():
                    InClusterConfigLoader(  # type: ignore[no-untyped-call]
                        token_filename=str(self._service_account / "token"),
                        cert_filename=str(self._service_account / "ca.crt"),
                    ).load_and_set(config)
                else:
                    path = self._kubeconfig or str(DEFAULT_KUBECONFIG.expanduser())
                    if self._kubeconfig is None and not Path(path).is_file():
                        raise CredentialsError(
                            "no credentials: run in a pod with a service account, set "
                            f"KUBECONFIG, or write {DEFAULT_KUBECONFIG}")
                    load_kube_config(  # type: ignore[no-untyped-call]
                        config_file=path, client_configuration=config,
                        persist_config=False, temp_file_path=str(folder))
                tls = Tls(_read(config.ssl_ca_cert), _read(config.cert_file),
                          _read(config.key_file), insecure=not config.verify_ssl)
            except CredentialsError:
                raise
            except (ConfigException, OSError, ValueError, KeyError, TypeError) as error:
                raise CredentialsError(f"{source}: {error}") from error
        if not config.host:
            raise CredentialsError(f"{source}: no server in the current context")
        self._config: Any = config
        self.server = str(config.host).rstrip("/")
        if self.generation == 0 or tls != self.tls:
            self.tls, self._context = tls, None
            self.tls_generation += 1
        self.generation += 1

    def ssl_context(self) -> ssl.SSLContext:
        with self._lock:
            if self._context is None:
                self._context = self.tls.context()
            return self._context

    def authorization(self) -> str | None:
        """The Authorization header's value (`Bearer ...`, `Basic ...`), or None with a client
        certificate only. Re-reads a token that is due (in-cluster: each minute; an exec
        plugin's: at its expiry, which runs the plugin here, synchronously)."""
        with self._lock:
            value: str | None = self._config.get_api_key_with_prefix("BearerToken")
        return value or None

    def headers(self) -> dict[str, str]:
        """`{"Authorization": ...}` to send with a request, or nothing (a certificate only)."""
        authorization = self.authorization()
        return {"Authorization": authorization} if authorization else {}

    def reload(self, generation: int | None = None) -> None:
        """Read the credentials again (after a 401 on those of `generation`; None: now)."""
        with self._lock:
            if generation is None or generation == self.generation:
                self._load()
