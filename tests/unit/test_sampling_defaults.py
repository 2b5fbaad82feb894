"""A ModelArtifact's samplingDefaults reach the engine and fill only what a request leaves
unset (the real engine: tests/integration/test_serving_openai.py)."""

from __future__ import annotations

import json

import pytest
from operator_fakes import pool
from pydantic import ValidationError

from kvfleet.api.builders import make_artifact
from kvfleet.engine import protocol
from kvfleet.engine.protocol import ChatCompletionRequest, CompletionRequest, SamplingDefaults
from kvfleet.operator import builders

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_defaults_fill_only_the_fields_a_request_leaves_unset() -> None:
    defaults = SamplingDefaults.model_validate(
        {"temperature": 0.2, "topP": 0.9, "topK": 20, "maxTokens": 64})
    bare = defaults.apply(ChatCompletionRequest.model_validate(CHAT))
    assert (bare.temperature, bare.top_p, bare.top_k, bare.max_tokens) == (0.2, 0.9, 20, 64)
    own = defaults.apply(ChatCompletionRequest.model_validate(
        {**CHAT, "temperature": 1.0, "top_k": -1, "max_completion_tokens": 5}))
    assert (own.temperature, own.top_k, own.max_tokens, own.max_completion_tokens) == (
        1.0, -1, None, 5)
    # Completions default to 16 tokens in OpenAI's API; the model's default replaces that.
    assert defaults.apply(CompletionRequest.model_validate({"prompt": "x"})).max_tokens == 64
    assert SamplingDefaults().apply(CompletionRequest.model_validate({"prompt": "x"})) \
        .max_tokens == 16
    with pytest.raises(ValidationError, match="temperature"):
        SamplingDefaults.model_validate({"temperature": 3})
    with pytest.raises(ValidationError, match="topN"):
        SamplingDefaults.model_validate({"topN": 3})


def test_the_operator_passes_the_artifacts_defaults_to_its_engines() -> None:
    assert builders.SAMPLING_DEFAULTS_ENV == protocol.SAMPLING_DEFAULTS_ENV
    a = make_artifact("qwen3-8b").set("spec.samplingDefaults", {"temperature": 0.7,
                                                                "topK": 20}).obj()
    d = builders.build_deployment(pool(), a, None)
    env = {e["name"]: e.get("value") for e in
           d["spec"]["template"]["spec"]["containers"][0]["env"]}
    sent = SamplingDefaults.model_validate_json(env[builders.SAMPLING_DEFAULTS_ENV])
    assert (sent.temperature, sent.top_k) == (0.7, 20)
    plain = make_artifact("qwen3-8b").obj()
    d = builders.build_deployment(pool(), plain, None)
    assert builders.SAMPLING_DEFAULTS_ENV not in json.dumps(d)
