"""The router's Prometheus series: what clients observed, per pool, revision and traffic kind.

These are the series the Rollout analysis reads (canary vs stable); every name is defined here.

    kvfleet_router_time_to_first_token_seconds{namespace,pool,revision,traffic,prompt_class}
        histogram (to the first frame with text: not a role-only delta, not an error frame)
    kvfleet_router_time_per_output_token_seconds{namespace,pool,revision,traffic,prompt_class}
        histogram (streams of N > 1 tokens)
    kvfleet_router_e2e_request_latency_seconds{namespace,pool,revision,traffic,prompt_class}
        histogram (streamed or not; outcomes completed, stream_error, revision_refused)
    kvfleet_router_requests_total{namespace,pool,revision,traffic,prompt_class,outcome}
        counter (kvfleet.router.outcome: completed, stream_error, revision_refused,
        client_error, upstream_error, client_gone; every outcome and class created at 0 for
        each revision in a traffic table, so increase() sees a new outcome's first requests)
    kvfleet_router_tokens_total{namespace,pool,revision,traffic,kind}              counter
        (prompt|generation)
    kvfleet_router_rejections_total{namespace,pool,reason}                         counter
        (before an engine: unauthorized, quota limit names, ...; "-" when no pool was named)
    kvfleet_router_shadow_comparisons_total{namespace,pool,revision,outcome}       counter
        (identical, diverged, length; answered: no greedy live answer to compare with;
        error, shed)
    kvfleet_router_shadow_first_divergence_chars{namespace,pool,revision}          histogram
    kvfleet_router_probes_total{namespace,pool,revision,outcome}                   counter
        (greedy probes to the revision and stable, kvfleet.router.probes: compared, error,
        shed, misrouted: an answer from an engine of another revision than the one asked;
        created at 0 while a table asks for probes)
    kvfleet_router_probes_agreed_total{namespace,pool,revision}                    counter
        (compared probes whose two answers agree in full, token ids and text)
    kvfleet_router_probe_tokens_total{namespace,pool,revision,kind}                counter
        (agreed: the common prefix of the two answers; compared: the longer answer's tokens)
    kvfleet_router_probe_first_divergence{namespace,pool,revision,probe}           gauge
        (the first probe whose answers differed on this router: its tenant-salted prompt id,
        and the token where they part)
    kvfleet_router_answers_checked_total{namespace,pool,revision,traffic}         counter
        (completed live answers of a pool in a canary step, both revisions, checked for the
        signs of kvfleet.router.answers; created at 0 with the request counters)
    kvfleet_router_answer_flags_total{namespace,pool,revision,traffic,flag}       counter
        (the checked answers with a sign: empty, unfinished, looping, garbled)
    kvfleet_router_held_requests{namespace,pool}                                   gauge
        (requests waiting for a pool at zero to wake: the autoscaler's demand signal)
    kvfleet_router_last_request_timestamp_seconds{namespace,pool}                  gauge
        (unix time this router last admitted a request for the pool, or first learnt of
        it: the autoscaler's idle signal)

`prompt_class` is the prompt's token count (as counted at admission) rounded up to one of
`kvfleet.api.rollout.PROMPT_CLASS_EDGES` ("256" ... "16384", or "inf"): the Rollout analysis
judges latency and errors per class of prompt length. The latency histograms' buckets are a
fixed ladder plus, per pool, 0.9, 1 and 1.1 times its TTFT (TPOT) SLO: whether a p95 is over
the threshold is then read from the bucket the 95th percentile falls in, and its estimate near
the threshold is within 10 % (a ladder alone, e.g. 10/20/40 s, can put a true p95 of 19 s
under a 15 s SLO).
A series keeps the buckets it was created with (an SLO edit applies to new revisions).

A revision's series (every metric above that has a `revision` label) go RETAIN_SECONDS after
no traffic table of this router sends to it any more: Prometheus keeps what it scraped, and
dashboards and after-the-fact queries see the current series for an hour after a promotion or
rollback; kept for ever, they grew with every rollout the router saw (about 60 a revision).

`namespace` is the ServingPool's (pools of one name in two namespaces are two series under a
cluster-wide router); scrape the router with honor_labels so a scraper's own `namespace`
target label (the router pod's) does not replace it. `traffic` is "live" or "shadow";
`revision` is the 12-digit short revision (kvfleet.operator.revisions). Tenants are not
labels (unbounded); per-tenant usage goes to each TenantQuota's status instead.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily

from kvfleet.api.rollout import (
    ANSWER_FLAGS,
    PROMPT_CLASS_EDGES,
    PROMPT_CLASS_OVER,
    prompt_class,
)
from kvfleet.router import answers
from kvfleet.router.outcome import Outcome

PREFIX = "kvfleet_router_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                   2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 80.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.5)
LABELS = ("namespace", "pool", "revision", "traffic")
PROMPT_CLASSES = (*map(str, PROMPT_CLASS_EDGES), PROMPT_CLASS_OVER)
PROBE_OUTCOMES = ("compared", "error", "shed", "misrouted")
# Around an SLO threshold t: buckets at t and t * (1 -+ this).
SLO_MARGIN = 0.1
# How long a revision no traffic table sends to keeps its series.
RETAIN_SECONDS = 3600.0


def slo_edges(base: Iterable[float], threshold: float | None) -> tuple[float, ...]:
    """The bucket edges of a series: the ladder, plus 0.9 t, t and 1.1 t for an SLO t."""
    edges = set(base)
    if threshold is not None and threshold > 0:
        edges |= {round(threshold * f, 6) for f in (1 - SLO_MARGIN, 1.0, 1 + SLO_MARGIN)}
    return tuple(sorted(edges))


@dataclass(slots=True)
class _Series:
    edges: tuple[float, ...]
    counts: list[int] = field(init=False)  # per bucket, the last is +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.edges) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.total += value


class SLOHistogram:
    """A histogram whose series each have their own bucket edges (`slo_edges` of the ladder
    and the threshold of the series' pool, fixed when the series is first observed). A
    collector: `prometheus_client.Histogram` has one set of edges for all its series."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...],
                 base: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.labelnames, self.base = (
            name, documentation, labelnames, base)
        self._series: dict[tuple[str, ...], _Series] = {}
        registry.register(self)

    def observe(self, labels: tuple[str, ...], value: float, threshold: float | None) -> None:
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = _Series(slo_edges(self.base, threshold))
        series.observe(value)

    def edges(self, labels: tuple[str, ...]) -> tuple[float, ...] | None:
        series = self._series.get(labels)
        return series.edges if series is not None else None

    def forget(self, revision: tuple[str, str, str]) -> None:
        """Drop every series of (namespace, pool, revision)."""
        for labels in [k for k in self._series if k[:3] == revision]:
            del self._series[labels]

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, series in list(self._series.items()):
            cumulative, buckets = 0, []
            for edge, count in zip([*series.edges, float("inf")], series.counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if edge == float("inf") else repr(edge),
                                float(cumulative)))
            family.add_metric(list(labels), buckets, series.total)
        yield family


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        timed = (*LABELS, "prompt_class")
        self.ttft = SLOHistogram(PREFIX + "time_to_first_token_seconds",
                                 "Client-observed time to first token", timed,
                                 LATENCY_BUCKETS, r)
        self.tpot = SLOHistogram(PREFIX + "time_per_output_token_seconds",
                                 "Client-observed time per output token after the first", timed,
                                 TPOT_BUCKETS, r)
        self.e2e = SLOHistogram(PREFIX + "e2e_request_latency_seconds",
                                "Client-observed request latency", timed, LATENCY_BUCKETS, r)
        # (namespace, pool) -> its (TTFT, TPOT) p95 SLOs in seconds, for the buckets.
        self.slos: Mapping[tuple[str, str], tuple[float | None, float | None]] = {}
        self.requests = Counter(PREFIX + "requests_total", "Requests by outcome",
                                (*timed, "outcome"), registry=r)
        self.tokens = Counter(PREFIX + "tokens_total", "Tokens by kind", (*LABELS, "kind"),
                              registry=r)
        self.rejections = Counter(PREFIX + "rejections_total",
                                  "Requests refused before an engine",
                                  ("namespace", "pool", "reason"), registry=r)
        self.shadow = Counter(PREFIX + "shadow_comparisons_total",
                              "Shadow answers compared with the live ones",
                              ("namespace", "pool", "revision", "outcome"), registry=r)
        self.divergence = Histogram(PREFIX + "shadow_first_divergence_chars",
                                    "First differing character of greedy shadow answers",
                                    ("namespace", "pool", "revision"),
                                    buckets=(0, 1, 4, 16, 64, 256, 1024, 4096), registry=r)
        self.shared_ledger_up = Gauge(
            PREFIX + "shared_ledger_up", "1 while the shared quota ledger (Redis) decides "
            "admissions; 0 while this router enforces its share of each limit on its own",
            registry=r)
        probe = ("namespace", "pool", "revision")
        self.probes = Counter(PREFIX + "probes_total", "Greedy probes by outcome",
                              (*probe, "outcome"), registry=r)
        self.probes_agreed = Counter(PREFIX + "probes_agreed_total",
                                     "Compared probes whose answers agree in full",
                                     probe, registry=r)
        self.probe_tokens = Counter(PREFIX + "probe_tokens_total",
                                    "Greedy probe tokens agreed and compared",
                                    (*probe, "kind"), registry=r)
        self.first_divergence = Gauge(PREFIX + "probe_first_divergence",
                                      "Token where the first diverging probe's answers part",
                                      (*probe, "probe"), registry=r)
        self.answers_checked = Counter(PREFIX + "answers_checked_total",
                                       "Completed live answers checked for broken signs",
                                       LABELS, registry=r)
        self.answer_flags = Counter(PREFIX + "answer_flags_total",
                                    "Checked answers by sign (kvfleet.router.answers)",
                                    (*LABELS, "flag"), registry=r)
        self._known_pools: set[tuple[str, str]] = set()
        # (namespace, pool, revision) -> when a traffic table last sent to it (None: now).
        self._routed: dict[tuple[str, str, str], float | None] = {}
        self.held = Gauge(PREFIX + "held_requests", "Requests held while their pool wakes "
                          "from zero replicas", ("namespace", "pool"), registry=r)
        self.last_request = Gauge(
            PREFIX + "last_request_timestamp_seconds", "When this router last admitted a "
            "request for the pool (or first learnt of it)", ("namespace", "pool"),
            registry=r)

    def observe_ttft(self, labels: tuple[str, str, str, str], prompt_tokens: int,
                     seconds: float) -> None:
        ttft, _ = self.slos.get(labels[:2], (None, None))
        self.ttft.observe((*labels, prompt_class(prompt_tokens)), seconds, ttft)

    def observe_tpot(self, labels: tuple[str, str, str, str], prompt_tokens: int,
                     seconds: float) -> None:
        _, tpot = self.slos.get(labels[:2], (None, None))
        self.tpot.observe((*labels, prompt_class(prompt_tokens)), seconds, tpot)

    def count(self, labels: tuple[str, str, str, str], prompt_tokens: int,
              outcome: Outcome) -> None:
        self.requests.labels(*labels, prompt_class(prompt_tokens), outcome.value).inc()

    def observe_e2e(self, labels: tuple[str, str, str, str], prompt_tokens: int,
                    seconds: float) -> None:
        # No SLO of its own: judged against stable, or by a custom threshold on the ladder.
        self.e2e.observe((*labels, prompt_class(prompt_tokens)), seconds, None)

    def check_answer(self, labels: tuple[str, str, str, str], text: str,
                     finish_reasons: list[str] | tuple[str, ...], max_tokens: int | None = None,
                     partial: bool = False) -> None:
        if partial and not text.strip():
            return  # (a client gone before any text: nothing to judge)
        self.answers_checked.labels(*labels).inc()
        for flag in answers.flags(text, finish_reasons, max_tokens, partial):
            self.answer_flags.labels(*labels, flag).inc()

    def declare(self, series: Iterable[tuple[str, str, str, str]]) -> None:
        """Create every outcome's request counter at 0 for these (namespace, pool, revision,
        traffic): a counter that first appears at 1 has no earlier sample, so increase() over
        a window would miss a revision's first error of a kind."""
        series = set(series)
        now = time.monotonic()
        current = {labels[:3] for labels in series}
        for revision, since in list(self._routed.items()):
            if revision not in current and since is None:
                self._routed[revision] = now  # it left the tables: its retention starts
        self._routed.update(dict.fromkeys(current))
        for labels in series:
            for outcome in Outcome:
                for prompt in PROMPT_CLASSES:
                    self.requests.labels(*labels, prompt, outcome.value)
            self.answers_checked.labels(*labels)
            for flag in ANSWER_FLAGS:
                self.answer_flags.labels(*labels, flag)
            if labels[:2] not in self._known_pools:  # idle from now on, not since 1970
                self._known_pools.add(labels[:2])
                self.last_request.labels(*labels[:2]).set_to_current_time()

    def declare_probes(self, series: Iterable[tuple[str, str, str]]) -> None:
        """Probe counters at 0 for these (namespace, pool, revision), for the same reason."""
        for labels in series:
            for outcome in PROBE_OUTCOMES:
                self.probes.labels(*labels, outcome)
            self.probes_agreed.labels(*labels)
            for kind in ("agreed", "compared"):
                self.probe_tokens.labels(*labels, kind)

    def sweep(self, now: float, retain: float = RETAIN_SECONDS) -> None:
        """Forget the revisions that left every traffic table `retain` seconds ago."""
        for revision, since in list(self._routed.items()):
            if since is not None and now - since >= retain:
                del self._routed[revision]
                self.forget(revision)

    def forget(self, revision: tuple[str, str, str]) -> None:
        """Remove every series of (namespace, pool, revision), from every metric."""
        for histogram in (self.ttft, self.tpot, self.e2e):
            histogram.forget(revision)
        for metric in (self.requests, self.tokens, self.answers_checked, self.answer_flags,
                       self.shadow, self.divergence, self.probes, self.probes_agreed,
                       self.probe_tokens, self.first_divergence):
            # (prometheus_client keeps a labelled metric's children by their label values;
            # every one of these starts with namespace, pool, revision.)
            for labels in [k for k in list(metric._metrics) if k[:3] == revision]:
                metric.remove(*labels)

    def exposition(self) -> bytes:
        self.sweep(time.monotonic())
        return generate_latest(self.registry)
