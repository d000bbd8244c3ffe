"""Prometheus metrics of one server instance (its own registry: no global state).

Two kinds: engine gauges/counters read from the engine thread's latest `stats()` snapshot
at scrape time (a custom collector), and request-level histograms and counters the HTTP
handlers update as tokens stream out. Every name starts with `pagedkv_`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Why a request was refused: the `reason` label of pagedkv_rejected_requests_total.
REJECT_REASONS = (
    "invalid_json",  # 400: the body is not JSON
    "schema",  # 400: a field has a bad type or value, is unknown, or is not supported
    "model_not_found",  # 404: another model's name
    "context_length",  # 400: prompt + max_tokens beyond the model's context
    "invalid_request",  # 400: refused by the engine (token ids, pool size, ...)
    "overloaded",  # 503: the waiting queue is full
    "unavailable",  # 503: the engine is shutting down or stopped
    "payload_too_large",  # 413: the body is over --max-request-body-bytes
    "limit",  # 400: over a request limit (--max-n, --max-prompts-per-request, ...)
)

# (stats key, metric name, help); gauges are levels, counters only ever grow.
_GAUGES = (
    ("num_blocks", "pagedkv_kv_blocks_total", "KV cache blocks in the device pool."),
    ("num_used_blocks", "pagedkv_kv_blocks_used", "KV cache blocks referenced by requests."),
    ("num_free_blocks", "pagedkv_kv_blocks_free", "KV cache blocks free (cached ones included)."),
    ("num_cached_blocks", "pagedkv_kv_blocks_cached", "Blocks holding a reusable cached prefix."),
    ("num_requests_running", "pagedkv_num_requests_running", "Requests in the running batch."),
    ("num_requests_waiting", "pagedkv_num_requests_waiting", "Requests waiting to be scheduled."),
    ("num_requests_swapped", "pagedkv_num_requests_swapped", "Requests swapped out to host."),
)
_COUNTERS = (
    (
        "prefix_cache_queries",
        "pagedkv_prefix_cache_queries_tokens",
        "Prompt tokens looked up in the prefix cache.",
    ),
    (
        "prefix_cache_hits",
        "pagedkv_prefix_cache_hits_tokens",
        "Prompt tokens found in the prefix cache (their computation skipped).",
    ),
    ("num_preemptions", "pagedkv_num_preemptions", "Requests preempted (recompute or swap)."),
    ("num_cow_copies", "pagedkv_num_cow_copies", "Blocks copied on write."),
    ("num_swapped_out", "pagedkv_num_swap_outs", "Swap-outs of a request to host memory."),
    (
        "prefix_cache_disk_hits",
        "pagedkv_prefix_cache_disk_hits_blocks",
        "Blocks read back from the prefix cache's disk tier.",
    ),
    (
        "prefix_cache_disk_misses",
        "pagedkv_prefix_cache_disk_misses",
        "Disk-tier lookups that found no block, and block files that failed verification.",
    ),
    (
        "prefix_cache_disk_bytes_read",
        "pagedkv_prefix_cache_disk_read_bytes",
        "Bytes of KV read from the prefix cache's disk tier.",
    ),
    (
        "prefix_cache_disk_bytes_written",
        "pagedkv_prefix_cache_disk_written_bytes",
        "Bytes of block files written to the prefix cache's disk tier.",
    ),
    (
        "prefix_cache_disk_evictions",
        "pagedkv_prefix_cache_disk_evictions_blocks",
        "Block files deleted to keep the disk tier within its size.",
    ),
    (
        "prefix_cache_host_hits",
        "pagedkv_prefix_cache_host_hits_blocks",
        "Blocks read back from the prefix cache's host-memory tier.",
    ),
    (
        "prefix_cache_host_misses",
        "pagedkv_prefix_cache_host_misses",
        "Host-tier lookups that found no block.",
    ),
    (
        "prefix_cache_host_bytes_read",
        "pagedkv_prefix_cache_host_read_bytes",
        "Bytes of KV read from the prefix cache's host-memory tier.",
    ),
    (
        "prefix_cache_host_bytes_written",
        "pagedkv_prefix_cache_host_written_bytes",
        "Bytes of KV stored in the prefix cache's host-memory tier.",
    ),
    (
        "prefix_cache_host_evictions",
        "pagedkv_prefix_cache_host_evictions_blocks",
        "Blocks the host-memory tier evicted (on to the disk tier, if there is one).",
    ),
)
# Latency buckets (seconds) from sub-millisecond CPU steps to multi-second prefills.
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ServerMetrics(Collector):
    """The metrics of one server; `render()` is the `/metrics` body, and calls `stats_fn()`
    (the engine's latest stats dict) at every scrape."""

    def __init__(self, stats_fn: Callable[[], dict[str, Any]]) -> None:
        self._stats_fn = stats_fn
        self.registry = reg = CollectorRegistry()
        reg.register(self)

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=reg)

        self.time_to_first_token = latency(
            "pagedkv_time_to_first_token_seconds", "Request arrival to its first token."
        )
        self.inter_token_latency = latency(
            "pagedkv_inter_token_latency_seconds", "Time between consecutive tokens of a sample."
        )
        self.request_latency = latency(
            "pagedkv_e2e_request_latency_seconds", "Request arrival to its last token."
        )
        self.prompt_tokens = Counter(
            "pagedkv_prompt_tokens", "Prompt tokens of finished requests.", registry=reg
        )
        self.generation_tokens = Counter(
            "pagedkv_generation_tokens", "Tokens generated (all samples).", registry=reg
        )
        self.requests = Counter(
            "pagedkv_requests",
            "Requests ended, by finish reason (stop, length, abort, error).",
            ["finish_reason"],
            registry=reg,
        )
        self.rejected = Counter(
            "pagedkv_rejected_requests",
            "Requests refused before admission, by reason (see REJECT_REASONS).",
            ["reason"],
            registry=reg,
        )
        self.auth_failures = Counter(
            "pagedkv_auth_failures",
            "Requests refused for a missing or wrong API key (401), before reading their body.",
            registry=reg,
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)  # every series exists from the start, at 0

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """The engine's gauges and counters from its latest stats (the registry's scrape)."""
        stats = self._stats_fn()
        for key, name, doc in _GAUGES:
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))
        if stats.get("num_blocks"):
            used = float(stats.get("num_used_blocks", 0))
            yield GaugeMetricFamily(
                "pagedkv_kv_cache_usage_ratio",
                "Fraction of KV blocks in use.",
                value=used / stats["num_blocks"],
            )
        for key, name, doc in _COUNTERS:
            if key in stats:
                yield CounterMetricFamily(name, doc, value=float(stats[key]))
        queries = float(stats.get("prefix_cache_queries", 0))
        hits = float(stats.get("prefix_cache_hits", 0))
        yield GaugeMetricFamily(
            "pagedkv_prefix_cache_hit_rate",
            "Prefix cache hits / queries (tokens), since start.",
            value=hits / queries if queries else 0.0,
        )
