"""The router's Prometheus series: what clients observed, per pool, revision and traffic kind.

These are the series the Rollout analysis reads (canary vs stable); every name is defined here.

    kvfleet_router_time_to_first_token_seconds{pool,revision,traffic}    histogram
    kvfleet_router_time_per_output_token_seconds{pool,revision,traffic}  histogram (N > 1 tokens)
    kvfleet_router_e2e_request_latency_seconds{pool,revision,traffic}    histogram
    kvfleet_router_requests_total{pool,revision,traffic,code}            counter (HTTP status;
                                                                         "stream_error" for a
                                                                         stream cut after 200)
    kvfleet_router_tokens_total{pool,revision,traffic,kind}              counter (prompt|generation)
    kvfleet_router_rejections_total{pool,reason}                         counter (before an engine:
                                                                         unauthorized, quota
                                                                         limit names, ...)
    kvfleet_router_shadow_comparisons_total{pool,revision,outcome}       counter (identical,
                                                                         diverged, length,
                                                                         finish_reason, error,
                                                                         shed)
    kvfleet_router_shadow_first_divergence_chars{pool,revision}          histogram

`traffic` is "live" or "shadow"; `revision` is the 12-digit short manifest hash. Tenants are
not labels (unbounded); per-tenant usage goes to each TenantQuota's status instead.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

PREFIX = "kvfleet_router_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                   2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.5)
LABELS = ("pool", "revision", "traffic")


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
                                (*LABELS, "code"), registry=r)
        self.tokens = Counter(PREFIX + "tokens_total", "Tokens by kind", (*LABELS, "kind"),
                              registry=r)
        self.rejections = Counter(PREFIX + "rejections_total",
                                  "Requests refused before an engine", ("pool", "reason"),
                                  registry=r)
        self.shadow = Counter(PREFIX + "shadow_comparisons_total",
                              "Shadow answers compared with the live ones",
                              ("pool", "revision", "outcome"), registry=r)
        self.divergence = Histogram(PREFIX + "shadow_first_divergence_chars",
                                    "First differing character of greedy shadow answers",
                                    ("pool", "revision"),
                                    buckets=(0, 1, 4, 16, 64, 256, 1024, 4096), registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
