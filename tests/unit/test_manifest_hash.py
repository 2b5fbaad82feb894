"""manifestHash: equal for equivalent spellings, different for any meaningful change."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.api import base_hash, canonical_json, load_yaml_documents, manifest_hash
from kvfleet.api.builders import fake_sha256, make_artifact


def _spec(**changes: Any) -> dict[str, Any]:
    builder = make_artifact()
    for path, value in changes.items():
        builder.set("spec." + path.replace("__", "."), value)
    spec: dict[str, Any] = builder.data()["spec"]
    return spec


def test_canonical_json_is_sorted_compact_and_normalizes_numbers() -> None:
    assert canonical_json({"b": 1.0, "a": [1e0, 0.5, True, None], "c": "é"}) == (
        '{"a":[1,0.5,true,null],"b":1,"c":"é"}'.encode()
    )


def test_non_finite_numbers_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"\$.x: nan is not a finite number"):
        canonical_json({"x": float("nan")})


def test_hash_is_sha256_hex_and_stable() -> None:
    digest = manifest_hash(_spec())
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert manifest_hash(_spec()) == digest


def test_equivalent_yaml_spellings_hash_the_same() -> None:
    base = _spec(samplingDefaults={"temperature": 1, "topP": 0.9})
    text_a = json.dumps(base)
    # Same spec: reordered keys, 1 → 1.0 / 1e0, 0.9 → 9e-1, default spelled out, YAML flow.
    alt = json.loads(text_a)
    alt["samplingDefaults"] = {"topP": 9e-1, "temperature": 1.0}
    alt["adapters"] = []
    alt["gpuArchitectures"] = []
    reordered = dict(reversed(list(alt.items())))
    yaml_text = "spec:\n  samplingDefaults: {temperature: 1e0, topP: 0.90}\n"
    [doc] = load_yaml_documents(yaml_text)
    from_yaml = {**base, "samplingDefaults": doc["spec"]["samplingDefaults"]}
    digest = manifest_hash(base)
    assert manifest_hash(reordered) == digest
    assert manifest_hash(from_yaml) == digest


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "float16"},
        {"architecture__numLayers": 35},
        {"weights__files__0__sha256": fake_sha256("other")},
        {"weights__files__0__sizeBytes": 3_300_000_001},
        {"specialTokens__stopTokenIds": [151643, 151645]},
        {"family": "qwen3-instruct"},
        {"samplingDefaults": {"temperature": 0.7}},
    ],
)
def test_any_meaningful_change_changes_the_hash(change: dict[str, Any]) -> None:
    assert manifest_hash(_spec(**change)) != manifest_hash(_spec())


def test_file_order_is_meaningful() -> None:
    spec = _spec()
    swapped = _spec()
    swapped["weights"]["files"].reverse()
    assert manifest_hash(swapped) != manifest_hash(spec)


def test_base_hash_ignores_adapters_only() -> None:
    spec = _spec()
    adapter = {
        "name": "sql",
        "uri": "s3://a/sql.safetensors",
        "sha256": fake_sha256("sql"),
        "baseHash": base_hash(spec),
    }
    with_adapter = {**spec, "adapters": [adapter]}
    assert base_hash(with_adapter) == base_hash(spec) == manifest_hash(spec)
    assert manifest_hash(with_adapter) != manifest_hash(spec)


@settings(max_examples=50, deadline=None)
@given(st.floats(min_value=0, max_value=2, allow_nan=False), st.integers(0, 1000))
def test_number_spelling_never_matters(temperature: float, top_k: int) -> None:
    a = _spec(samplingDefaults={"temperature": temperature, "topK": top_k})
    b = _spec(samplingDefaults={"topK": float(top_k), "temperature": repr(temperature)})
    assert manifest_hash(a) == manifest_hash(b)


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


def _shuffle_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _shuffle_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_shuffle_keys(v) for v in value]
    return value


@settings(max_examples=100, deadline=None)
@given(_json_values)
def test_canonical_json_ignores_key_order_and_round_trips(value: Any) -> None:
    encoded = canonical_json(value)
    assert canonical_json(_shuffle_keys(value)) == encoded
    assert canonical_json(json.loads(encoded)) == encoded
    # Compact: nothing but the JSON itself (whitespace can only appear inside strings).
    compact = json.dumps(
        json.loads(encoded), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    assert encoded == compact.encode()
