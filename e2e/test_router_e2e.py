"""The router on the real control plane: `kvfleet router -n NS` reads the pool, its engine pod,
key Secrets and TenantQuotas from the API server and serves through the operator-made engine
pod (which refuses anyone without the pool's router token); it writes the quota's usage back."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.argocd_health import ArgoHealth
from e2e.test_operator_e2e import (  # noqa: F401 (crds and operator are fixtures)
    EXAMPLES,
    KVFLEET,
    ROOT,
    Kubectl,
    OperatorProcess,
    _available,
    _create,
    _free_port,
    _local_engine_pool,
    _only_the_local_l4_node,
    _wait_pool,
    crds,
    operator,
)
from kvfleet.devcluster.cluster import DevCluster, ExistingCluster
from kvfleet.devcluster.kube import KubeClient

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "sk-e2e-team-a-0123456789abcdef"


class RouterProcess:
    def __init__(self, kubeconfig: str, namespace: str | None, log: Path) -> None:
        self.port, metrics_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.log = log
        command = [str(KVFLEET)] if KVFLEET.exists() else [sys.executable, "-m", "kvfleet"]
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*command, "router", *(["-n", namespace] if namespace else ["-A"]),
                 "--port", str(self.port), "--metrics-port", str(metrics_port)],
                env={**os.environ, "KUBECONFIG": kubeconfig, "PYTHONPATH": str(ROOT)},
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        pytest.fail(f"router not ready in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def router_pool(kube: KubeClient, kubectl: Kubectl, operator: OperatorProcess,  # noqa: F811
                namespace: str, local_node: str, fake_nodes: list[str]) -> str:
    kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / "01-modelartifact-smollm2.yaml"))
    with _only_the_local_l4_node(kube, kubectl):
        _create(kube, _local_engine_pool("smol", "smollm2-135m-instruct", namespace))
        _wait_pool(kube, operator, namespace, "smol", _available, "real pod Ready", 300)
    return "smol"


def chat(url: str, key: str | None, model: str = "smol") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/chat/completions", headers=headers, timeout=60,
                      json={"model": model, "max_tokens": 2,
                            "messages": [{"role": "user", "content": "Hi"}]})


def test_the_router_serves_tenants_by_key_and_quota_from_the_cluster(
    kube: KubeClient, cluster: DevCluster | ExistingCluster, namespace: str, router_pool: str,
    tmp_path: Path, argo_health: ArgoHealth,
) -> None:
    _key_secret(kube, namespace, "team-a-key", "team-a", KEY)
    kube.request("POST", f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenantquotas", {
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "TenantQuota",
        "metadata": {"name": "team-a"},
        "spec": {"tenant": "team-a", "limits": {"requestsPerMinute": 3},
                 "allowedPools": [router_pool]}})
    router = RouterProcess(cluster.kubeconfig, namespace, tmp_path / "router.log")
    try:
        router.wait_ready()
        time.sleep(0.5)  # a first scrape of the engine's load
        assert chat(router.url, None).status_code == 401
        assert chat(router.url, "sk-unknown-0123456789abcdef").status_code == 401
        codes = [chat(router.url, KEY) for _ in range(4)]
        assert [r.status_code for r in codes[:3]] == [200, 200, 200], codes[0].text
        assert codes[3].status_code == 429 and int(codes[3].headers["retry-after"]) >= 1
        assert "TenantQuota " + namespace + "/team-a" in codes[3].json()["error"]["message"]
        # The engine pod refuses a request that did not come through the router.
        (pod,) = kube.list("Pod", namespace, label_selector="kvfleet.io/pool=smol")
        direct = httpx.post(f"http://{pod['status']['podIP']}:8000/v1/chat/completions",
                            headers={"x-kvfleet-tenant": "team-a"}, timeout=30,
                            json={"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        assert direct.status_code == 401, direct.text
        # Usage reaches the TenantQuota's status (written every 10 s when it changed).
        deadline = time.monotonic() + 30
        while True:
            quota = kube.request(
                "GET", f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenantquotas/team-a")
            status = quota.get("status") or {}
            if (status.get("usage") or {}).get("requestsPerMinute"):
                break
            assert time.monotonic() < deadline, f"no usage written: {status}"
            time.sleep(1)
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["reason"]) == ("True", "Enforced")
        argo_health.expect(quota, "Healthy", "enforced")
        # Fail closed: without its TenantQuota the tenant is refused, not unlimited.
        quotas = f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenantquotas"
        kube.request("DELETE", quotas + "/team-a")
        deadline = time.monotonic() + 10
        while (resp := chat(router.url, KEY)).status_code != 403:
            assert resp.status_code == 429 and time.monotonic() < deadline, resp.text
            time.sleep(0.2)
        assert resp.json()["error"]["code"] == "no_tenant_quota", resp.text
        assert "has no TenantQuota" in resp.json()["error"]["message"]
        kube.request("POST", quotas, {
            "apiVersion": "kvfleet.io/v1alpha1", "kind": "TenantQuota",
            "metadata": {"name": "team-a"}, "spec": {"tenant": "team-a"}})  # no limits
        # The traffic table in the pool's status is the Rollout controller's only lever: a
        # change reaches requests within a second (here: every conversation to a canary
        # revision that has no replica yet, then back). Its clients are answered by stable;
        # the canary is counted as having failed them.
        while (resp := chat(router.url, KEY)).status_code != 200:
            assert time.monotonic() < deadline + 10, resp.text
            time.sleep(0.2)
        pool_path = f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/servingpools/smol"
        serving = kube.request("GET", pool_path)["status"]["servingRevision"]

        def traffic(table: list[dict[str, object]]) -> float:
            kube.request("PATCH", pool_path + "/status", {"status": {"traffic": table}},
                         content_type="application/merge-patch+json")
            return time.monotonic()

        def canary_failed() -> float:
            text = httpx.get(router.metrics_url, timeout=10).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("kvfleet_router_requests_total{") and
                       'revision="cccccccccccc"' in line and 'outcome="upstream_error"' in line)

        changed = traffic([{"revision": serving, "role": "stable", "weight": 0},
                           {"revision": "c" * 64, "role": "canary", "weight": 100}])
        while canary_failed() == 0:
            resp = chat(router.url, KEY)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvfleet-revision"] == serving[:12]
            assert time.monotonic() - changed < 1.0, "the traffic change took over a second"
            time.sleep(0.05)
        changed = traffic([{"revision": serving, "role": "stable", "weight": 100}])
        while (resp := chat(router.url, KEY)).status_code != 200:
            assert time.monotonic() - changed < 1.0, resp.text
            time.sleep(0.05)
        assert resp.headers["x-kvfleet-revision"] == serving[:12]
        _rotate_the_router_token_under_load(kube, namespace, router, pod["status"]["podIP"])
    finally:
        router.stop()


def _rotate_the_router_token_under_load(kube: KubeClient, namespace: str,
                                        router: RouterProcess, pod_ip: str) -> None:
    """The pool's router token Secret is rewritten while clients are served: the router sees
    it at once, the engine pod's mounted file a kubelet sync later (10 s here), and no
    request fails meanwhile. Afterwards the engine takes the new token and, for a while,
    the old one."""
    (secret,) = kube.list("Secret", namespace, label_selector="kvfleet.io/router-token-for=smol")
    old = base64.b64decode(secret["data"]["token"]).decode()
    new = "rotated-" + os.urandom(16).hex()
    codes: list[int] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            resp = chat(router.url, KEY)
            codes.append(resp.status_code)
            if resp.status_code != 200:
                print("failed across the rotation:", resp.text)

    client = threading.Thread(target=load)
    client.start()
    try:
        time.sleep(2)
        kube.request("PATCH", f"/api/v1/namespaces/{namespace}/secrets/"
                     f"{secret['metadata']['name']}",
                     {"data": {"token": base64.b64encode(new.encode()).decode()}},
                     content_type="application/merge-patch+json")
        rotated = time.monotonic()
        while _engine_accepts(pod_ip, old) and not _engine_accepts(pod_ip, new):
            assert time.monotonic() - rotated < 60, "the engine never read the new token"
            time.sleep(1)
        print(f"the engine took the new token {time.monotonic() - rotated:.0f} s after the "
              f"Secret changed; {len(codes)} requests meanwhile")
        time.sleep(2)
    finally:
        stop.set()
        client.join()
    assert codes and set(codes) == {200}, codes
    assert _engine_accepts(pod_ip, new) and _engine_accepts(pod_ip, old)  # (the grace)


def _engine_accepts(pod_ip: str, token: str) -> bool:
    resp = httpx.post(f"http://{pod_ip}:8000/v1/chat/completions", timeout=30,
                      headers={"x-kvfleet-tenant": "team-a", "x-kvfleet-router-token": token},
                      json={"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
    return resp.status_code == 200


def test_a_key_minted_in_another_namespace_cannot_spend_a_tenants_budget(
    kube: KubeClient, kubectl: Kubectl, cluster: DevCluster | ExistingCluster, namespace: str,
    router_pool: str, tmp_path: Path,
) -> None:
    """Mallory may create Secrets in her own namespace only. With a router watching every
    namespace she mints a key labelled for team-a (whose TenantQuota is elsewhere) and one
    for a tenant of her own without a TenantQuota: the first never authenticates, the second
    is refused (fail closed), and team-a is served as before. With a TenantQuota of her own,
    team-a's pool is hidden from her until her allowedPools names it and the pool shares with
    her namespace."""
    other = f"{namespace}-b"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other}})
    rbac = "/apis/rbac.authorization.k8s.io/v1/namespaces/" + other
    kube.request("POST", rbac + "/roles", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "secret-maker"},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]})
    kube.request("POST", rbac + "/rolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "mallory"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "secret-maker"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                      "name": "mallory"}]})
    # A tenant and key of this test's own: a router watching every namespace also sees other
    # tests' team-a (the same name, the same key) in namespaces still being deleted, whose
    # older TenantQuota makes that namespace team-a's.
    tenant = f"team-a-{namespace.rsplit('-', 1)[-1]}"
    key = f"sk-{tenant}-0123456789abcdef"
    _key_secret(kube, namespace, "team-a-key", tenant, key)
    kube.request("POST", f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenantquotas", {
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "TenantQuota",
        "metadata": {"name": "team-a"}, "spec": {"tenant": tenant}})
    forged, own = "sk-mallory-as-team-a-0123456789", "sk-mallory-own-0123456789abc"

    def mint(target: str, tenant: str, key: str) -> subprocess.CompletedProcess[str]:
        manifest = json.dumps({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": f"key-{tenant}", "namespace": target,
                         "labels": {"kvfleet.io/tenant": tenant}},
            "data": {"key": base64.b64encode(key.encode()).decode()}})
        return kubectl("create", "--as", "mallory", "-f", "-", input=manifest, check=False)

    denied = mint(namespace, tenant, forged)  # not in team-a's namespace: no rights
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
    assert mint(other, tenant, forged).returncode == 0
    assert mint(other, "mallory", own).returncode == 0
    router = RouterProcess(cluster.kubeconfig, None, tmp_path / "router.log")
    try:
        router.wait_ready()
        time.sleep(0.5)  # a first scrape of the engine's load
        pool = f"{namespace}/{router_pool}"
        assert chat(router.url, key, pool).status_code == 200
        forged_answer = chat(router.url, forged, pool)
        assert forged_answer.status_code == 401, forged_answer.text
        refused = chat(router.url, own, pool)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "no_tenant_quota"
        assert chat(router.url, key, pool).status_code == 200
        log = router.log.read_text()
        assert f"Secret {other}/key-{tenant}: ignored" in log and forged not in log
        served = httpx.get(router.metrics_url, timeout=10).text
        admitted = sum(float(line.rsplit(" ", 1)[1]) for line in served.splitlines()
                       if line.startswith("kvfleet_router_requests_total{")
                       and 'outcome="completed"' in line)
        assert admitted == 2  # team-a's two; nothing of Mallory's reached an engine

        # Mallory's tenant gets a TenantQuota of its own namespace: its key is served there,
        # and team-a's pool is no pool of hers (it was, by any name, with -A) until both
        # sides say so: her allowedPools names it, and the pool shares with her namespace.
        quotas = f"/apis/kvfleet.io/v1alpha1/namespaces/{other}/tenantquotas"
        kube.request("POST", quotas, {
            "apiVersion": "kvfleet.io/v1alpha1", "kind": "TenantQuota",
            "metadata": {"name": "mallory"}, "spec": {"tenant": "mallory"}})

        def answer_becomes(code: int, what: str) -> httpx.Response:
            return kube.wait_for(what, lambda: answer if (answer := chat(
                router.url, own, pool)).status_code == code else None, 30)

        hidden = answer_becomes(404, "another namespace's pool hidden from Mallory")
        assert hidden.json()["error"]["code"] == "model_not_found", hidden.text
        assert chat(router.url, own, router_pool).status_code == 404
        listed = httpx.get(router.url + "/v1/models", timeout=10,
                           headers={"authorization": f"Bearer {own}"}).json()["data"]
        assert listed == [], listed
        kube.merge_patch("ServingPool", router_pool, {"metadata": {"annotations": {
            "kvfleet.io/shared-with": other}}}, namespace)
        answer_becomes(403, "the pool shared, her allowedPools (non-empty) not listing it")
        kube.merge_patch("TenantQuota", "mallory", {"spec": {"allowedPools": [pool]}}, other)
        answer_becomes(200, "the pool shared and listed")
    finally:
        router.stop()
        kube.delete("Namespace", other)


def test_a_tenant_quota_from_a_newer_version_refuses_its_tenant_and_says_why(
    kube: KubeClient, cluster: DevCluster | ExistingCluster, namespace: str, router_pool: str,
    tmp_path: Path,
) -> None:
    """An upgrade half done: the CRD already has a field this router does not know (as a newer
    kvfleet's would) and a TenantQuota uses it. The router must not read it as no limits: its
    tenant is refused with a 403 that says why, the TenantQuota's status says it too
    (Ready=False), and the other tenants are served as before."""
    from kvfleet.api.crdgen import build_crd
    from kvfleet.api.tenantquota import TenantQuota

    crd_path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/tenantquotas.kvfleet.io"

    def with_schema(versions: list[dict[str, object]]) -> None:
        crd = kube.request("GET", crd_path)
        crd["spec"]["versions"] = versions
        kube.request("PUT", crd_path, crd)

    newer = json.loads(json.dumps(build_crd(TenantQuota)["spec"]["versions"]))
    newer[0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "burstSeconds"] = {"type": "integer", "description": "(a field of a later version)"}
    quotas = f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenantquotas"
    with_schema(newer)
    router = RouterProcess(cluster.kubeconfig, namespace, tmp_path / "router.log")
    try:
        _key_secret(kube, namespace, "team-a-key", "team-a", KEY)
        kube.request("POST", quotas, {"apiVersion": "kvfleet.io/v1alpha1", "kind": "TenantQuota",
                                      "metadata": {"name": "team-a"}, "spec": {"tenant": "team-a"}})
        later = "sk-e2e-team-c-0123456789abcdef"
        _key_secret(kube, namespace, "team-c-key", "team-c", later)

        def create_with_the_newer_field() -> dict[str, Any] | None:
            # The apiserver serves a changed CRD schema a moment after the PUT: until then it
            # prunes the field, and a pruned one would test nothing. Delete and try again.
            stored = kube.request("POST", quotas, {
                "apiVersion": "kvfleet.io/v1alpha1", "kind": "TenantQuota",
                "metadata": {"name": "team-c"}, "spec": {
                    "tenant": "team-c", "burstSeconds": 5,
                    "limits": {"maxConcurrentRequests": 1}}})
            if stored["spec"].get("burstSeconds") == 5:
                return stored
            kube.request("DELETE", f"{quotas}/team-c")
            return None

        kube.wait_for("the newer field stored as sent", create_with_the_newer_field, 30, 1.0)
        router.wait_ready()
        pool = router_pool  # (a router of one namespace names its pools without it)
        assert chat(router.url, KEY, pool).status_code == 200
        refused = chat(router.url, later, pool)
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["code"] == "tenant_quota_unreadable", error
        assert "burstSeconds" in error["message"] and f"{namespace}/team-c" in error["message"]

        def unready() -> dict[str, str] | None:
            tq = kube.request("GET", f"{quotas}/team-c")
            ready = [c for c in (tq.get("status") or {}).get("conditions", [])
                     if c["type"] == "Ready"]
            return ready[0] if ready and ready[0]["status"] == "False" else None

        condition = kube.wait_for("team-c's TenantQuota Ready=False", unready, 30)
        assert condition["reason"] == "Unreadable" and "burstSeconds" in condition["message"]
        assert chat(router.url, later, pool).status_code == 403  # still, not once
        assert chat(router.url, KEY, pool).status_code == 200
    finally:
        router.stop()
        with_schema(build_crd(TenantQuota)["spec"]["versions"])


def test_with_engine_tls_prompts_reach_the_engines_over_https_only(
    kube: KubeClient, kubectl: Kubectl, cluster: DevCluster | ExistingCluster,
    operator: OperatorProcess, namespace: str, local_node: str, fake_nodes: list[str],  # noqa: F811
    tmp_path: Path,
) -> None:
    """The operator with --engine-tls: the pool's engine serves HTTPS with the certificate the
    operator issued, the router (which pins it) serves clients through it, plain HTTP to the
    engine goes nowhere, and Prometheus still scrapes it."""
    operator.extra_args = ("--engine-tls",)
    operator.restart()
    try:
        kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / "01-modelartifact-smollm2.yaml"))
        with _only_the_local_l4_node(kube, kubectl):
            _create(kube, _local_engine_pool("smol", "smollm2-135m-instruct", namespace))
            _wait_pool(kube, operator, namespace, "smol", _available, "HTTPS pod Ready", 300)
        _key_secret(kube, namespace, "team-a-key", "team-a", KEY)
        kube.request("POST", f"/apis/kvfleet.io/v1alpha1/namespaces/{namespace}/tenantquotas",
                     {"apiVersion": "kvfleet.io/v1alpha1", "kind": "TenantQuota",
                      "metadata": {"name": "team-a"}, "spec": {"tenant": "team-a"}})
        (secret,) = kube.list("Secret", namespace,
                              label_selector="kvfleet.io/router-token-for=smol")
        assert {"token", "tls.crt", "tls.key"} <= set(secret["data"])
        (pod,) = kube.list("Pod", namespace, label_selector="kvfleet.io/pool=smol")
        address = f"{pod['status']['podIP']}:8000"
        with pytest.raises(httpx.HTTPError):  # no plain HTTP at all
            httpx.get(f"http://{address}/health", timeout=5)
        assert httpx.get(f"https://{address}/health", timeout=5, verify=False).status_code \
            == 200
        router = RouterProcess(cluster.kubeconfig, namespace, tmp_path / "router.log")
        try:
            router.wait_ready()
            time.sleep(0.5)  # a first scrape of the engine's load, over HTTPS
            answer = chat(router.url, KEY)
            assert answer.status_code == 200, answer.text
        finally:
            router.stop()
        if cluster.prometheus is not None:
            deadline = time.monotonic() + 30
            while True:
                found = httpx.get(cluster.prometheus.url + "/api/v1/query",
                                  params={"query": f'up{{instance="{address}"}}'},
                                  timeout=10).json()["data"]["result"]
                if found and found[0]["value"][1] == "1":
                    break
                assert time.monotonic() < deadline, f"Prometheus does not scrape it: {found}"
                time.sleep(1)
    finally:
        operator.extra_args = ()
        operator.restart()


def _key_secret(kube: KubeClient, namespace: str, name: str, tenant: str, key: str) -> None:
    kube.request("POST", f"/api/v1/namespaces/{namespace}/secrets", {
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "labels": {"kvfleet.io/tenant": tenant}},
        "data": {"key": base64.b64encode(key.encode()).decode()}})


def test_the_router_install_manifests_are_accepted_by_the_apiserver(
    kubectl: Kubectl, crds: None, namespace: str,  # noqa: F811
) -> None:
    import yaml

    from kvfleet.router.manifests import build_manifests

    manifests = yaml.safe_dump_all(build_manifests(namespace))
    out = kubectl("apply", "--dry-run=server", "-f", "-", input=manifests)
    assert "deployment.apps/kvfleet-router created (server dry run)" in out.stdout
