"""Credentials that rotate, on the real control plane.

The operator runs with its ServiceAccount's token read from a file, as a pod reads its
projected token (the kubelet rewrites it, hourly by default). The test revokes that token at
the apiserver (it is bound to a Secret, and the Secret is deleted) and writes a new one to the
file. Without a restart the operator keeps reconciling: kopf logs in again when its requests
are refused, and the operator's own client reloads on its first 401 and resends the request.
The dev-cluster client, on the same shared loader, does the same.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from e2e.test_operator_e2e import (  # noqa: F401 (crds is a fixture)
    OPERATOR_NAMESPACE,
    Kubectl,
    OperatorProcess,
    _cond,
    _create,
    _wait_artifact,
    crds,
    operator_kubeconfig,
    operator_token,
)
from kvfleet.api.builders import make_artifact
from kvfleet.devcluster.kube import JsonObj, KubeClient, connect

pytestmark = [pytest.mark.e2e]


def _verified(artifact: JsonObj) -> bool:
    return _cond(artifact, "Verified").get("status") == "True"


def test_a_revoked_and_rotated_token_is_picked_up_without_a_restart(
    kube: KubeClient, kubectl: Kubectl, crds: None, namespace: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    holders = [f"operator-token-{uuid.uuid4().hex[:6]}-{n}" for n in ("a", "b")]
    token_file = tmp_path / "token"
    kubeconfig = operator_kubeconfig(kube, kubectl, tmp_path, token_file=token_file)
    for name in holders:  # each token is bound to one of these: deleting it revokes the token
        kube.create({"apiVersion": "v1", "kind": "Secret",
                     "metadata": {"name": name, "namespace": OPERATOR_NAMESPACE}})
    old = operator_token(kube, 3600, bound_to_secret=holders[0])
    token_file.write_text(old)
    operator = OperatorProcess(kubeconfig, tmp_path)
    operator.start()
    client = connect(kubeconfig)
    try:
        _create(kube, make_artifact("before", namespace).data())
        _wait_artifact(kube, namespace, "before", _verified, 90)
        assert [a["metadata"]["name"] for a in client.list("ModelArtifact", namespace)] == \
            ["before"]
        generation = client.credentials.generation

        # Rotation: the new token in the file, the old one revoked.
        token_file.write_text(operator_token(kube, 3600, bound_to_secret=holders[1]))
        kube.delete("Secret", holders[0], OPERATOR_NAMESPACE)

        def refused() -> bool | None:  # the apiserver caches a token's review for a while
            answer = httpx.get(
                f"{kube.credentials.server}/apis/kvfleet.io/v1alpha1/modelartifacts",
                headers={"Authorization": f"Bearer {old}"}, verify=kube.credentials.ssl_context())
            return True if answer.status_code == 401 else None

        kube.wait_for("the old token to be refused", refused, 60, interval=1)

        # The operator, still the same process, verifies an artifact made after the rotation
        # (kopf's handlers and the operator's status writes both need the new token).
        _create(kube, make_artifact("after", namespace).data())
        after = _wait_artifact(kube, namespace, "after", _verified, 90)
        assert after["status"]["manifestHash"]
        assert operator.proc is not None and operator.proc.poll() is None, operator.log_tail()
        assert operator.starts == 1

        # The dev-cluster client: refused once, reloaded, answered.
        names = sorted(a["metadata"]["name"] for a in client.list("ModelArtifact", namespace))
        assert names == ["after", "before"]
        assert client.credentials.generation == generation + 1
    finally:
        client.close()
        operator.stop()
        for name in holders:
            kube.delete("Secret", name, OPERATOR_NAMESPACE)
