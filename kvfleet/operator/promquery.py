"""The analysis's I/O: instant PromQL queries at a window's end time, over Prometheus's HTTP
API. A failure of any kind (unreachable, timeout, a query Prometheus refuses, an answer with
more than one series) becomes `QueryResult.error`, which the analysis counts as Error — apart
from failures, because it says nothing about the canary."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvfleet.api.analysis import MetricPlan, QueryResult, Window, judge, render
from kvfleet.api.rollout import MetricEvaluation, Outcome

QUERY_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class Target:
    """What one analysis judges: the pool, the canary and stable revisions, and the traffic
    kind of the canary's series (shadow in the shadow phase; stable's is always live)."""

    pool: str
    namespace: str
    canary: str
    stable: str
    traffic: str


def _value(body: dict[str, Any]) -> float | None:
    if body.get("status") != "success":
        raise ValueError(f"{body.get('errorType', 'error')}: {body.get('error', body)}")
    data = body.get("data") or {}
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar" and isinstance(result, list):
        return float(result[1])
    if kind != "vector" or not isinstance(result, list):
        raise ValueError(f"the query returned a {kind}, not one value")
    if not result:
        return None
    if len(result) > 1:
        raise ValueError(f"the query returned {len(result)} series; aggregate it to one "
                         "(sum, max, histogram_quantile over sum by (le))")
    return float(result[0]["value"][1])


class PromQuery:
    def __init__(self, url: str | None, timeout: float = QUERY_TIMEOUT_SECONDS) -> None:
        self.url = url.rstrip("/") if url else None
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def _ask(self, params: dict[str, str]) -> dict[str, Any]:
        """Prometheus's answer to an instant query (`/api/v1/query`); raises when it has none."""
        if self.url is None:
            raise ValueError("the operator has no Prometheus (start it with --prometheus-url)")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout))
        async with self._session.post(f"{self.url}/api/v1/query", data=params) as resp:
            try:
                body: dict[str, Any] = await resp.json(content_type=None)
            except ValueError:
                raise ValueError(f"HTTP {resp.status} from Prometheus") from None
        return body

    async def vector(self, query: str) -> list[tuple[dict[str, str], float]]:
        """Every series of `query` now: (labels, value). Raises on error."""
        body = await self._ask({"query": query})
        if body.get("status") != "success":
            raise ValueError(f"{body.get('errorType', 'error')}: {body.get('error', body)}")
        data = body.get("data") or {}
        if data.get("resultType") != "vector":
            raise ValueError(f"the query returned a {data.get('resultType')}, not a vector")
        return [(dict(r.get("metric") or {}), float(r["value"][1])) for r in data["result"]]

    async def instant(self, query: str, at: float) -> float | None:
        """The one value of `query` at unix time `at` (None: empty result). Raises on error."""
        return _value(await self._ask({"query": query, "time": f"{at:.3f}"}))

    async def result(self, query: str, samples_query: str, at: float) -> QueryResult:
        try:
            value, samples = await asyncio.gather(self.instant(query, at),
                                                  self.instant(samples_query, at))
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError,
                IndexError) as exc:
            return QueryResult(error=f"{type(exc).__name__}: {exc}" if not isinstance(
                exc, ValueError) else str(exc))
        count = 0 if samples is None or not math.isfinite(samples) else round(samples)
        return QueryResult(value=value, samples=count)

    async def evaluate(self, plans: list[MetricPlan], window: Window, target: Target,
                       baseline: Window | None = None) -> list[MetricEvaluation]:
        """Each metric over `window`; a versus-stable metric's stable side over `baseline`
        (default: the same window)."""
        baseline = baseline or window

        def one(template: str, revision: str, traffic: str, over: Window) -> str:
            return render(template, pool=target.pool, namespace=target.namespace,
                          revision=revision, traffic=traffic, window=over)

        async def metric(plan: MetricPlan) -> MetricEvaluation:
            at = window.end.timestamp()
            canary = self.result(one(plan.query, target.canary, target.traffic, window),
                                 one(plan.samples_query, target.canary, target.traffic, window),
                                 at)
            if not plan.versus_stable:
                return await self._detail(plan, judge(plan, await canary, None), at,
                                          one(plan.detail_query or "", target.canary,
                                              target.traffic, window))
            stable = self.result(one(plan.query, target.stable, "live", baseline),
                                 one(plan.samples_query, target.stable, "live", baseline),
                                 baseline.end.timestamp())
            got_canary, got_stable = await asyncio.gather(canary, stable)
            return judge(plan, got_canary, got_stable)

        return list(await asyncio.gather(*(metric(p) for p in plans)))

    async def _detail(self, plan: MetricPlan, result: MetricEvaluation, at: float,
                      query: str) -> MetricEvaluation:
        """A failed metric's detail query (e.g. the first diverging probe) in its message:
        `name=value` of the series' labels and value. A detail that cannot be had is left
        out; it never changes the outcome."""
        if plan.detail_query is None or result.outcome != Outcome.FAIL:
            return result
        try:
            body = await self._ask({"query": query, "time": f"{at:.3f}"})
            series = (body.get("data") or {}).get("result") or []
            labels, value = series[0]["metric"], float(series[0]["value"][1])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError,
                IndexError):
            return result
        named = ", ".join(f"{k} {v}" for k, v in sorted(labels.items()))
        result.message = f"{result.message}; first divergence: {named} at token {value:g}"[:512]
        return result

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
