"""A revision: everything that changes what an engine pod answers or how fast it answers.

Its identity hashes three parts: the artifact's manifest hash, the engine image (the pool's
`spec.pod.image`, else the operator's default), and the engine settings as `kvfleet serve`
receives them (spec.engine, the CPU threads or CPU limit, the GPU model, count and memory,
spec.pod.env; workspace and safety margin size the KV cache). A change
of any part is a new revision, with its own Deployment: on a pool a Rollout governs, a canary
measured against stable (an operator upgrade whose default image differs included); on an
ungoverned pool, the same rollover an artifact change makes. Replicas, memory and labels are
not parts: they change neither the answers nor the speed of one engine, and apply in place.
So is `drainSeconds`: it says how a pod leaves, not how it serves. Not seen: the contents of a
Secret or ConfigMap an env entry reads (`valueFrom`): the reference is a part, its value not.

An image named by tag is compared by its name: a tag moved to other contents is not seen.
Name images by digest (`repo@sha256:...`) to have every image change measured.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvfleet.api import ModelArtifact, ServingPool, manifest_hash
from kvfleet.api.meta import GROUP
from kvfleet.api.quantity import whole_cpus
from kvfleet.operator import naming

SETTINGS_ANNOTATION = f"{GROUP}/engine-settings"
# The operator's engine image unless `kvfleet operator --engine-image` names another.
DEFAULT_ENGINE_IMAGE = "ghcr.io/kvfleet/kvfleet:0.1.0"
# Threads of the engine's CPU work (`kvfleet serve --cpu-threads`), set from requests.cpu when
# the pool sets no CPU limit: without a CFS quota the engine would size itself to the node's
# every core, and engines packed on a node would all wait on each other's threads.
CPU_THREADS_ENV = "KVFLEET_CPU_THREADS"
# Settings that are the pod's, not the revision's (see the module docstring).
_NOT_PARTS = frozenset({"KVFLEET_DRAIN_GRACE_SECONDS"})


def engine_settings(pool: ServingPool) -> dict[str, str]:
    """One env entry per `kvfleet serve` setting of the pool (values are strings), read as
    `$(VAR)` arguments and flag defaults."""
    engine = pool.spec.engine
    data = {
        "KVFLEET_BLOCK_SIZE": str(engine.block_size),
        "KVFLEET_MAX_NUM_BATCHED_TOKENS": str(engine.max_batched_tokens),
        "KVFLEET_MAX_NUM_SEQS": str(engine.max_running_requests),
        "KVFLEET_LONG_PREFILL_TOKEN_THRESHOLD": str(
            engine.chunked_prefill_size or engine.max_batched_tokens
        ),
        "KVFLEET_PREFIX_CACHING": "--enable-prefix-caching"
        if engine.prefix_cache.enabled
        else "--no-enable-prefix-caching",
        "KVFLEET_PREFIX_CACHE_SCOPE": engine.prefix_cache.scope.value,
        "KVFLEET_KV_CACHE_DTYPE": engine.kv_cache_dtype.value,
        # Read by `kvfleet serve` as the defaults of --int8-activations,
        # --int16-activations and --max-prefill-tokens-per-step.
        "KVFLEET_INT8_ACTIVATIONS": "1" if engine.int8_activations else "0",
        "KVFLEET_INT16_ACTIVATIONS": "1" if engine.int16_activations else "0",
        "KVFLEET_MAX_PREFILL_TOKENS_PER_STEP": "auto" if engine.prefill_tokens_per_step is None
        else str(engine.prefill_tokens_per_step),
        "KVFLEET_DRAIN_GRACE_SECONDS": str(engine.drain_seconds),
    }
    if engine.max_model_length is not None:
        data["KVFLEET_MAX_MODEL_LEN"] = str(engine.max_model_length)
    return data


def cpu_threads(pool: ServingPool) -> int | None:
    """The whole CPUs of requests.cpu when there is no limits.cpu (a limit is a CFS quota,
    which the engine reads itself), else None: the engine decides."""
    settings = pool.spec.pod.resources
    if settings is None or settings.requests is None or not settings.requests.cpu:
        return None
    if settings.limits is not None and settings.limits.cpu:
        return None
    return whole_cpus(settings.requests.cpu)


def image_of(pool: ServingPool, default_image: str) -> str:
    return pool.spec.pod.image or default_image


@dataclass(frozen=True)
class RevisionParts:
    artifact: str  # the ModelArtifact's manifest hash
    image: str
    settings: tuple[tuple[str, str], ...]  # (name, value), sorted

    @property
    def revision(self) -> str:
        document = {"artifact": self.artifact, "image": self.image,
                    "settings": dict(self.settings)}
        text = json.dumps(document, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def settings_annotation(self) -> str:
        return json.dumps(dict(self.settings), sort_keys=True, separators=(",", ":"))


def parts_of(pool: ServingPool, manifest_hash: str, default_image: str) -> RevisionParts:
    """The revision a pool's spec asks for, serving the artifact of `manifest_hash`."""
    settings = {k: v for k, v in engine_settings(pool).items() if k not in _NOT_PARTS}
    threads = cpu_threads(pool)
    if threads is not None:
        settings[CPU_THREADS_ENV] = str(threads)
    resources = pool.spec.pod.resources
    if resources is not None and resources.limits is not None and resources.limits.cpu:
        settings["cpu limit"] = str(resources.limits.cpu)  # (a CFS quota the engine sizes to)
    engine, gpu = pool.spec.engine, pool.spec.gpu
    settings["gpu"] = f"{gpu.count}x {gpu.product}" + (f" {gpu.memory}" if gpu.memory else "")
    settings["kv cache memory"] = f"workspace {engine.workspace}, safety margin " \
        f"{engine.safety_margin}"
    for entry in pool.spec.pod.env:
        wire = entry.to_wire()
        settings[f"env {entry.name}"] = json.dumps(
            {k: v for k, v in wire.items() if k != "name"}, sort_keys=True)
    return RevisionParts(manifest_hash, image_of(pool, default_image),
                         tuple(sorted(settings.items())))


def revision_for(pool: dict[str, Any], artifact: dict[str, Any],
                 default_image: str = DEFAULT_ENGINE_IMAGE) -> str:
    """The revision of a ServingPool manifest serving a ModelArtifact manifest: what the
    operator (with `default_image`) will write to the pool's status.revision, known before."""
    spec = ModelArtifact.model_validate(artifact).spec
    return parts_of(ServingPool.model_validate(pool), manifest_hash(spec), default_image).revision


def parts_of_deployment(deployment: dict[str, Any]) -> RevisionParts | None:
    """The parts a revision's Deployment was built from; None for one that does not say (an
    operator before revisions had parts built it: its revision was the manifest hash)."""
    annotations = deployment.get("metadata", {}).get("annotations") or {}
    manifest, text = annotations.get(naming.MANIFEST_HASH_ANNOTATION), annotations.get(
        SETTINGS_ANNOTATION)
    image = image_of_deployment(deployment)
    if not isinstance(manifest, str) or not isinstance(text, str) or not isinstance(image, str):
        return None
    try:
        settings = json.loads(text)
    except ValueError:
        return None
    if not isinstance(settings, dict):
        return None
    return RevisionParts(manifest, image, tuple(sorted(
        (str(k), str(v)) for k, v in settings.items())))


def image_of_deployment(deployment: dict[str, Any]) -> str | None:
    """The engine container's image (any operator's Deployment has one)."""
    containers = (((deployment.get("spec") or {}).get("template") or {}).get("spec")
                  or {}).get("containers") or []
    image = next((c.get("image") for c in containers if c.get("name") == "engine"), None)
    return image if isinstance(image, str) else None


def describe_change(old: RevisionParts | None, new: RevisionParts, artifact: str) -> str:
    """What a new revision changes against the serving one, for events and statuses: e.g.
    "settings KVFLEET_KV_CACHE_DTYPE auto -> fp8", "image a -> b", "artifact smol-v2"."""
    if old is None:
        return f"artifactRef is now {artifact}"
    changes = []
    if old.artifact != new.artifact:
        changes.append(f"artifact {artifact} ({naming.short_revision(new.artifact)})")
    if old.image != new.image:
        changes.append(f"image {old.image} -> {new.image}")
    before, after = dict(old.settings), dict(new.settings)
    settings = [f"{key} {before.get(key, '(unset)')} -> {after.get(key, '(unset)')}"
                for key in sorted(before.keys() | after.keys())
                if before.get(key) != after.get(key)]
    if settings:
        changes.append("settings " + ", ".join(settings))
    return "; ".join(changes) or f"artifactRef is now {artifact}"
