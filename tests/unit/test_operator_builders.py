"""Manifest builders: what a platform engineer would check in `kubectl get deploy -o yaml`."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import pytest
from operator_fakes import artifact, as_observed, pool, revision

from kvfleet.api import manifest_hash
from kvfleet.capacity import plan_for_pool
from kvfleet.compat import default_matrix
from kvfleet.operator import builders, naming, revisions
from kvfleet.operator.drift import has_drifted


def _deployment(**sets: Any) -> dict[str, Any]:
    p, a = pool(**sets), artifact()
    product = default_matrix().gpu_products.get(p.spec.gpu.product)
    plan = plan_for_pool(a.spec, p.spec, product.memory_bytes if product else None)
    return builders.build_deployment(p, a, plan)


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def test_deployment_requests_gpus_and_selects_the_product() -> None:
    d = _deployment(spec__gpu__count=2)
    pod_spec = d["spec"]["template"]["spec"]
    resources = _container(d)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == "2"
    assert resources["limits"]["nvidia.com/gpu"] == "2"
    assert pod_spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod_spec[
        "tolerations"
    ]
    assert "affinity" not in pod_spec  # no memory stated: the product alone decides


def test_gpu_memory_becomes_a_lower_bound_on_the_mib_label() -> None:
    d = _deployment(spec__gpu__memory="22Gi")
    terms = d["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [
        {
            "matchExpressions": [
                {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": [str(22 * 1024 - 1)]}
            ]
        }
    ]


def test_readiness_grace_and_engine_command() -> None:
    d = _deployment()
    c = _container(d)
    assert c["command"] == ["kvfleet", "serve"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > 30 + builders.PRE_STOP_SECONDS  # the default drain, and the pause before
    assert "--drain-grace-seconds=$(KVFLEET_DRAIN_GRACE_SECONDS)" in c["args"]
    assert d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_a_pool_with_long_generations_drains_longer_and_the_kubelet_waits_for_it() -> None:
    """spec.engine.drainSeconds reaches the engine (its SIGTERM drain) and the pod's grace
    period, which must outlast the preStop pause plus the drain, or the kubelet cuts the
    streams the drain was waiting for."""
    p = pool(spec__engine__drainSeconds=600)
    assert revisions.engine_settings(p)["KVFLEET_DRAIN_GRACE_SECONDS"] == "600"
    grace = _deployment(spec__engine__drainSeconds=600)["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]
    assert grace == builders.PRE_STOP_SECONDS + 600 + builders.EXIT_SECONDS
    with pytest.raises(ValueError, match="drainSeconds"):
        pool(spec__engine__drainSeconds=3601)


def test_labels_owner_and_expected_sha256() -> None:
    a = artifact()
    digest = manifest_hash(a.spec)
    d = _deployment()
    rev = revision(a)
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert labels[naming.POOL_LABEL] == "chat"
    assert labels[naming.MODEL_LABEL] == "qwen3-8b"
    assert labels[naming.REVISION_LABEL] == rev[:12]
    assert d["metadata"]["annotations"][naming.MANIFEST_HASH_ANNOTATION] == digest
    assert d["metadata"]["annotations"][naming.REVISION_ANNOTATION] == rev
    assert d["metadata"]["name"] == f"chat-{rev[:12]}"
    assert revisions.parts_of_deployment(d) == revisions.parts_of(
        pool(), digest, builders.EngineOptions().image)
    owner = d["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "ServingPool",
        "chat",
        "uid-chat",
        True,
    )
    env = {e["name"]: e.get("value") for e in _container(d)["env"]}
    assert env[builders.EXPECTED_SHA256_ENV] == ",".join(f.sha256 for f in a.spec.weights.files)
    assert env[builders.MANIFEST_HASH_ENV] == digest
    assert env[builders.EXPECTED_TOKENIZER_ENV] == a.spec.tokenizer.sha256
    assert a.spec.chat_template is not None
    assert env[builders.EXPECTED_TEMPLATE_ENV] == a.spec.chat_template.sha256


def test_every_args_variable_is_the_revisions_own_env() -> None:
    """The settings are literal env entries of the revision's Deployment: nothing shared
    between a rollout's stable and canary (a ConfigMap once was) can change one under the
    other."""
    c = _container(_deployment())
    assert not [e for e in c["env"] if "configMapKeyRef" in e.get("valueFrom", {})]
    defined = {e["name"] for e in c["env"]}
    used = {m for arg in c["args"] for m in re.findall(r"\$\(([A-Z0-9_]+)\)", arg)}
    assert used <= defined


def test_an_engine_setting_change_is_a_new_revision() -> None:
    before, after = _deployment(), _deployment(spec__engine__maxBatchedTokens=4096)
    revision = naming.REVISION_ANNOTATION
    assert before["metadata"]["annotations"][revision] != \
        after["metadata"]["annotations"][revision]
    assert before["metadata"]["name"] != after["metadata"]["name"]
    assert f"--revision={after['metadata']['annotations'][revision][:12]}" in \
        _container(after)["args"]


def test_args_parse_with_the_engine_command_line() -> None:
    serve = pytest.importorskip("kvfleet.commands.serve")
    p, a = pool(), artifact()
    plan = plan_for_pool(a.spec, p.spec, default_matrix().gpu_products["NVIDIA-L4"].memory_bytes)
    settings = revisions.engine_settings(p)
    args = _container(builders.build_deployment(p, a, plan))["args"]
    values = {**settings, "POD_IP": "10.1.2.3"}
    expanded = [re.sub(r"\$\(([A-Z0-9_]+)\)", lambda m: values[m.group(1)], x) for x in args]
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    ns = parser.parse_args(["serve", *expanded])
    assert ns.host == "10.1.2.3"
    assert ns.max_num_batched_tokens == 8192
    assert ns.max_model_len == 8192
    assert ns.num_kv_blocks == plan.kv_blocks_per_rank
    assert ns.enable_prefix_caching is True
    assert ns.kv_cache_dtype == "auto" and ns.device == "auto"


@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize(("field", "variable", "option"), [
    ("int8Activations", "KVFLEET_INT8_ACTIVATIONS", "int8_activations"),
    ("int16Activations", "KVFLEET_INT16_ACTIVATIONS", "int16_activations"),
])
def test_activation_rounding_reaches_the_engine_through_its_env(
    enabled: bool, field: str, variable: str, option: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve = pytest.importorskip("kvfleet.commands.serve")
    settings = revisions.engine_settings(pool(**{f"spec__engine__{field}": enabled}))
    assert settings[variable] == ("1" if enabled else "0")
    # The pod gets every setting as an environment variable; serve reads this one as the
    # default of its option.
    monkeypatch.setenv(variable, settings[variable])
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    assert getattr(parser.parse_args(["serve"]), option) is enabled
    before = _deployment()["metadata"]["name"]
    after = _deployment(**{f"spec__engine__{field}": True})["metadata"]["name"]
    assert before != after  # switching it is a new revision


@pytest.mark.parametrize(("tokens", "value", "parsed"),
                         [(None, "auto", None), (0, "0", 0), (256, "256", 256)])
def test_the_prefill_cap_reaches_the_engine_through_its_env(
    tokens: int | None, value: str, parsed: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve = pytest.importorskip("kvfleet.commands.serve")
    overrides: dict[str, Any] = ({} if tokens is None
                                 else {"spec__engine__prefillTokensPerStep": tokens})
    settings = revisions.engine_settings(pool(**overrides))
    assert settings["KVFLEET_MAX_PREFILL_TOKENS_PER_STEP"] == value
    monkeypatch.setenv("KVFLEET_MAX_PREFILL_TOKENS_PER_STEP", value)
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    assert parser.parse_args(["serve"]).max_prefill_tokens_per_step == parsed
    for wrong in ("-1", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--max-prefill-tokens-per-step", wrong])


def test_service_and_pdb_select_the_pool() -> None:
    p = pool(spec__reserves={"failover": 2})
    service, pdb = builders.build_service(p), builders.build_pdb(p)
    assert service["spec"]["selector"] == naming.pool_selector("chat")
    assert service["spec"]["ports"][0]["port"] == builders.ENGINE_PORT
    assert pdb["spec"]["maxUnavailable"] == 2
    assert pdb["spec"]["selector"]["matchLabels"] == naming.pool_selector("chat")


def test_long_pool_names_stay_dns_labels_and_distinct() -> None:
    base = "a" * 70
    first, second = (
        naming.deployment_name(base + "x", "f" * 64),
        naming.deployment_name(base + "y", "f" * 64),
    )
    assert len(first) <= 63 and len(second) <= 63 and first != second
    assert first.endswith("-" + "f" * 12)


def test_drift_ignores_server_defaults_but_not_owned_fields() -> None:
    d = _deployment()
    observed = as_observed(d)
    assert has_drifted(d, observed) is None
    observed["spec"]["replicas"] = 5
    assert has_drifted(d, observed) == ".spec.replicas"
    observed = as_observed(d)
    observed["spec"]["template"]["spec"]["containers"][0]["args"].append("--max-num-seqs=1")
    assert has_drifted(d, observed) == ".spec.template.spec.containers[0].args"
    observed = as_observed(d)
    del observed["metadata"]["labels"][naming.POOL_LABEL]
    assert has_drifted(d, observed) == f"metadata.labels.{naming.POOL_LABEL}"


def test_each_revision_carries_its_own_kv_plan() -> None:
    """The KV block count depends on the artifact, so it is in each revision's Deployment."""
    p, a = pool(), artifact()
    plan = plan_for_pool(a.spec, p.spec, default_matrix().gpu_products["NVIDIA-L4"].memory_bytes)
    args = _container(builders.build_deployment(p, a, plan))["args"]
    assert f"--num-kv-blocks={plan.kv_blocks_per_rank}" in args


def test_an_init_container_fetches_the_manifest_into_the_model_cache() -> None:
    """Every pod fetches and verifies the artifact's files before the engine starts (the
    init step), into an emptyDir sized from the files; both containers mount it and read the
    same files, cache and limit from env, under the names the engine reads."""
    from kvfleet.engine import fetch

    a = artifact()
    spec = _deployment()["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    assert init["command"] == ["kvfleet", "artifact", "fetch", "--from-env"]
    volume, _token = spec["volumes"]
    total = sum(f.size_bytes for f in a.spec.weights.files)
    limit = builders.model_cache_bytes(a)
    assert total < limit <= total * 1.1 + 2**20 and limit % 2**20 == 0
    assert volume == {"name": "model-cache", "emptyDir": {"sizeLimit": f"{limit // 2**20}Mi"}}
    for container in (init, spec["containers"][0]):
        assert container["volumeMounts"][0] == {"name": "model-cache",
                                                "mountPath": builders.MODEL_CACHE_PATH}
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert fetch.files_from_json(json.loads(env[fetch.FILES_ENV])) == [
            fetch.FileSpec(f.uri, f.sha256, f.size_bytes) for f in a.spec.weights.files]
        assert env[fetch.CACHE_ENV] == builders.MODEL_CACHE_PATH
        assert env[fetch.CACHE_LIMIT_ENV] == str(limit)
    assert "--model" not in " ".join(spec["containers"][0]["args"])  # found from env
