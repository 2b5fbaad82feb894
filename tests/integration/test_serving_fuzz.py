"""Fuzz the HTTP API of a real engine from its own OpenAPI document (schemathesis): no
request, however odd, gets a 5xx or hangs.

The server runs with a 96-token context so that any request the fuzzer makes valid finishes
in a few seconds on CPU. Budget: ~3 min (bounded examples per operation, 30 s per call).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from engine_server import EngineServer, running_server
from hypothesis import HealthCheck, Phase, example, given, settings
from schemathesis.core.result import Ok

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_SECONDS_PER_CALL = 30.0
MAX_EXAMPLES = 40


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineServer]:
    with running_server("--max-model-len", "96", "--default-max-tokens", "8") as s:
        yield s


def documented_examples(spec: dict[str, Any], operation: Any) -> list[Any]:
    """The request bodies the OpenAPI document gives as examples for `operation`."""
    content = (operation.definition.raw.get("requestBody") or {}).get("content") or {}
    ref = ((content.get("application/json") or {}).get("schema") or {}).get("$ref", "")
    schemas = (spec.get("components") or {}).get("schemas") or {}
    return list((schemas.get(ref.rsplit("/", 1)[-1]) or {}).get("examples") or [])


def fuzz_operation(operation: Any, base_url: str, examples: list[Any]) -> Counter[int]:
    """The documented `examples`, then up to `MAX_EXAMPLES` generated requests, against one
    operation; status counts. (Random bodies of the completion APIs are nearly all refusals:
    40 of them once held no request that could be served.)"""
    statuses: Counter[int] = Counter()

    @given(case=operation.as_strategy())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        started = time.monotonic()
        response = case.call(base_url=base_url, timeout=MAX_SECONDS_PER_CALL)
        elapsed = time.monotonic() - started
        statuses[response.status_code] += 1
        where = f"{case.method} {case.path} body={str(case.body)[:300]}"
        assert response.status_code < 500, (where, response.status_code, response.text[:500])
        assert elapsed < MAX_SECONDS_PER_CALL, where
        if response.status_code >= 400 and response.status_code != 404:
            error = response.json()["error"]
            assert error["code"] and error["message"], where

    for body in examples:
        run = example(case=operation.Case(body=body, media_type="application/json"))(run)
    run()
    return statuses


# The pytest plugin's lazy fixture loader does not work with this pytest; the Python API is
# the same generator and checks, driven explicitly.
def test_no_server_errors_and_no_hangs(engine: EngineServer) -> None:
    schema = schemathesis.openapi.from_url(engine.base_url + "/openapi.json")
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), f"the OpenAPI document is invalid: {result}"
        operations.append(result.ok())
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/ready"} <= paths
    spec = httpx.get(engine.base_url + "/openapi.json", timeout=10).json()
    for operation in operations:
        examples = documented_examples(spec, operation)
        if operation.path in ("/v1/completions", "/v1/chat/completions"):
            assert examples, f"{operation.path}: the OpenAPI document has no example body"
        statuses = fuzz_operation(operation, engine.base_url, examples)
        print(operation.method.upper(), operation.path, dict(statuses))
        # Not only rejections: valid requests (the documented ones at least) really generate.
        assert statuses[200] > 0, (operation.path, statuses)
    assert engine.wait_idle()["kvfleet_engine_kv_cache_usage_ratio"] == 0
