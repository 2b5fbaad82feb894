"""Credentials that are renewed in place, on the real control plane.

The operator runs with a client certificate read from files named in its kubeconfig, as a
kubelet-rotated or cert-manager-renewed certificate is. The first certificate is valid for
under a minute; before it expires the test writes a renewed one over the same files. After
the expiry the apiserver refuses the old one (401) on every request, kept-alive connections
included. Without a restart the operator keeps reconciling: kopf logs in again when its
requests are refused, and the operator's own client reloads on its first 401, builds a new
connection pool with the new certificate and resends the request. The dev-cluster client,
on the same shared loader (kvfleet/kube/credentials.py), does the same.

Why a certificate and not a token: a service-account token cannot be made to expire within
a test (TokenRequest's minimum is 10 minutes), and on this dev control plane deleting a
token's bound Secret or ServiceAccount did not revoke it (still accepted a minute later).
Token rotation itself (a tokenFile, an exec plugin, the in-cluster token re-read) is tested
against an apiserver that accepts only the current token in tests/unit/test_kube_credentials.py.
"""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import httpx
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from e2e.test_operator_e2e import (  # noqa: F401 (crds is a fixture)
    Kubectl,
    OperatorProcess,
    _cond,
    _create,
    _wait_artifact,
    crds,
)
from kvfleet.api.builders import make_artifact
from kvfleet.devcluster.cluster import DevCluster, ExistingCluster
from kvfleet.devcluster.kube import JsonObj, KubeClient, connect
from kvfleet.operator.rbac import NAME as OPERATOR_ROLE
from kvfleet.operator.rbac import build_rbac

pytestmark = [pytest.mark.e2e]

USER = "kvfleet-e2e-renewed-operator"
FIRST_LIFETIME_S = 40


def _verified(artifact: JsonObj) -> bool:
    return _cond(artifact, "Verified").get("status") == "True"


def _issue(ca_cert: Path, ca_key: Path, lifetime: dt.timedelta, cert: Path, key: Path) -> None:
    """A client certificate for USER signed by the cluster CA, written over `cert`/`key`."""
    authority = x509.load_pem_x509_certificate(ca_cert.read_bytes())
    signer = serialization.load_pem_private_key(ca_key.read_bytes(), None)
    assert isinstance(signer, ec.EllipticCurvePrivateKey)
    mine = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    issued = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, USER)]))
              .issuer_name(authority.subject).public_key(mine.public_key())
              .serial_number(x509.random_serial_number())
              .not_valid_before(now - dt.timedelta(seconds=5)).not_valid_after(now + lifetime)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)
              .sign(signer, hashes.SHA256()))
    key.write_bytes(mine.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    key.chmod(0o600)
    cert.write_bytes(issued.public_bytes(serialization.Encoding.PEM))


def test_a_renewed_client_certificate_is_picked_up_without_a_restart(
    cluster: DevCluster | ExistingCluster, kube: KubeClient, kubectl: Kubectl,
    crds: None, namespace: str, tmp_path: Path,  # noqa: F811
) -> None:
    if not isinstance(cluster, DevCluster):
        pytest.skip("needs the cluster CA's key to issue certificates (the dev cluster's)")
    ca = cluster.pki.ca
    cert, key = tmp_path / "operator.crt", tmp_path / "operator.key"
    # The operator's ClusterRole (what `kvfleet operator --print-rbac` grants), bound to USER.
    role = next(d for d in build_rbac() if d["kind"] == "ClusterRole")
    kubectl("apply", "-f", "-", input=yaml.safe_dump(role))
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": USER},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": OPERATOR_ROLE},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                             "name": USER}]}
    kubectl("apply", "-f", "-", input=yaml.safe_dump(binding))
    _issue(ca.cert, ca.key, dt.timedelta(seconds=FIRST_LIFETIME_S), cert, key)
    expires = time.monotonic() + FIRST_LIFETIME_S
    kubeconfig = tmp_path / "operator.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "operator",
        "clusters": [{"name": "dev", "cluster": {"server": kube.credentials.server,
                                                 "certificate-authority": str(ca.cert)}}],
        "users": [{"name": USER, "user": {"client-certificate": str(cert),
                                          "client-key": str(key)}}],
        "contexts": [{"name": "operator", "context": {"cluster": "dev", "user": USER}}]}))
    operator = OperatorProcess(kubeconfig, tmp_path)
    operator.start()
    client = connect(kubeconfig)
    try:
        _create(kube, make_artifact("before", namespace).data())
        _wait_artifact(kube, namespace, "before", _verified, 90)
        assert [a["metadata"]["name"] for a in client.list("ModelArtifact", namespace)] == \
            ["before"]
        generation = client.credentials.generation
        old = client.credentials.tls.context()

        # Renewed in place, as cert-manager or the kubelet does; then the old one expires.
        _issue(ca.cert, ca.key, dt.timedelta(hours=1), cert, key)
        time.sleep(max(0.0, expires - time.monotonic()) + 2)
        refused = httpx.get(f"{kube.credentials.server}/apis/kvfleet.io/v1alpha1/modelartifacts",
                            verify=old)
        assert refused.status_code == 401, refused.text  # the old certificate is refused now

        # The same operator process verifies an artifact made after the expiry: kopf's
        # handlers and the operator's status writes both need the renewed certificate.
        _create(kube, make_artifact("after", namespace).data())
        after = _wait_artifact(kube, namespace, "after", _verified, 90)
        assert after["status"]["manifestHash"]
        assert operator.proc is not None and operator.proc.poll() is None, operator.log_tail()
        assert operator.starts == 1

        # The dev-cluster client: refused once, reloaded, answered.
        names = sorted(a["metadata"]["name"] for a in client.list("ModelArtifact", namespace))
        assert names == ["after", "before"]
        assert client.credentials.generation == generation + 1
        assert client.credentials.tls.cert == cert.read_bytes()
    finally:
        client.close()
        operator.stop()
        kube.delete("ClusterRoleBinding", USER)
