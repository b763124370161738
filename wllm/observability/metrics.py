"""Prometheus metrics for the server and the engine (prometheus-client, one registry per app).

Request-level series are updated as requests run; engine gauges (queue length, running requests,
KV usage, prefix-cache hit rate, preemptions) are read from `engine.stats()` at scrape time, so
they are never stale and cost nothing between scrapes. Time to first token and inter-token latency are
also kept as raw samples of the last minute (`RecentSamples`), for the live percentiles of
`GET /v1/engine/stats` (the web UI's engine view); the histograms stay cumulative, as Prometheus wants.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                    80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
                2.5)


def _stat(stats: Any, *names: str) -> float | None:
    for name in names:
        value = stats.get(name) if isinstance(stats, dict) else getattr(stats, name, None)
        if value is not None:
            return float(value)
    return None


class RecentSamples:
    """The values observed in the last `window_s` seconds (at most the newest `max_samples`), for live
    percentiles. Thread-safe; adding is O(1), a percentile read sorts the window."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 20_000) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def add(self, value: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._samples.append((now, value))

    def percentiles(self, quantiles: tuple[float, ...] = (0.5, 0.9, 0.99),
                    now: float | None = None) -> tuple[int, list[float | None]]:
        """(number of samples in the window, the value at each quantile; None without samples). Nearest rank."""
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._samples and self._samples[0][0] < now - self.window_s:
                self._samples.popleft()
            values = sorted(v for _, v in self._samples)
        if not values:
            return 0, [None for _ in quantiles]
        n = len(values)
        return n, [values[min(n - 1, max(0, math.ceil(q * n) - 1))] for q in quantiles]


class _EngineCollector(Collector):
    """Reads engine gauges and counters when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], Any], healthy: Callable[[], bool], throughput: Callable[[], float]):
        self._stats = stats
        self._healthy = healthy
        self._throughput = throughput

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily("wllm_engine_healthy", "1 while the engine is serving, 0 after it failed",
                                value=1.0 if self._healthy() else 0.0)
        yield GaugeMetricFamily("wllm_generation_tokens_per_second",
                                "Generated tokens per second over the last 10 seconds", value=self._throughput())
        try:
            stats = self._stats()
        except Exception:  # a failed engine must not break the scrape
            return
        gauges = [
            ("wllm_num_requests_waiting", "Requests waiting to be scheduled", ("num_waiting", "waiting")),
            ("wllm_num_requests_running", "Requests in the running batch", ("num_running", "running")),
            ("wllm_num_requests_swapped", "Requests preempted to the CPU swap pool", ("num_swapped", "swapped")),
            ("wllm_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0-1)",
             ("kv_cache_usage", "gpu_cache_usage")),
            ("wllm_prefix_cache_hit_rate", "Prefix cache hits / queries, in blocks, since start (0-1)",
             ("prefix_cache_hit_rate",)),
        ]
        for name, doc, keys in gauges:
            value = _stat(stats, *keys)
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("wllm_num_preemptions", "Preemptions since start", ("num_preemptions", "preemptions")),
            ("wllm_prefix_cache_queries", "Prefix cache block lookups since start", ("prefix_cache_queries",)),
            ("wllm_prefix_cache_hits", "Prefix cache block hits since start", ("prefix_cache_hits",)),
            ("wllm_prefix_cache_evictions", "Cached blocks evicted for reuse since start", ("prefix_cache_evictions",)),
            ("wllm_num_preemptions_swap", "Preemptions resolved by swapping to CPU", ("num_preemptions_swap",)),
            ("wllm_num_preemptions_recompute", "Preemptions resolved by recomputation",
             ("num_preemptions_recompute",)),
        ]
        for name, doc, keys in counters:
            value = _stat(stats, *keys)
            if value is not None:
                yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """All series of one server; pass `registry` to share one, else a private registry is made."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("wllm_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("wllm_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("wllm_inter_token_latency_seconds", "Time between successive output tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("wllm_e2e_request_latency_seconds", "Time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("wllm_request_queue_time_seconds", "Time waiting before first scheduled",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("wllm_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_prompt_tokens = Counter("wllm_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                            registry=r)
        self.generation_tokens = Counter("wllm_generation_tokens", "Tokens generated", registry=r)
        self.recent_ttft = RecentSamples()
        self.recent_itl = RecentSamples()
        self.generated_total = 0  # what the generation_tokens counter holds, readable without the registry
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        self._window_lock = threading.Lock()
        self._engine_collector: _EngineCollector | None = None

    def attach_engine(self, stats: Callable[[], Any], healthy: Callable[[], bool]) -> None:
        """Expose the engine's own gauges and counters through this registry."""
        if self._engine_collector is None:
            self._engine_collector = _EngineCollector(stats, healthy, self.tokens_per_second)
            self.registry.register(self._engine_collector)

    def observe_ttft(self, seconds: float) -> None:
        """One request's time to first token: the histogram and the last minute's samples."""
        self.ttft.observe(seconds)
        self.recent_ttft.add(seconds)

    def observe_itl(self, seconds: float) -> None:
        """One inter-token gap: the histogram and the last minute's samples."""
        self.itl.observe(seconds)
        self.recent_itl.add(seconds)

    def record_generated(self, n_tokens: int, now: float | None = None) -> None:
        """Count freshly generated tokens (feeds the counter and the tokens/s window)."""
        if n_tokens <= 0:
            return
        self.generation_tokens.inc(n_tokens)
        now = time.monotonic() if now is None else now
        with self._window_lock:
            self.generated_total += n_tokens
            self._window.append((now, n_tokens))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._window and self._window[0][0] < now - 10.0:
            self._window.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._window_lock:
            self._trim(now)
            return sum(n for _, n in self._window) / 10.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
