"""Prometheus metrics of one engine process: every name is defined here and only here.

Labels are `model` and `revision` (plus `finish_reason` on `requests_total`): bounded sets,
never request ids, tenants or text, so a fleet of engines keeps a small, fixed number of
series. Each `EngineMetrics` owns its registry, so tests can build several side by side.

Definitions (DESIGN.md):
    TTFT = first_token_time - arrival_time
    TPOT = (last_token_time - first_token_time) / (output_tokens - 1)   observed only for N > 1
    queue time = first_scheduled_time - arrival_time

Per-request metrics (requests, tokens, latencies) count clients' requests only: the engine's
warm-up generation before READY is not observed (`GenerationSpec.internal`).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "kvfleet_engine_"
CONTENT_TYPE = CONTENT_TYPE_LATEST
LABELS = ("model", "revision")

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
)
_TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
    2.5,
)
FINISH_REASONS = ("stop", "length", "cancelled", "deadline", "error")


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine core's state; the cumulative counters only ever grow."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_prefix_cache_queries: int
    num_prefix_cache_hits: int
    num_preemptions: int


@dataclass(frozen=True, slots=True)
class FinishedRequestTimings:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finish_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str


class EngineMetrics:
    def __init__(self, model: str, revision: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._labels = {"model": model, "revision": revision}
        reg = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, LABELS, registry=reg, buckets=buckets)

        self.ttft = hist("time_to_first_token_seconds",
                         "Seconds from arrival to the first output token.", LATENCY_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Mean seconds per output token after the first (requests with >1 "
                         "output token).", _TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "Seconds from arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = hist("queue_time_seconds",
                               "Seconds from arrival to first being scheduled.", LATENCY_BUCKETS)
        self.running = Gauge(PREFIX + "requests_running", "Requests holding KV blocks.",
                             LABELS, registry=reg)
        self.waiting = Gauge(PREFIX + "requests_waiting", "Requests waiting to be scheduled.",
                             LABELS, registry=reg)
        # What this engine really allocated (the operator compares it with its plan).
        self.cache_config = Gauge(
            PREFIX + "cache_config_info", "The KV cache allocated at start: 1, with its "
            "shape as labels.", (*LABELS, "block_size", "num_blocks", "kv_dtype", "device"),
            registry=reg)
        # The same under vLLM's name and label names (the endpoint picker of the Gateway API
        # Inference Extension reads block_size and num_gpu_blocks from it).
        self.vllm_cache_config = Gauge(
            "vllm:cache_config_info", "The KV cache allocated at start: 1, with its shape as "
            "labels (vLLM's name).", (*LABELS, "block_size", "num_gpu_blocks", "cache_dtype"),
            registry=reg)
        self.kv_blocks = Gauge(PREFIX + "kv_cache_blocks", "KV cache blocks allocated (the "
                               "operator compares the fewest a revision's engines have with "
                               "its plan).", LABELS, registry=reg)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_ratio",
                              "Fraction of KV cache blocks in use (0..1).", LABELS, registry=reg)
        # The same three under the model-server names the Gateway API Inference Extension's
        # endpoint picker reads, so a pool can also sit behind an InferencePool.
        self.vllm_gauges = (
            Gauge("vllm:num_requests_running", "Requests holding KV blocks (vLLM's name).",
                  LABELS, registry=reg),
            Gauge("vllm:num_requests_waiting", "Requests waiting (vLLM's name).", LABELS,
                  registry=reg),
            Gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use, 0..1 "
                  "(vLLM's name).", LABELS, registry=reg),
        )

        def counter(name: str, doc: str, labels: tuple[str, ...] = LABELS) -> Counter:
            # prometheus_client appends `_total`; the name here is without it.
            return Counter(PREFIX + name, doc, labels, registry=reg)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("preemptions", "Requests preempted (recomputed later).")
        self.requests = counter("requests", "Finished requests by finish reason.",
                                (*LABELS, "finish_reason"))
        for metric in (self.ttft, self.tpot, self.e2e, self.queue_time, self.running,
                       self.waiting, self.kv_usage, *self.vllm_gauges, self.prompt_tokens,
                       self.generation_tokens,
                       self.prefix_queries, self.prefix_hits, self.preemptions):
            metric.labels(**self._labels)  # every series exists from the first scrape
        for reason in FINISH_REASONS:
            self.requests.labels(**self._labels, finish_reason=reason)
        self._last = EngineStats(0, 0, 0.0, 0, 0, 0)

    def record_cache_config(self, block_size: int, num_blocks: int, kv_dtype: str,
                            device: str) -> None:
        self.cache_config.labels(**self._labels, block_size=str(block_size),
                                 num_blocks=str(num_blocks), kv_dtype=kv_dtype,
                                 device=device).set(1)
        self.vllm_cache_config.labels(**self._labels, block_size=str(block_size),
                                      num_gpu_blocks=str(num_blocks), cache_dtype=kv_dtype).set(1)
        self.kv_blocks.labels(**self._labels).set(num_blocks)

    def observe_stats(self, stats: EngineStats) -> None:
        """Record a snapshot: gauges are set, cumulative counters advance by the difference."""
        labels = self._labels
        self.running.labels(**labels).set(stats.num_running)
        self.waiting.labels(**labels).set(stats.num_waiting)
        self.kv_usage.labels(**labels).set(stats.kv_cache_usage)
        for gauge, value in zip(self.vllm_gauges, (stats.num_running, stats.num_waiting,
                                                   stats.kv_cache_usage), strict=True):
            gauge.labels(**labels).set(value)
        last = self._last
        for counter, now, before in (
            (self.prefix_queries, stats.num_prefix_cache_queries, last.num_prefix_cache_queries),
            (self.prefix_hits, stats.num_prefix_cache_hits, last.num_prefix_cache_hits),
            (self.preemptions, stats.num_preemptions, last.num_preemptions),
        ):
            if now > before:
                counter.labels(**labels).inc(now - before)
        self._last = stats

    def observe_new_tokens(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.generation_tokens.labels(**self._labels).inc(num_tokens)

    def observe_admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(**self._labels).inc(num_prompt_tokens)

    def observe_finished(self, t: FinishedRequestTimings) -> None:
        labels = self._labels
        self.requests.labels(**labels, finish_reason=t.finish_reason).inc()
        self.e2e.labels(**labels).observe(max(0.0, t.finish_time - t.arrival_time))
        if t.first_scheduled_time is not None:
            self.queue_time.labels(**labels).observe(
                max(0.0, t.first_scheduled_time - t.arrival_time))
        if t.first_token_time is not None:
            self.ttft.labels(**labels).observe(max(0.0, t.first_token_time - t.arrival_time))
            if t.num_output_tokens > 1 and t.last_token_time is not None:
                self.tpot.labels(**labels).observe(
                    max(0.0, t.last_token_time - t.first_token_time) / (t.num_output_tokens - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
