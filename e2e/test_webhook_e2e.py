"""The validating webhook on a real apiserver: `kubectl apply` of examples/ and examples/invalid/.

The webhook runs as a local process (`kvfleet webhook serve`) on 127.0.0.1 with a generated
CA; the apiserver calls it through a ValidatingWebhookConfiguration with a `url:` clientConfig
and that CA as caBundle. Tests run in file order: the failure-policy test stops the webhook.
"""

from __future__ import annotations

import re
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from kvfleet.api.servingpool import ServingPool
from kvfleet.devcluster.kube import KubeClient
from kvfleet.webhooks.certs import make_serving_certs
from kvfleet.webhooks.config import WEBHOOK_NAME, build_validating_webhook_configuration

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
INVALID = sorted((EXAMPLES / "invalid").glob("*.yaml"))
VWC_NAME = "kvfleet-e2e"
Kubectl = Callable[..., "subprocess.CompletedProcess[str]"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _headers(path: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {"needs": [], "replaces": [], "expect": []}
    for line in path.read_text().splitlines():
        match = re.match(r"^# (needs|replaces|expect): (.*)$", line)
        if match:
            key, value = match.groups()
            found[key] += [value] if key == "expect" else value.split()
    return found


def _until(what: str, check: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class Webhook:
    """The webhook process and its configuration in the cluster."""

    def __init__(self, kubectl: Kubectl, kubeconfig: Path, workdir: Path) -> None:
        self.kubectl = kubectl
        self.kubeconfig = kubeconfig
        self.certs = make_serving_certs(workdir / "certs", ["127.0.0.1"])
        self.port = _free_port()
        self.log = workdir / "webhook.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [
            sys.executable, "-m", "kvfleet", "webhook", "serve", "--host", "127.0.0.1",
            "--port", str(self.port), "--cert", str(self.certs.cert), "--key",
            str(self.certs.key), "--kubeconfig", str(self.kubeconfig),
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log, cwd=ROOT)
        context = ssl.create_default_context(cafile=str(self.certs.ca_cert))

        def healthy() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"webhook exited: {self.log.read_text()[-2000:]}")
            try:
                url = f"https://127.0.0.1:{self.port}/healthz"
                with urllib.request.urlopen(url, context=context, timeout=2) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        _until("the webhook's /healthz", healthy)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=15)
        self.process = None

    def configure(self, failure_policy: Literal["Fail", "Ignore"]) -> None:
        vwc = build_validating_webhook_configuration(
            ca_bundle_pem=self.certs.ca_cert.read_bytes(),
            url=f"https://127.0.0.1:{self.port}/validate",
            name=VWC_NAME,
            failure_policy=failure_policy,
        )
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump(vwc))


def _apply(kubectl: Kubectl, namespace: str, path: Path) -> subprocess.CompletedProcess[str]:
    result: subprocess.CompletedProcess[str] = kubectl(
        "apply", "-n", namespace, "-f", str(path), check=False
    )
    return result


@pytest.fixture(scope="module")
def crds(kubectl: Kubectl) -> Iterator[None]:
    kubectl("apply", "-f", str(ROOT / "crds"))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(ROOT / "crds"))
    yield


@pytest.fixture(scope="module")
def webhook(
    cluster: Any, kubectl: Kubectl, crds: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Webhook]:
    hook = Webhook(kubectl, Path(cluster.kubeconfig), tmp_path_factory.mktemp("webhook"))
    hook.start()
    hook.configure("Fail")
    probe = str(EXAMPLES / "invalid" / "tenantquota-borrow-unlimited.yaml")
    # The apiserver picks the configuration up asynchronously: wait until it is enforced. A
    # server-side dry run is a CREATE every time and stores nothing.
    _until(
        "the webhook to be enforced",
        lambda: (
            "denied the request"
            in kubectl(
                "create", "--dry-run=server", "-n", "default", "-f", probe, check=False
            ).stderr
        ),
    )
    try:
        yield hook
    finally:
        hook.stop()
        kubectl("delete", "validatingwebhookconfiguration", VWC_NAME, "--ignore-not-found")


def test_good_examples_are_admitted(webhook: Webhook, kubectl: Kubectl, namespace: str) -> None:
    # As a user would: the directory in one go, on the first try (files in name order).
    result = _apply(kubectl, namespace, EXAMPLES)
    assert result.returncode == 0, result.stderr
    listed = kubectl("get", "kvfleet", "-n", namespace, "-o", "name").stdout.split()
    assert "servingpool.kvfleet.io/qwen3-8b-chat" in listed
    assert "rollout.kvfleet.io/qwen3-8b-chat" in listed
    # The apiserver shows the model's printer columns (priority 0) after NAME, in order.
    columns = kubectl("get", "sp", "-n", namespace).stdout.splitlines()[0].split()
    expected = [c.name.upper() for c in ServingPool.crd.printer_columns if c.priority == 0]
    assert columns == ["NAME", *expected]


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_example_is_refused(
    webhook: Webhook, kubectl: Kubectl, namespace: str, path: Path
) -> None:
    headers = _headers(path)
    for need in [*headers["needs"], *headers["replaces"]]:
        result = _apply(kubectl, namespace, (path.parent / need).resolve())
        assert result.returncode == 0, (need, result.stderr)
    result = _apply(kubectl, namespace, path)
    assert result.returncode != 0, f"{path.name} was admitted: {result.stdout}"
    for pattern in headers["expect"]:
        assert re.search(pattern, result.stderr), (pattern, result.stderr)


def test_a_tenant_belongs_to_one_namespace(
    webhook: Webhook, kubectl: Kubectl, kube: KubeClient, namespace: str
) -> None:
    """Whoever can write in namespace b must not claim namespace a's tenant: its budget, its
    priority class, its prefix-cache scope."""
    quota = yaml.safe_load((EXAMPLES / "02-tenantquota.yaml").read_text())
    quota["spec"]["tenant"] = f"owned-{namespace}"
    other = f"{namespace}-b"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other}})
    try:
        owned = kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(quota),
                        check=False)
        assert owned.returncode == 0, owned.stderr
        claim = kubectl("apply", "-n", other, "-f", "-", input=yaml.safe_dump(quota),
                        check=False)
        assert claim.returncode != 0, claim.stdout
        assert f"belongs to namespace '{namespace}'" in claim.stderr, claim.stderr
        assert "[rule: ownership]" in claim.stderr
    finally:
        kube.delete("Namespace", other)


def test_failure_policy_when_the_webhook_is_down(
    webhook: Webhook, kubectl: Kubectl, namespace: str
) -> None:
    for name in ("01-modelartifact-qwen3-8b.yaml", "02-servingpool-l4.yaml"):
        assert _apply(kubectl, namespace, EXAMPLES / name).returncode == 0
    webhook.stop()

    # Fail: spec changes are refused while the webhook is unreachable ...
    refused = _apply(kubectl, namespace, EXAMPLES / "02-tenantquota.yaml")
    assert refused.returncode != 0
    assert f'failed calling webhook "{WEBHOOK_NAME}"' in refused.stderr
    # ... but the operator can still write status: */status is not matched.
    status = '{"status": {"replicas": 2, "readyReplicas": 1}}'
    patched = kubectl("patch", "servingpool", "qwen3-8b-chat", "-n", namespace, "--type=merge",
                      "--subresource=status", "-p", status, check=False)  # fmt: skip
    assert patched.returncode == 0, patched.stderr

    # Ignore: objects are admitted unchecked (the availability trade-off) ...
    webhook.configure("Ignore")
    invalid = EXAMPLES / "invalid" / "tenantquota-borrow-unlimited.yaml"
    _until("failurePolicy Ignore", lambda: _apply(kubectl, namespace, invalid).returncode == 0)
    # ... while the CRD's CEL rules still hold without any webhook.
    zigzag = _apply(
        kubectl, namespace, EXAMPLES / "invalid" / "rollout-weights-not-increasing.yaml"
    )
    assert zigzag.returncode != 0
    assert "canary step weights must strictly increase" in zigzag.stderr
