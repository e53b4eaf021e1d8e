"""The server's Prometheus figures (``GET /metrics``), in a registry of the app's own."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..decoding import DecodeStats

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class ServerMetrics:
    """Requests by endpoint and status, output tokens, target forwards, drafted and accepted
    tokens by drafter kind, queue depth, rows decoding, KV and prefix-cache bytes, and latency histograms (whole request,
    time to first token, time per output token after the first)."""

    def __init__(self, queue_depth: Callable[[], float], decoding: Callable[[], float],
                 kv_bytes: Callable[[], float] = lambda: 0.0, prefix_bytes: Callable[[], float] = lambda: 0.0) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("constrained_spec_requests", "Requests answered, by endpoint and HTTP status.",
                                ["endpoint", "status"], registry=r)
        self.output_tokens = Counter("constrained_spec_output_tokens", "Output tokens generated.", registry=r)
        self.target_forwards = Counter("constrained_spec_target_forwards",
                                       "Target forwards each request took part in (summed over requests; over "
                                       "output tokens: forwards per token).", registry=r)
        self.drafted = Counter("constrained_spec_drafted_tokens", "Draft tokens verified, by drafter kind.", ["kind"],
                               registry=r)
        self.accepted = Counter("constrained_spec_accepted_tokens", "Draft tokens accepted, by drafter kind.", ["kind"],
                                registry=r)
        Gauge("constrained_spec_queue_depth", "Requests waiting for a slot.", registry=r).set_function(queue_depth)
        Gauge("constrained_spec_rows_decoding", "Requests decoding now.", registry=r).set_function(decoding)
        Gauge("constrained_spec_kv_cache_bytes", "Bytes the batch engine's KV cache holds now.",
              registry=r).set_function(kv_bytes)
        Gauge("constrained_spec_prefix_cache_bytes", "Bytes the prefix cache's prompt blocks hold now.",
              registry=r).set_function(prefix_bytes)
        self.latency = Histogram("constrained_spec_request_seconds", "Whole-request latency.",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("constrained_spec_time_to_first_token_seconds", "Time to the first output token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.per_token = Histogram("constrained_spec_time_per_output_token_seconds",
                                   "Time per output token after the first.", buckets=_TOKEN_BUCKETS, registry=r)

    def add_decode(self, stats: DecodeStats) -> None:
        """Fold one finished request's figures in."""
        self.output_tokens.inc(stats.output_tokens)
        self.target_forwards.inc(stats.target_forwards)
        for kind, row in stats.per_kind.items():
            if kind != "target" and row["drafted"]:
                self.drafted.labels(kind).inc(row["drafted"])
                self.accepted.labels(kind).inc(row["accepted"])

    def add_timing(self, seconds: float, first_token: float | None, tokens: int) -> None:
        """One request's latency, time to first token, and time per token after the first."""
        self.latency.observe(seconds)
        if first_token is not None:
            self.ttft.observe(first_token)
            if tokens > 1:
                self.per_token.observe((seconds - first_token) / (tokens - 1))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

