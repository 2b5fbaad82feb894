"""Rollout analysis, pure: which metrics judge a step, the PromQL they run over which window,
and what a set of query results means (`judge`). The Prometheus I/O is the operator's
(`kvfleet.operator.promquery`); the webhook uses `plans` to refuse an analysis that could
never judge anything.

Windows are anchored to the step: evaluation number k of a step covers
[stepStartedAt + warmup, stepStartedAt + warmup + k * interval] and is queried *at* its end, an
absolute time. So an evaluation recomputed after an operator restart covers the same requests
and gives the same answer, and no traffic from before the step (or from the shadow phase) leaks
into a canary step's window.

Nothing is ever a pass by default: too few samples is Waiting, an empty result or NaN is
Inconclusive (or Fail, per metric), a query that could not run is Error, which says nothing
about the canary (Prometheus being down must neither promote nor roll back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from kvfleet.api.labels import short_revision
from kvfleet.api.rollout import (
    ANSWER_FLAGS,
    AnswerChecks,
    Comparison,
    Metric,
    MetricEvaluation,
    MissingData,
    Outcome,
    OutputAgreement,
    PromptLengthSplit,
    SLOMetric,
)
from kvfleet.api.servingpool import SLOs

# The router's series (kvfleet.router.metrics), selected by the pool's namespace and name (a
# cluster-wide router serves pools of one name in several namespaces). (Templates are joined,
# not f-strings: their placeholders are written with double braces.)
# `{{traffics}}`: a canary step's live and synthetic requests (a quiet pool's own, sent by the
# routers: Rollout analysis.probePrompts), or the shadow phase's copies.
_SELECTOR = ('{namespace="{{namespace}}",pool="{{pool}}",revision="{{revision}}",'
             'traffic=~"{{traffics}}"')
_RANGE = "[{{window}}]"


def _p95(histogram: str, matchers: str = "") -> str:
    return ("histogram_quantile(0.95, sum by (le) (increase(" + histogram + "_bucket"
            + _SELECTOR + matchers + "}" + _RANGE + ")))")


def _count(histogram: str, matchers: str = "") -> str:
    return "sum(increase(" + histogram + "_count" + _SELECTOR + matchers + "}" + _RANGE + "))"


# Requests by what the client got (kvfleet.router.outcome). The requests that judge a revision
# are all but the client's own errors and departures: those say nothing about the revision,
# their share depends on the clients, and counting them would dilute the error rate (a client
# sending bad JSON to the canary would make it look healthier).
def _requests(matchers: str = "", selector: str = _SELECTOR) -> str:
    return ("sum(increase(kvfleet_router_requests_total" + selector
            + ',outcome!~"client_error|client_gone"' + matchers + "}" + _RANGE + "))")


# The revision's failures: an error inside a 200, the engine's own refusals (context, KV
# capacity, queue full, the router's proof), and no replica answering.
def _errors(matchers: str = "") -> str:
    return ("(sum(increase(kvfleet_router_requests_total" + _SELECTOR
            + ',outcome=~"stream_error|revision_refused|upstream_error"' + matchers + "}"
            + _RANGE + ")) or vector(0))")


_REQUESTS, _ERRORS = _requests(), _errors()
# A query of the policy's own counts the requests its `{{traffic}}` selects (live only, unless
# it names the synthetic too: then it sets its samplesQuery).
_REQUESTS_OF_TRAFFIC = _requests(selector=_SELECTOR.replace('traffic=~"{{traffics}}"',
                                                            'traffic="{{traffic}}"'))


# Greedy probes (kvfleet.router.probes): mirrored whatever the traffic kind, so no traffic label.
_PROBED = '{namespace="{{namespace}}",pool="{{pool}}",revision="{{revision}}"'
_AGREEMENT = ("sum(increase(kvfleet_router_probe_tokens_total" + _PROBED + ',kind="agreed"}'
              + _RANGE + ")) / sum(increase(kvfleet_router_probe_tokens_total" + _PROBED
              + ',kind="compared"}' + _RANGE + "))")
_PROBES = ("sum(increase(kvfleet_router_probes_total" + _PROBED + ',outcome="compared"}'
           + _RANGE + "))")
_PROBES_AGREED = ("sum(increase(kvfleet_router_probes_agreed_total" + _PROBED + "}" + _RANGE
                  + ")) / " + _PROBES)
# The first probe whose answers differed (a tenant-salted prompt id, the token where they
# part): named in the evaluation's message when agreement fails.
FIRST_DIVERGENCE = "max by (probe) (kvfleet_router_probe_first_divergence" + _PROBED + "})"


@dataclass(frozen=True)
class _Builtin:
    query: str
    samples: str
    shadow: bool  # the router records it for shadow copies too
    proportion: bool = False  # a fraction of `samples` (errors of requests)


TTFT = "kvfleet_router_time_to_first_token_seconds"
TPOT = "kvfleet_router_time_per_output_token_seconds"
E2E = "kvfleet_router_e2e_request_latency_seconds"
BUILTINS = {
    SLOMetric.TTFT_P95: _Builtin(_p95(TTFT), _count(TTFT), False),
    SLOMetric.TPOT_P95: _Builtin(_p95(TPOT), _count(TPOT), False),
    SLOMetric.ERROR_RATE: _Builtin(f"{_ERRORS} / {_REQUESTS}", _REQUESTS, True, True),
    SLOMetric.E2E_P95: _Builtin(_p95(E2E), _count(E2E), True),
    SLOMetric.OUTPUT_AGREEMENT: _Builtin(_AGREEMENT, _PROBES, True),
    SLOMetric.PROBE_AGREEMENT: _Builtin(_PROBES_AGREED, _PROBES, True),
}
_AGREEMENT_GATES = (SLOMetric.OUTPUT_AGREEMENT, SLOMetric.PROBE_AGREEMENT)
# Shadow copies are not streamed to anyone, so TTFT/TPOT have no shadow series; their latency
# is judged end to end against stable's live requests, allowing this factor.
SHADOW_E2E_RATIO = 1.5
DEFAULT_MIN_SAMPLES = 50


@dataclass(frozen=True)
class MetricPlan:
    """A metric with its template resolved and its threshold known."""

    name: str
    query: str
    samples_query: str
    threshold: float
    comparison: Comparison
    versus_stable: bool
    min_samples: int
    on_missing: MissingData
    detail_query: str | None = None  # says more when the metric fails (a vector query)
    # False: too few samples is NotJudged (the metric does not count) rather than Waiting.
    required: bool = True
    # Versus stable, at most: a canary at most this much over stable (in the metric's units)
    # passes whatever the ratio.
    slack: float = 0.0
    # The value is a fraction of the samples (an error rate): it passes only when the rate
    # the samples allow (PROPORTION_Z's upper bound) is under the threshold, not the point
    # estimate (0 errors in 12 requests is as likely from a revision failing 1 in 5).
    proportion: bool = False
    # Versus stable, a fraction's difference (canary - stable), not a ratio: it fails only when
    # over `threshold` and the samples show it (`significantly_over`).
    difference: bool = False


@dataclass(frozen=True)
class Window:
    """Evaluation `index` of step `step` (-1: shadow): [start, end], queried at `end`."""

    step: int
    index: int
    start: datetime
    end: datetime

    @property
    def range(self) -> str:
        return f"{max(1, round((self.end - self.start).total_seconds()))}s"


class AnalysisConfigError(ValueError):
    """The analysis cannot run as declared (a metric without a threshold, nothing to judge)."""


def _slo_threshold(slo: SLOMetric, slos: SLOs | None) -> float | None:
    if slos is None:
        return None
    return {
        SLOMetric.TTFT_P95: slos.ttft_p95_seconds,
        SLOMetric.TPOT_P95: slos.tpot_p95_seconds,
        SLOMetric.ERROR_RATE: slos.error_rate,
        SLOMetric.E2E_P95: None,
        SLOMetric.OUTPUT_AGREEMENT: None,
        SLOMetric.PROBE_AGREEMENT: None,
    }[slo]


def _agreement_metric(agreement: OutputAgreement | None, metrics: list[Metric]) -> list[Metric]:
    """The built-in answer gates, by tokens and by probes, unless they are off or the metrics
    name them already."""
    if agreement is None or not agreement.enabled:
        return []
    named = {m.slo for m in metrics}
    if SLOMetric.OUTPUT_AGREEMENT in named:
        # (A policy that judges agreement its own way, e.g. looser for a quantised rollout,
        # is not given the stricter per-probe gate beside it unless it names that too.)
        named.add(SLOMetric.PROBE_AGREEMENT)
    return [Metric(name=name, slo=slo, threshold=threshold, comparison=Comparison.AT_LEAST,
                   min_samples=agreement.min_probes)
            for name, slo, threshold in (
                ("output-agreement", SLOMetric.OUTPUT_AGREEMENT, agreement.min_agreement),
                ("probe-agreement", SLOMetric.PROBE_AGREEMENT, agreement.min_probe_agreement))
            if slo not in named]


def _class_plans(split: PromptLengthSplit | None, *, shadow: bool) -> list[MetricPlan]:
    """Per prompt-length class, canary p95 over stable's: time to first token (streamed live
    requests: shadow copies have none) and end to end (streamed or not); and the canary's
    error rate against stable's, by their difference."""
    if split is None or not split.enabled:
        return []
    out = []
    for name, values in split.classes():
        matchers = ',prompt_class=~"' + "|".join(values) + '"'
        for metric, histogram in (("ttftp95", TTFT), ("e2ep95", E2E)):
            if shadow and histogram == TTFT:
                continue
            out.append(MetricPlan(
                f"{metric}-{name}", _p95(histogram, matchers), _count(histogram, matchers),
                split.max_ratio, Comparison.AT_MOST, True, split.min_samples,
                MissingData.INCONCLUSIVE, required=False, slack=split.min_difference_seconds))
        out.append(MetricPlan(
            f"errorrate-{name}", f"{_errors(matchers)} / {_requests(matchers)}",
            _requests(matchers), split.min_error_difference, Comparison.AT_MOST, True,
            split.min_samples, MissingData.INCONCLUSIVE, required=False, difference=True))
    return out


# Live answers checked for the signs users would call broken (kvfleet.router.answers).
_CHECKED = ("sum(increase(kvfleet_router_answers_checked_total" + _SELECTOR + "}" + _RANGE
            + "))")


def _flagged(flag: str) -> str:
    return ("(sum(increase(kvfleet_router_answer_flags_total" + _SELECTOR + ',flag="' + flag
            + '"}' + _RANGE + ")) or vector(0))")


def _answer_plans(checks: AnswerChecks | None, *, shadow: bool) -> list[MetricPlan]:
    """Per sign, the share of the canary's checked answers against stable's, by their
    difference. Live canary steps only: shadow copies are capped by the router, not the
    client, so their `unfinished` share says nothing about the revision."""
    if checks is None or not checks.enabled or shadow:
        return []
    return [MetricPlan(f"answers-{flag}", f"{_flagged(flag)} / {_CHECKED}", _CHECKED,
                       checks.min_difference, Comparison.AT_MOST, True, checks.min_samples,
                       MissingData.INCONCLUSIVE, required=False, difference=True)
            for flag in ANSWER_FLAGS]


def plans(metrics: list[Metric], slos: SLOs | None, *, shadow: bool,
          agreement: OutputAgreement | None = None,
          split: PromptLengthSplit | None = None,
          checks: AnswerChecks | None = None) -> list[MetricPlan]:
    """The metrics that judge a step (shadow: the shadow phase). Empty `metrics`: the built-in
    ones for the SLOs the pool declares; `agreement` adds answer agreement with stable,
    `split` latency per prompt-length class against stable and `checks` the live answers'
    signs against stable's (all on by default). Raises
    AnalysisConfigError when nothing can judge."""
    metrics = list(metrics)
    if not metrics:
        metrics = [Metric(name=f"{slo.value.lower()}", slo=slo) for slo in
                   (SLOMetric.TTFT_P95, SLOMetric.TPOT_P95, SLOMetric.ERROR_RATE)
                   if _slo_threshold(slo, slos) is not None]
        if shadow and metrics:
            metrics.append(Metric(name="e2ep95-vs-stable", slo=SLOMetric.E2E_P95,
                                  threshold=SHADOW_E2E_RATIO, versus_stable=True))
    metrics += _agreement_metric(agreement, metrics)
    out: list[MetricPlan] = []
    for index, metric in enumerate(metrics):
        where = f"spec.analysis.metrics[{index}] ({metric.name})"
        if metric.slo is not None:
            builtin = BUILTINS[metric.slo]
            if shadow and not builtin.shadow:
                continue
            query, samples = builtin.query, builtin.samples
            threshold = metric.threshold if metric.threshold is not None else \
                _slo_threshold(metric.slo, slos)
            if threshold is None and metric.slo in _AGREEMENT_GATES:
                defaults = agreement or OutputAgreement()
                threshold = defaults.min_agreement if metric.slo == \
                    SLOMetric.OUTPUT_AGREEMENT else defaults.min_probe_agreement
            if threshold is None:
                raise AnalysisConfigError(
                    f"{where}: {metric.slo.value} has no threshold: set threshold, or the "
                    "pool's spec.slos")
        else:
            if metric.query is None or metric.threshold is None:
                raise AnalysisConfigError(f"{where}: a query needs a threshold")
            query, threshold = metric.query, metric.threshold
            samples = metric.samples_query or _REQUESTS_OF_TRAFFIC
        agreement_gate = metric.slo in _AGREEMENT_GATES
        # Agreement is already canary against stable, and more of it is better.
        proportion = metric.slo is not None and BUILTINS[metric.slo].proportion and \
            not metric.versus_stable and metric.samples_query is None
        out.append(MetricPlan(
            metric.name, query, metric.samples_query or samples, threshold,
            Comparison.AT_LEAST if agreement_gate else metric.comparison,
            metric.versus_stable and not agreement_gate, metric.min_samples,
            metric.on_missing_data, FIRST_DIVERGENCE if agreement_gate else None,
            proportion=proportion))
    # Alone, the classes could only ever be NotJudged or judged: they never make a step
    # judgeable by themselves.
    if out:
        out += _class_plans(split, shadow=shadow) + _answer_plans(checks, shadow=shadow)
    if not out:
        raise AnalysisConfigError(
            "nothing judges this step: the Rollout's spec.analysis.metrics is empty and the "
            "pool declares no spec.slos; add either, or set analysis: false on the steps")
    return out


def render(template: str, *, pool: str, namespace: str, revision: str, traffic: str,
           window: Window) -> str:
    values = {"pool": pool, "namespace": namespace, "revision": short_revision(revision),
              "traffic": traffic, "window": window.range,
              "traffics": "live|synthetic" if traffic == "live" else traffic}
    for key, value in values.items():
        template = template.replace("{{" + key + "}}", value)
    return template


def due(start: datetime | None, interval: float, warmup: float, done: set[int],
        now: datetime, step: int) -> Window | None:
    """The newest evaluation slot that ended by `now` and is not `done`, or None."""
    if start is None:
        return None
    base = start + timedelta(seconds=warmup)
    slot = math.floor((now - base).total_seconds() / interval)
    if slot < 1 or slot in done:
        return None
    return Window(step, slot, base, base + timedelta(seconds=slot * interval))


@dataclass(frozen=True)
class QueryResult:
    """One revision's answer: the value (None: empty result), the samples it came from, or
    the error that kept the query from running."""

    value: float | None = None
    samples: int = 0
    error: str | None = None


def _passes(value: float, threshold: float, comparison: Comparison) -> bool:
    return {
        Comparison.LESS_THAN: value < threshold,
        Comparison.AT_MOST: value <= threshold,
        Comparison.GREATER_THAN: value > threshold,
        Comparison.AT_LEAST: value >= threshold,
    }[comparison]


_SYMBOL = {Comparison.LESS_THAN: "<", Comparison.AT_MOST: "<=", Comparison.GREATER_THAN: ">",
           Comparison.AT_LEAST: ">="}
_NEGATED = {Comparison.LESS_THAN: ">=", Comparison.AT_MOST: ">", Comparison.GREATER_THAN: "<=",
            Comparison.AT_LEAST: "<"}


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def judge(plan: MetricPlan, canary: QueryResult, stable: QueryResult | None) -> MetricEvaluation:
    """One metric's outcome. `stable` is given for a versus-stable metric."""
    result = MetricEvaluation(name=plan.name, outcome=Outcome.INCONCLUSIVE,
                              threshold=plan.threshold, samples=canary.samples,
                              canary_value=canary.value if _finite(canary.value) else None)
    if stable is not None:
        result.stable_samples = stable.samples
        result.stable_value = stable.value if _finite(stable.value) else None
    errors = [r.error for r in (canary, stable) if r is not None and r.error]
    if errors:
        result.outcome, result.message = Outcome.ERROR, errors[0][:500]
        return result
    short = [(who, r.samples) for who, r in (("canary", canary), ("stable", stable))
             if r is not None and r.samples < plan.min_samples]
    if short:
        result.outcome = Outcome.WAITING if plan.required else Outcome.NOT_JUDGED
        result.message = ", ".join(f"{who} {n}/{plan.min_samples} samples" for who, n in short)
        return result
    missing = Outcome.FAIL if plan.on_missing == MissingData.FAIL else Outcome.INCONCLUSIVE
    if not _finite(canary.value):
        result.outcome = missing
        result.message = "canary: " + ("no data" if canary.value is None else f"{canary.value}")
        return result
    value = canary.value
    assert value is not None
    over = math.inf  # how far the canary is over stable, in the metric's units
    if stable is not None:
        if not _finite(stable.value):
            result.outcome = missing
            result.message = "stable: " + ("no data" if stable.value is None else
                                           f"{stable.value}")
            return result
        assert stable.value is not None
        if plan.difference:
            return _judge_difference(plan, result, value, stable.value, canary.samples,
                                     stable.samples)
        over = value - stable.value
        # 0/0: both revisions equally good; x/0: the canary is infinitely worse.
        ratio_of_zero = 1.0 if value == 0 else math.inf
        value = ratio_of_zero if stable.value == 0 else value / stable.value
    result.value = value if math.isfinite(value) else None
    passed = _passes(value, plan.threshold, plan.comparison)
    what = f"{plan.name}{' canary/stable' if stable is not None else ''} {value:.4g}"
    symbol = _SYMBOL[plan.comparison] if passed else _NEGATED[plan.comparison]
    result.message = f"{what} {symbol} {plan.threshold:g}"
    if not passed and stable is not None and plan.slack > 0 and over <= plan.slack and \
            plan.comparison in (Comparison.AT_MOST, Comparison.LESS_THAN):
        passed = True
        result.message += f", but only {over:.3g} over stable (<= {plan.slack:g})"
    result.outcome = Outcome.PASS if passed else Outcome.FAIL
    # (A threshold of 0, "not one error", can never be shown by a bound: any error fails it.)
    if passed and plan.proportion and plan.threshold > 0 and plan.comparison in (
            Comparison.AT_MOST, Comparison.LESS_THAN):
        bound = rate_upper_bound(value, canary.samples)
        if not _passes(bound, plan.threshold, plan.comparison):
            result.outcome = Outcome.WAITING
            result.message = (f"{plan.name} {value:.4g} from {canary.samples} requests: the "
                              f"rate could be up to {bound:.3g}, over {plan.threshold:g} "
                              f"(need {samples_to_pass(plan.threshold)} with none failed)")
    return result


def _judge_difference(plan: MetricPlan, result: MetricEvaluation, canary: float,
                      stable: float, canary_samples: int, stable_samples: int
                      ) -> MetricEvaluation:
    """A rate judged by how far the canary's is over stable's: a Fail needs the difference
    over the threshold and shown by the samples (`significantly_over`)."""
    over = canary - stable
    result.value = over
    what = (f"{plan.name} canary {canary:.3g} ({canary_samples} requests) vs stable "
            f"{stable:.3g} ({stable_samples})")
    if over <= plan.threshold:
        result.outcome, result.message = Outcome.PASS, f"{what}: {over:+.3g} <= " \
            f"{plan.threshold:g}"
    elif significantly_over(canary, canary_samples, stable, stable_samples):
        result.outcome, result.message = Outcome.FAIL, f"{what}: {over:+.3g} > " \
            f"{plan.threshold:g}"
    else:
        result.outcome, result.message = Outcome.PASS, f"{what}: {over:+.3g}, not yet " \
            "shown by so few requests"
    return result


def significantly_over(canary: float, canary_samples: int, stable: float,
                       stable_samples: int) -> bool:
    """The canary's rate is over stable's beyond what their samples leave open: the
    canary's lower bound over stable's upper bound (95 % one-sided each)."""
    return rate_lower_bound(canary, canary_samples) > rate_upper_bound(stable, stable_samples)


# One-sided 95 %: the rate a revision may really have, given what its samples showed.
PROPORTION_Z = 1.645


def rate_lower_bound(rate: float, samples: int, z: float = PROPORTION_Z) -> float:
    """Wilson score lower bound of a proportion `rate` seen over `samples` trials."""
    return 1.0 - rate_upper_bound(1.0 - rate, samples, z) if samples > 0 else 0.0


def rate_upper_bound(rate: float, samples: int, z: float = PROPORTION_Z) -> float:
    """Wilson score upper bound of a proportion `rate` seen over `samples` trials."""
    if samples <= 0:
        return 1.0
    n, p = samples, min(max(rate, 0.0), 1.0)
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z * z / n))


def samples_to_pass(threshold: float, z: float = PROPORTION_Z) -> int:
    """The fewest samples, all good, whose upper bound is at most `threshold` (> 0)."""
    return math.ceil(z * z * (1 - threshold) / threshold) if threshold < 1 else 1


_SEVERITY = [Outcome.PASS, Outcome.WAITING, Outcome.INCONCLUSIVE, Outcome.ERROR, Outcome.FAIL]


def overall(metrics: list[MetricEvaluation]) -> Outcome:
    """The evaluation's outcome: any Fail fails it; else an Error, Inconclusive or Waiting
    metric makes it that; Pass only when every judged metric passed (and there is at least
    one). NotJudged metrics (optional, too few samples) do not count."""
    judged = [m.outcome for m in metrics if m.outcome != Outcome.NOT_JUDGED]
    if not judged:
        return Outcome.WAITING if metrics else Outcome.INCONCLUSIVE
    return max(judged, key=_SEVERITY.index)
