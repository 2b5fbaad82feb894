"""`kvfleet dev-cluster demo`: a rollout a newcomer can watch, on this machine.

The dev cluster (no fake L4s: the local node's GPUs really run engines), the operator,
the router as a pod, Prometheus scraping it, three revisions of the embedded SmolLM2 and a
little synthetic traffic. The demo then does what a platform team does in Git: it changes the
pool's artifactRef to a good revision (shadow, 50 %, 100 %, promoted), then to a slow one (its
engines take 1 s per token: rolled back at the first analysed step). Meanwhile, in another
shell: `kubectl get servingpools,rollouts -n demo -w`. Ctrl-C stops everything it started.

The pieces (revisions, policy, router pod, traffic) are shared with the rollout e2e tests.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvfleet.api.crdgen import RESOURCES, build_crd
from kvfleet.api.labels import ROUTER_APP
from kvfleet.devcluster.kube import JsonObj, KubeClient
from kvfleet.devcluster.prometheus import SCRAPE_INTERVAL_S

POOL = "smol"
TENANT_KEY = "sk-demo-team-a-0123456789abcdef"
SMOLLM2 = Path(__file__).resolve().parents[2] / "examples" / "01-modelartifact-smollm2.yaml"


def smollm2_revision(name: str, top_k: int, namespace: str) -> JsonObj:
    """The embedded SmolLM2 under another name; its own sampling default makes it another
    revision (another manifest hash) of the same weights."""
    obj: JsonObj = yaml.safe_load(SMOLLM2.read_text())
    obj["metadata"] = {"name": name, "namespace": namespace}
    obj["spec"]["samplingDefaults"] = {"topK": top_k}
    return obj


def local_pool(name: str, artifact: str, namespace: str) -> JsonObj:
    """One replica on an L4 sized for a local engine process: a 1 GiB "GPU" keeps the
    planned KV cache small, since the local engine allocates it in RAM. One CPU each: a
    rollout runs two revisions' engines on the same few cores, and engines that each used
    every core served a third as much between them (bench/shared_host.py)."""
    return {
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "ServingPool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "artifactRef": {"name": artifact}, "replicas": 1,
            "gpu": {"product": "NVIDIA-L4", "count": 1, "memory": "1Gi"},
            "engine": {"maxModelLength": 2048, "maxBatchedTokens": 512, "workspace": "64Mi",
                       "safetyMargin": "64Mi"},
            "slos": {"ttftP95Seconds": 1.5, "errorRate": 0.05},
            "pod": {"resources": {"limits": {"cpu": "1"}}},
        },
    }


def rollout_policy(pool: str, namespace: str, *, auto_promote: bool = True,
                   shadow: bool = False, max_wait_seconds: int = 120,
                   keep_previous_seconds: int = 0) -> JsonObj:
    """Steps of 50 and 100 %, judged every 4 s on canary-vs-stable TTFT and TPOT p95 and on
    the error rate. Tuned for a busy 2-core host: both revisions are slow there, a bad one far
    more (measured stable TPOT p95 0.03-0.24 s as the load varied: a slow revision's 1 s per
    token stands out at any of them), a just-started engine answers its first
    requests slower (measured: TTFT p95 3x stable's in its first 8 s), hence the warm-up, and
    one slow request can decide a p95 of a few samples (measured: a good canary's TTFT 3.7x
    stable's in one window while the operator restarted), hence two failures to fail."""
    return {
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "Rollout",
        "metadata": {"name": pool, "namespace": namespace},
        "spec": {
            "poolRef": {"name": pool},
            # Shadow copies are judged on their error rate (no TTFT/TPOT series for them).
            **({"shadow": {"percent": 50, "durationSeconds": 6}} if shadow else {}),
            "steps": [{"weight": 50}, {"weight": 100}],
            "analysis": {
                "intervalSeconds": 4, "warmupSeconds": 10, "maxWaitSeconds": max_wait_seconds,
                "failureLimit": 2, "scrapeDelaySeconds": SCRAPE_INTERVAL_S + 1,
                "metrics": [
                    {"name": "ttft", "slo": "TTFTP95", "versusStable": True, "threshold": 5.0,
                     "minSamples": 12},
                    {"name": "tpot", "slo": "TPOTP95", "versusStable": True, "threshold": 3.0,
                     "minSamples": 12},
                    {"name": "errors", "slo": "ErrorRate", "minSamples": 12}],
                # Every request probed (the demo's answers are 4 tokens): a window of a few
                # seconds has its 12 greedy comparisons.
                "outputAgreement": {"probePercent": 100, "minProbes": 12},
                # Per prompt-length class, as noise-tolerant as the TTFT ratio above: a class
                # fails only 5x and a second over stable.
                "byPromptLength": {"maxRatio": 5.0, "minSamples": 12,
                                   "minDifferenceSeconds": 1.0}},
            "drainSeconds": 3,
            # Promoted once the steps pass: a demo shows the gates in minutes. A fleet's
            # rollouts keep the default bake (300 s of live traffic before stable goes).
            "bakeSeconds": 0,
            # The old revision goes at promotion here; a fleet keeps it 600 s (the default)
            # so that `kvfleet rollout undo` is a scale-up, not a cold start.
            "keepPreviousSeconds": keep_previous_seconds,
            "autoPromote": auto_promote,
        },
    }


def slow_fault(revision: str) -> str:
    """$KVFLEET_ENGINE_FAULTS making `revision`'s engines take 1 s more per token."""
    return f"{revision[:12]}:token_delay=1.0"


def stream_error_fault(revision: str, rate: float = 0.2) -> str:
    """$KVFLEET_ENGINE_FAULTS making `rate` of `revision`'s streams end with an error inside
    their HTTP 200."""
    return f"{revision[:12]}:stream_error_rate={rate}"


def long_prompt_fault(revision: str) -> str:
    """$KVFLEET_ENGINE_FAULTS making `revision` slow on long prompts only: 20 ms more per
    prompt token over 600 (a `Traffic` long prompt waits some 14 s more)."""
    return f"{revision[:12]}:long_prompt_delay=0.02,long_prompt_tokens=600"


# What `Traffic` asks: 64 different chats. Answer agreement is judged on the probes of the
# traffic there is; near-identical prompts ("Say hi to N") made a wrong-weights canary agree
# with stable on every probe of a window where N's digits happened to suit it, and pass.
TOPICS = ["Kubernetes", "the French Revolution", "photosynthesis", "a binary search",
          "coffee", "the moon landing", "TCP handshakes", "bread baking", "volcanoes",
          "jazz", "the Python GIL", "tax returns", "marathon training", "black holes",
          "chess openings", "compound interest"]
ASKS = ["Explain {} in two sentences.", "Write a haiku about {}.",
        "List three facts about {}.", "What is the most common mistake people make with {}?"]


def chat_prompt(n: int) -> str:
    """The `n`th of the 64 chats (ask-major, so consecutive ones change topic)."""
    return ASKS[(n // len(TOPICS)) % len(ASKS)].format(TOPICS[n % len(TOPICS)])


# A long prompt of `Traffic(long_every=N)`: some 1300 tokens of SmolLM2's tokenizer.
LONG_FILLER = "The quick brown fox jumps over the lazy dog. " * 130


def tenant_quota(namespace: str) -> JsonObj:
    """Tenant team-a's TenantQuota, with room to spare."""
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "TenantQuota",
            "metadata": {"name": "team-a", "namespace": namespace},
            "spec": {"tenant": "team-a", "limits": {"requestsPerMinute": 100000}}}


def tenant_key(kube: KubeClient, namespace: str, key: str = TENANT_KEY) -> None:
    """Tenant team-a's API key Secret (kept out of Git in a GitOps setup)."""
    kube.create({"apiVersion": "v1", "kind": "Secret",
                 "metadata": {"name": "team-a-key", "namespace": namespace,
                              "labels": {"kvfleet.io/tenant": "team-a"}},
                 "data": {"key": base64.b64encode(key.encode()).decode()}})


def tenant(kube: KubeClient, namespace: str, key: str = TENANT_KEY) -> None:
    """Tenant team-a: its API key Secret and its TenantQuota."""
    tenant_key(kube, namespace, key)
    kube.create(tenant_quota(namespace))


def router_on_node(kube: KubeClient, namespace: str, node: str, timeout: float = 90,
                   redis_secret: str | None = None) -> str:
    """The router's install manifests (`redis_secret`: as `--redis-secret`) with its pod
    pinned to `node` (a local node: its pods really run); its URL once Ready."""
    from kvfleet.operator.placement import tolerations
    from kvfleet.router.manifests import PORT, build_manifests

    for obj in build_manifests(namespace, redis_secret=redis_secret):
        if obj["kind"] == "Deployment":
            pod_spec = obj["spec"]["template"]["spec"]
            pod_spec["nodeName"] = node
            pod_spec["tolerations"] = tolerations()
        kube.create(obj)

    def ready() -> str | None:
        for pod in kube.list("Pod", namespace, label_selector=f"app.kubernetes.io/name="
                             f"{ROUTER_APP}"):
            conditions = (pod.get("status") or {}).get("conditions", [])
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                return f"http://{pod['status']['podIP']}:{PORT}"
        return None

    return kube.wait_for("the router pod Ready", ready, timeout)


def stream_problem(text: str) -> str | None:
    """What is wrong with a streamed answer, or None: every frame must be JSON without an
    `error` member or a `finish_reason` "error", and the last must be `[DONE]`. The frames
    are parsed, not searched: a generated token that reads `error` is a delta like any
    other."""
    frames = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    if not frames or frames[-1] != "[DONE]":
        return "no [DONE] at the end"
    for frame in frames[:-1]:
        try:
            obj = json.loads(frame)
        except ValueError:
            return f"a frame is not JSON: {frame[:80]}"
        if not isinstance(obj, dict) or "error" in obj:
            return f"an error frame: {frame[:200]}"
        # A failed engine step ends the stream this way, inside the 200.
        if any(isinstance(c, dict) and c.get("finish_reason") == "error"
               for c in obj.get("choices") or []):
            return f"finish_reason error: {frame[:200]}"
    return None


class Traffic:
    """Clients streaming chats through the router (4 tokens each unless `max_tokens` says
    otherwise); each request its own conversation
    (with `long_every` N, every Nth request overall has a long prompt). Counts status codes
    and revisions; keeps what failed, with the revision that answered.

    The long ones are counted over all workers, not per worker: workers that start together
    reached their own Nth request together, so long prompts came in pairs, and a pair sent to
    one revision was twice the share in a short window (a canary meant to be slow on 1
    request in 40 was slow on 2 of its first 38, and its p95 over all requests saw it)."""

    def __init__(self, url: str, key: str = TENANT_KEY, workers: int = 2,
                 model: str = POOL, long_every: int = 0, max_tokens: int = 4) -> None:
        self.url, self.key, self.model, self.long_every = url, key, model, long_every
        self.max_tokens = max_tokens
        self.stop_event = threading.Event()
        self.codes: Counter[str] = Counter()
        self.revisions: Counter[str] = Counter()
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.sent = 0  # requests begun, over all workers (under the lock)
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(workers)]
        for thread in self.threads:
            thread.start()

    def _run(self, worker: int) -> None:
        n = 0
        with httpx.Client(timeout=60) as client:
            while not self.stop_event.is_set():
                n += 1
                prompt = chat_prompt(n + 31 * worker)  # (workers apart: not in lockstep)
                with self.lock:
                    self.sent += 1
                    long = bool(self.long_every) and self.sent % self.long_every == 0
                if long:
                    prompt = f"{LONG_FILLER}\n{prompt}"
                body = {"model": self.model, "max_tokens": self.max_tokens, "stream": True,
                        "user": f"w{worker}-{n}",
                        "messages": [{"role": "user", "content": prompt}]}
                try:
                    with client.stream("POST", self.url + "/v1/chat/completions", json=body,
                                       headers={"authorization": f"Bearer {self.key}"}) as resp:
                        text = resp.read().decode(errors="replace")
                        problem = stream_problem(text) if resp.status_code == 200 else "status"
                        with self.lock:
                            self.codes[str(resp.status_code)] += 1
                            self.revisions[resp.headers.get("x-kvfleet-revision", "?")] += 1
                            if problem is not None:
                                self.failures.append(
                                    f"{resp.status_code} ({problem}) from "
                                    f"{resp.headers.get('x-kvfleet-revision', '?')}: "
                                    f"{text[:400]}")
                except httpx.HTTPError as exc:
                    with self.lock:
                        self.failures.append(f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(70)


def install_crds(kube: KubeClient) -> None:
    for resource in RESOURCES:
        crd = build_crd(resource)
        if kube.get_or_none("CustomResourceDefinition", crd["metadata"]["name"]) is None:
            kube.create(crd)

    def established() -> bool | None:
        for resource in RESOURCES:
            crd = kube.get("CustomResourceDefinition", build_crd(resource)["metadata"]["name"])
            conditions = (crd.get("status") or {}).get("conditions", [])
            if not any(c["type"] == "Established" and c["status"] == "True"
                       for c in conditions):
                return None
        return True

    kube.wait_for("the CRDs Established", established, 60)


def set_artifact(kube: KubeClient, namespace: str, pool: str, artifact: str) -> None:
    """What a merged Git change does: the pool's artifactRef, nothing else."""
    kube.merge_patch("ServingPool", pool, {"spec": {"artifactRef": {"name": artifact}}},
                     namespace)


def watch_rollout(kube: KubeClient, namespace: str, name: str,
                  done: Callable[[JsonObj], bool], timeout: float,
                  say: Callable[[str], None] = print) -> JsonObj:
    """Poll the Rollout until `done`, saying each new message; TimeoutError otherwise."""
    deadline, last = time.monotonic() + timeout, ""
    while True:
        rollout = kube.get("Rollout", name, namespace)
        status = rollout.get("status") or {}
        line = f"{status.get('phase', '-')}: {status.get('message', '')}"
        if line != last:
            say(f"  rollout/{name} {line}")
            last = line
        if done(rollout):
            return rollout
        if time.monotonic() > deadline:
            raise TimeoutError(f"rollout/{name} not done in {timeout:.0f}s: {line}")
        time.sleep(0.5)


def run_demo(kube: KubeClient, kubeconfig: Path, prometheus_url: str | None, node: str,
             operator_start: Callable[[], Any], say: Callable[[str], None] = print,
             namespace: str = "demo") -> None:
    """The story, start to end (the caller owns the cluster and stops what it started)."""
    from kvfleet.engine.faults import FAULTS_ENV
    from kvfleet.operator.revisions import revision_for

    install_crds(kube)
    operator_start()
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    revisions = [smollm2_revision(f"smol-v{i}", 40 + i, namespace) for i in (1, 2, 3)]
    for artifact in revisions:
        kube.create(artifact)
    tenant(kube, namespace)
    pool = local_pool(POOL, "smol-v1", namespace)
    kube.create(pool)
    kube.create(rollout_policy(POOL, namespace, shadow=True))
    say(f"""
Watch it in another shell:
  export KUBECONFIG={kubeconfig}
  kubectl get servingpools,rollouts -n {namespace} -w
  PATH=$PWD/.venv/bin:$PATH kubectl kvfleet rollout status {POOL} -n {namespace}
""")
    say("Starting pool smol on smol-v1 (a real engine process on the local node)…")
    kube.wait_for("pool smol Available", lambda: True if any(
        c.get("type") == "Available" and c.get("status") == "True"
        for c in (kube.get("ServingPool", POOL, namespace).get("status") or {})
        .get("conditions", [])) else None, 300)
    url = router_on_node(kube, namespace, node)
    say(f"Router up at {url}; sending a little traffic as tenant team-a.")
    traffic = Traffic(url, workers=1)
    try:
        say("\n1. artifactRef: smol-v1 -> smol-v2 (a good revision)")
        set_artifact(kube, namespace, POOL, "smol-v2")
        target = revision_for(pool, revisions[1])
        watch_rollout(kube, namespace, POOL, lambda r: (r.get("status") or {}).get(
            "canaryRevision") == target and r["status"].get("phase") in (
            "Promoted", "RolledBack", "Paused"), 300, say)
        slow = revision_for(pool, revisions[2])
        os.environ[FAULTS_ENV] = slow_fault(slow)  # read by the local runner
        say("\n2. artifactRef: smol-v2 -> smol-v3 (its engines take 1 s per token)")
        set_artifact(kube, namespace, POOL, "smol-v3")
        watch_rollout(kube, namespace, POOL, lambda r: (r.get("status") or {}).get(
            "canaryRevision") == slow and r["status"].get("phase") in (
            "Promoted", "RolledBack", "Paused"), 300, say)
    finally:
        traffic.close()
    with traffic.lock:
        say(f"\nClient requests: {dict(traffic.codes)}, failed: {len(traffic.failures)}; "
            f"by revision: {dict(traffic.revisions)}")
