"""The router's Prometheus series: what clients observed, per pool, revision and traffic kind.

These are the series the Rollout analysis reads (canary vs stable); every name is defined here.

    kvfleet_router_time_to_first_token_seconds{namespace,pool,revision,traffic}    histogram
        (to the first frame with text: not a role-only delta, not an error frame)
    kvfleet_router_time_per_output_token_seconds{namespace,pool,revision,traffic}  histogram
        (streams of N > 1 tokens)
    kvfleet_router_e2e_request_latency_seconds{namespace,pool,revision,traffic}    histogram
        (streamed or not; outcomes completed, stream_error, revision_refused)
    kvfleet_router_requests_total{namespace,pool,revision,traffic,outcome}         counter
        (kvfleet.router.outcome: completed, stream_error, revision_refused, client_error,
        upstream_error, client_gone; every outcome created at 0 for each revision in a
        traffic table, so increase() sees a new outcome's first requests)
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
        shed; created at 0 while a table asks for probes)
    kvfleet_router_probe_tokens_total{namespace,pool,revision,kind}                counter
        (agreed: the common prefix of the two answers; compared: the longer answer's tokens)
    kvfleet_router_probe_first_divergence{namespace,pool,revision,probe}           gauge
        (the first probe whose answers differed on this router: its tenant-salted prompt id,
        and the token where they part)

`namespace` is the ServingPool's (pools of one name in two namespaces are two series under a
cluster-wide router); scrape the router with honor_labels so a scraper's own `namespace`
target label (the router pod's) does not replace it. `traffic` is "live" or "shadow";
`revision` is the 12-digit short manifest hash. Tenants are not labels (unbounded); per-tenant
usage goes to each TenantQuota's status instead.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvfleet.router.outcome import Outcome

PREFIX = "kvfleet_router_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                   2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.5)
LABELS = ("namespace", "pool", "revision", "traffic")
PROBE_OUTCOMES = ("compared", "error", "shed")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Client-observed time to first token", LABELS,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Client-observed time per output token after the first", LABELS,
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Client-observed request latency", LABELS,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter(PREFIX + "requests_total", "Requests by outcome",
                                (*LABELS, "outcome"), registry=r)
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
        probe = ("namespace", "pool", "revision")
        self.probes = Counter(PREFIX + "probes_total", "Greedy probes by outcome",
                              (*probe, "outcome"), registry=r)
        self.probe_tokens = Counter(PREFIX + "probe_tokens_total",
                                    "Greedy probe tokens agreed and compared",
                                    (*probe, "kind"), registry=r)
        self.first_divergence = Gauge(PREFIX + "probe_first_divergence",
                                      "Token where the first diverging probe's answers part",
                                      (*probe, "probe"), registry=r)

    def declare(self, series: Iterable[tuple[str, str, str, str]]) -> None:
        """Create every outcome's request counter at 0 for these (namespace, pool, revision,
        traffic): a counter that first appears at 1 has no earlier sample, so increase() over
        a window would miss a revision's first error of a kind."""
        for labels in series:
            for outcome in Outcome:
                self.requests.labels(*labels, outcome.value)

    def declare_probes(self, series: Iterable[tuple[str, str, str]]) -> None:
        """Probe counters at 0 for these (namespace, pool, revision), for the same reason."""
        for labels in series:
            for outcome in PROBE_OUTCOMES:
                self.probes.labels(*labels, outcome)
            for kind in ("agreed", "compared"):
                self.probe_tokens.labels(*labels, kind)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
