"""Manifest builders: pure functions from a ServingPool (+ its ModelArtifact) to the objects
that serve it. No I/O; the reconciler decides which of them to apply.

Engine settings reach `kvfleet serve` as env entries of the revision's own Deployment, read as
`$(VAR)` arguments: they are part of the revision (kvfleet.operator.revisions), so the stable
and canary Deployments of a rollout each keep their own, and nothing shared between them can
change one revision's pods under the other.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from kvfleet.api import API_VERSION, ModelArtifact, ServingPool, labels, manifest_hash
from kvfleet.api.quantity import parse_bytes
from kvfleet.api.servingpool import EngineSettings
from kvfleet.capacity import MemoryPlan
from kvfleet.operator import naming, revisions
from kvfleet.operator.placement import (
    GPU_RESOURCE,
    MIB,
    node_affinity,
    node_selector,
    tolerations,
)
from kvfleet.operator.revisions import CPU_THREADS_ENV, RevisionParts, cpu_threads

ENGINE_PORT = labels.ENGINE_PORT
# The engine reads its pool's router token from the Secret mounted as a volume, not from an env
# var read once: the kubelet rewrites the file when the Secret is re-minted and the engine
# follows it, accepting the replaced token for a while (kvfleet.engine.router_token).
ROUTER_TOKEN_FILE_ENV = "KVFLEET_ROUTER_TOKEN_FILE"
ROUTER_TOKEN_KEY = labels.ROUTER_TOKEN_KEY
ENGINE_CERT_KEY, ENGINE_KEY_KEY = labels.ENGINE_CERT_KEY, labels.ENGINE_KEY_KEY
ENGINE_PREVIOUS_CERT_KEY = labels.ENGINE_PREVIOUS_CERT_KEY
ROUTER_TOKEN_VOLUME = "router-token"
ROUTER_TOKEN_DIR = "/var/run/kvfleet/router-token"
ENGINE_PORT_NAME = "http"
# preStop pause: endpoints controllers and routers stop sending before the engine drains
# (for spec.engine.drainSeconds after SIGTERM, `--drain-grace-seconds`).
PRE_STOP_SECONDS = 5
# The kubelet kills after the grace period; it must cover the pause, the drain and the exit.
EXIT_SECONDS = 15
# Env names the engine reads (see the operator report: the serving engine implements the
# sha256 check against KVFLEET_EXPECTED_SHA256).
EXPECTED_SHA256_ENV = "KVFLEET_EXPECTED_SHA256"
MANIFEST_HASH_ENV = "KVFLEET_MANIFEST_HASH"
EXPECTED_TOKENIZER_ENV = "KVFLEET_EXPECTED_TOKENIZER_SHA256"
EXPECTED_TEMPLATE_ENV = "KVFLEET_EXPECTED_CHAT_TEMPLATE_SHA256"
# The artifact's spec.samplingDefaults, as JSON: the engine applies them to requests that leave
# those fields unset (kvfleet.engine.protocol.SamplingDefaults).
SAMPLING_DEFAULTS_ENV = "KVFLEET_SAMPLING_DEFAULTS"
# The model's files and the cache they are fetched into (kvfleet.engine.fetch reads these; a
# unit test holds the names equal): the pod's init container fetches and verifies every file,
# the engine then finds them there.
WEIGHT_FILES_ENV = "KVFLEET_WEIGHT_FILES"
MODEL_CACHE_ENV = "KVFLEET_MODEL_CACHE"
MODEL_CACHE_LIMIT_ENV = "KVFLEET_MODEL_CACHE_LIMIT_BYTES"
MODEL_CACHE_VOLUME = "model-cache"
MODEL_CACHE_PATH = "/var/cache/kvfleet/models"


@dataclass(frozen=True)
class EngineOptions:
    """Operator-wide settings of the pods it creates."""

    image: str = revisions.DEFAULT_ENGINE_IMAGE
    image_pull_policy: str = "IfNotPresent"
    # Where the pods that may reach engines run: the router's namespace (None: the pool's
    # own) and Prometheus' (None: any namespace, by its pods' name label alone).
    router_namespace: str | None = None
    prometheus_namespace: str | None = None
    # Engines serve HTTPS with a certificate of their pool's (in its router-token Secret), which
    # the router pins (--engine-tls): the router token and prompts never cross in the clear.
    tls: bool = False


def _meta(name: str, pool: ServingPool, labels: dict[str, str]) -> dict[str, Any]:
    uid = pool.metadata.uid or ""
    return {
        "name": name,
        "namespace": pool.metadata.namespace,
        "labels": labels,
        "ownerReferences": [
            naming.owner_reference(API_VERSION, "ServingPool", pool.metadata.name, uid)
        ],
    }


def termination_grace_seconds(engine: EngineSettings) -> int:
    return PRE_STOP_SECONDS + engine.drain_seconds + EXIT_SECONDS


def model_cache_bytes(artifact: ModelArtifact) -> int:
    """The model-cache volume's size limit: the artifact's files plus a tenth, whole MiB (a
    file is downloaded in place and renamed, so nothing is held twice)."""
    total = sum(f.size_bytes for f in artifact.spec.weights.files)
    return -(-(total + total // 10) // MIB) * MIB


def _cache_limit(pool: ServingPool, artifact: ModelArtifact) -> int | None:
    """What the cache may hold: the emptyDir's size limit (the pool's, else sized from the
    files); none for a shared claim, whose size is its provisioner's business."""
    cache = pool.spec.pod.model_cache
    if cache is not None and cache.persistent_volume_claim is not None:
        return None
    if cache is not None and cache.empty_dir is not None and cache.empty_dir.size_limit:
        return parse_bytes(cache.empty_dir.size_limit)
    return model_cache_bytes(artifact)


def _cache_volume(pool: ServingPool, artifact: ModelArtifact) -> dict[str, Any]:
    cache = pool.spec.pod.model_cache
    if cache is not None and cache.persistent_volume_claim is not None:
        claim = cache.persistent_volume_claim.claim_name
        return {"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": claim}}
    empty_dir: dict[str, Any] = (cache.empty_dir.to_wire() if cache is not None
                                 and cache.empty_dir is not None else {})
    empty_dir.setdefault("sizeLimit", f"{model_cache_bytes(artifact) // MIB}Mi")
    return {"name": MODEL_CACHE_VOLUME, "emptyDir": empty_dir}


def _model_env(pool: ServingPool, artifact: ModelArtifact) -> list[dict[str, Any]]:
    files = [{"uri": f.uri, "sha256": f.sha256, "sizeBytes": f.size_bytes}
             for f in artifact.spec.weights.files]
    env = [
        {"name": WEIGHT_FILES_ENV, "value": json.dumps(files, separators=(",", ":"))},
        {"name": MODEL_CACHE_ENV, "value": MODEL_CACHE_PATH},
    ]
    limit = _cache_limit(pool, artifact)
    if limit is not None:
        env.append({"name": MODEL_CACHE_LIMIT_ENV, "value": str(limit)})
    return env


def _pool_env(pool: ServingPool) -> list[dict[str, Any]]:
    """spec.pod.env, after the operator's own (which it may not override: the API refuses
    the reserved names)."""
    return [e.to_wire() for e in pool.spec.pod.env]


def _image(pool: ServingPool, options: EngineOptions) -> dict[str, str]:
    return {"image": revisions.image_of(pool, options.image),
            "imagePullPolicy": pool.spec.pod.image_pull_policy or options.image_pull_policy}


_CACHE_MOUNT = {"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_PATH}


def _fetch_container(pool: ServingPool, artifact: ModelArtifact,
                     options: EngineOptions) -> dict[str, Any]:
    """The init step: every file of the manifest into the cache, verified, before the engine
    starts; a bad digest or an unreachable source fails here, named in the pod's status."""
    return {
        "name": "fetch-model",
        **_image(pool, options),
        "command": ["kvfleet", "artifact", "fetch", "--from-env"],
        "env": _model_env(pool, artifact) + _pool_env(pool),
        "volumeMounts": [_CACHE_MOUNT],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _resources(pool: ServingPool, plan: MemoryPlan | None) -> dict[str, Any]:
    """GPUs from spec.gpu (extended resources need requests == limits); CPU and memory from
    spec.pod.resources, the memory request defaulting to the ledger's weights plus 1 GiB
    (the engine holds the weights in host memory while it loads them)."""
    gpus = str(pool.spec.gpu.count)
    settings = pool.spec.pod.resources
    requests: dict[str, str] = {GPU_RESOURCE: gpus}
    limits: dict[str, str] = {GPU_RESOURCE: gpus}
    if settings is not None and settings.requests is not None:
        requests.update(settings.requests.to_wire())
    if settings is not None and settings.limits is not None:
        limits.update(settings.limits.to_wire())
    if "memory" not in requests and plan is not None and plan.weight_bytes is not None:
        request = -(-(plan.weight_bytes + 1024 * MIB) // MIB)
        if "memory" in limits:  # never above the pool's own cap
            request = min(request, parse_bytes(limits["memory"]) // MIB)
        requests["memory"] = f"{request}Mi"
    return {"requests": requests, "limits": limits}


def _container(
    pool: ServingPool,
    artifact: ModelArtifact,
    parts: RevisionParts,
    settings: dict[str, str],
    plan: MemoryPlan | None,
    options: EngineOptions,
) -> dict[str, Any]:
    manifest_hash = parts.artifact
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": MANIFEST_HASH_ENV, "value": manifest_hash},
        *_model_env(pool, artifact),
        {"name": EXPECTED_TOKENIZER_ENV, "value": artifact.spec.tokenizer.sha256},
        {"name": EXPECTED_TEMPLATE_ENV,
         "value": artifact.spec.chat_template.sha256 if artifact.spec.chat_template else ""},
        {
            "name": EXPECTED_SHA256_ENV,
            "value": ",".join(f.sha256 for f in artifact.spec.weights.files),
        },
    ]
    env.append({"name": ROUTER_TOKEN_FILE_ENV, "value": f"{ROUTER_TOKEN_DIR}/{ROUTER_TOKEN_KEY}"})
    defaults = artifact.spec.sampling_defaults
    if defaults is not None and defaults.to_wire():
        env.append({"name": SAMPLING_DEFAULTS_ENV,
                    "value": json.dumps(defaults.to_wire(), sort_keys=True)})
    if options.tls:
        env += [{"name": "KVFLEET_TLS_CERT_FILE", "value": f"{ROUTER_TOKEN_DIR}/{ENGINE_CERT_KEY}"},
                {"name": "KVFLEET_TLS_KEY_FILE", "value": f"{ROUTER_TOKEN_DIR}/{ENGINE_KEY_KEY}"}]
    env += [{"name": key, "value": settings[key]} for key in sorted(settings)]
    args = [
        "--host=$(POD_IP)",
        f"--port={ENGINE_PORT}",
        f"--served-model-name={artifact.metadata.name}",
        f"--revision={naming.short_revision(parts.revision)}",
        "--block-size=$(KVFLEET_BLOCK_SIZE)",
        "--max-num-batched-tokens=$(KVFLEET_MAX_NUM_BATCHED_TOKENS)",
        "--max-num-seqs=$(KVFLEET_MAX_NUM_SEQS)",
        "--long-prefill-token-threshold=$(KVFLEET_LONG_PREFILL_TOKEN_THRESHOLD)",
        "$(KVFLEET_PREFIX_CACHING)",
        "--kv-cache-dtype=$(KVFLEET_KV_CACHE_DTYPE)",
        "--drain-grace-seconds=$(KVFLEET_DRAIN_GRACE_SECONDS)",
    ]
    if "KVFLEET_MAX_MODEL_LEN" in settings:
        args.append("--max-model-len=$(KVFLEET_MAX_MODEL_LEN)")
    if plan is not None and plan.kv_blocks_per_rank is not None:
        args.append(f"--num-kv-blocks={plan.kv_blocks_per_rank}")
    threads = cpu_threads(pool)
    if threads is not None:
        env.append({"name": CPU_THREADS_ENV, "value": str(threads)})
    env += _pool_env(pool)
    scheme = "HTTPS" if options.tls else "HTTP"  # (a kubelet does not verify it)
    return {
        "name": "engine",
        **_image(pool, options),
        "command": ["kvfleet", "serve"],
        "args": args,
        "env": env,
        "ports": [{"name": ENGINE_PORT_NAME, "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "resources": _resources(pool, plan),
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": ENGINE_PORT_NAME, "scheme": scheme},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": ENGINE_PORT_NAME, "scheme": scheme},
            # Loading weights can take minutes; /health answers during LOADING, so this only
            # catches a hung server.
            "initialDelaySeconds": 30,
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "volumeMounts": [_CACHE_MOUNT, {"name": ROUTER_TOKEN_VOLUME, "mountPath": ROUTER_TOKEN_DIR,
                                        "readOnly": True}],
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        # The engine's last log lines (e.g. a sha256 mismatch at load) become the container's
        # termination message, which the operator surfaces on the pool.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def build_deployment(
    pool: ServingPool,
    artifact: ModelArtifact,
    plan: MemoryPlan | None,
    options: EngineOptions = EngineOptions(),
) -> dict[str, Any]:
    """The Deployment serving the revision of the pool's spec with `artifact`: named and
    labelled by the revision, annotated with its parts (kvfleet.operator.revisions)."""
    name = pool.metadata.name
    parts = revisions.parts_of(pool, manifest_hash(artifact.spec), options.image)
    revision = parts.revision
    settings = revisions.engine_settings(pool)
    labels = naming.revision_labels(name, artifact.metadata.name, revision)
    selector = naming.revision_selector(name, revision)
    meta = _meta(naming.deployment_name(name, revision), pool, labels)
    identity = {naming.REVISION_ANNOTATION: revision,
                naming.MANIFEST_HASH_ANNOTATION: parts.artifact,
                revisions.SETTINGS_ANNOTATION: parts.settings_annotation()}
    meta["annotations"] = identity
    pod_spec: dict[str, Any] = {
        "initContainers": [_fetch_container(pool, artifact, options)],
        "containers": [_container(pool, artifact, parts, settings, plan, options)],
        "volumes": [_cache_volume(pool, artifact), {
            "name": ROUTER_TOKEN_VOLUME,
            "secret": {"secretName": naming.router_secret_name(name), "defaultMode": 0o400,
                       "items": [{"key": k, "path": k} for k in (
                           (ROUTER_TOKEN_KEY, ENGINE_CERT_KEY, ENGINE_KEY_KEY) if options.tls
                           else (ROUTER_TOKEN_KEY,))]}}],
        "nodeSelector": node_selector(pool.spec),
        "tolerations": tolerations(pool.spec),
        "terminationGracePeriodSeconds": termination_grace_seconds(pool.spec.engine),
        "enableServiceLinks": False,
    }
    affinity = node_affinity(pool.spec)
    if affinity is not None:
        pod_spec["affinity"] = affinity
    pod = pool.spec.pod
    if pod.priority_class_name:
        pod_spec["priorityClassName"] = pod.priority_class_name
    if pod.service_account_name:
        pod_spec["serviceAccountName"] = pod.service_account_name
    if pod.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in pod.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": pool.spec.replicas,
            "selector": {"matchLabels": selector},
            # Surge by one, never below the declared count: GPUs are scarce, capacity is not.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    # The pool's own labels and annotations first: the operator's win (the
                    # API refuses its label prefixes anyway).
                    "labels": {**pod.labels, **labels},
                    "annotations": {
                        **pod.annotations,
                        naming.REVISION_ANNOTATION: revision,
                        naming.MANIFEST_HASH_ANNOTATION: parts.artifact,
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(ENGINE_PORT),
                        "prometheus.io/path": "/metrics",
                        "prometheus.io/scheme": "https" if options.tls else "http",
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def build_service(pool: ServingPool) -> dict[str, Any]:
    """One Service per pool over every revision: the router picks endpoints by label."""
    name = pool.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(naming.service_name(name), pool, naming.pool_labels(name)),
        "spec": {
            "selector": naming.pool_selector(name),
            "ports": [
                {
                    "name": ENGINE_PORT_NAME,
                    "port": ENGINE_PORT,
                    "targetPort": ENGINE_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def build_pdb(pool: ServingPool) -> dict[str, Any]:
    """Voluntary disruptions (drains, upgrades) take at most the failover reserve (≥ 1)."""
    name = pool.metadata.name
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(naming.pdb_name(name), pool, naming.pool_labels(name)),
        "spec": {
            "maxUnavailable": max(1, pool.spec.reserves.failover),
            "selector": {"matchLabels": naming.pool_selector(name)},
        },
    }


def build_router_secret(pool: ServingPool, token: str,
                        tls: EngineCertificate | None = None) -> dict[str, Any]:
    """The token the pool's engines want from the router (their mounted file, `kvfleet serve
    --router-token-file`): with it, a request's tenant header is believed; without it, the
    engine refuses. Re-minted (deleted, then made again by the operator), it reaches routers
    and engines without a failed request (kvfleet.engine.router_token). With engine TLS, also
    the engines' certificate and key, and the certificate a renewal replaced (the router
    trusts both while the engines switch)."""
    name = pool.metadata.name
    labels = {**naming.pool_labels(name), naming.ROUTER_TOKEN_LABEL: naming.label_value(name)}
    data = {ROUTER_TOKEN_KEY: token}
    if tls is not None:
        data |= {ENGINE_CERT_KEY: tls.cert, ENGINE_KEY_KEY: tls.key}
        if tls.previous:
            data[ENGINE_PREVIOUS_CERT_KEY] = tls.previous
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(naming.router_secret_name(name), pool, labels),
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


@dataclass(frozen=True, slots=True)
class EngineCertificate:
    """A pool's engine certificate and key (PEM), and the certificate it replaced."""

    cert: str
    key: str
    previous: str = ""


def engine_certificate_of(secret: dict[str, Any] | None) -> EngineCertificate | None:
    data = (secret or {}).get("data") or {}
    try:
        found = {k: base64.b64decode(data[k]).decode() for k in (ENGINE_CERT_KEY, ENGINE_KEY_KEY)
                 if k in data}
        previous = base64.b64decode(data.get(ENGINE_PREVIOUS_CERT_KEY, "")).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    if len(found) < 2:
        return None
    return EngineCertificate(found[ENGINE_CERT_KEY], found[ENGINE_KEY_KEY], previous)


def router_token_of(secret: dict[str, Any] | None) -> str | None:
    """The token an existing router Secret holds, if it holds a usable one."""
    encoded = ((secret or {}).get("data") or {}).get(ROUTER_TOKEN_KEY)
    try:
        token = base64.b64decode(encoded, validate=True).decode() if encoded else ""
    except (ValueError, UnicodeDecodeError):
        return None
    return token if len(token) >= 32 else None


def build_network_policy(pool: ServingPool, options: EngineOptions = EngineOptions()
                         ) -> dict[str, Any]:
    """Engine pods take traffic only from router pods of the router's namespace and from
    Prometheus (its /metrics scrapes), on the engine port. A peer is a namespace by name (the
    `kubernetes.io/metadata.name` label the API server sets, which nobody can set otherwise)
    and a pod label in it: a pod elsewhere that labels itself a router is not one. Enforced
    where the cluster's network plugin implements NetworkPolicy."""
    name = pool.metadata.name

    def pods_named(app: str, namespace: str | None) -> dict[str, Any]:
        where = {"matchLabels": {"kubernetes.io/metadata.name": namespace}} if namespace \
            else {}
        return {"namespaceSelector": where,
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": app}}}

    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(naming.network_policy_name(name), pool, naming.pool_labels(name)),
        "spec": {
            "podSelector": {"matchLabels": naming.pool_selector(name)},
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [pods_named(naming.ROUTER_APP,
                                    options.router_namespace or pool.metadata.namespace),
                         pods_named("prometheus", options.prometheus_namespace)],
                "ports": [{"port": ENGINE_PORT_NAME, "protocol": "TCP"}],
            }],
        },
    }
