"""GET /v1/engine/stats: the engine's gauges and counters plus live latency percentiles, as one JSON object.

What /metrics has, shaped for a browser that polls it every second (the web UI's engine view): the
engine's own stats (`engine.stats()`, read by name; an engine that does not report a field gets 0 or
null), the server's tokens/s, and percentiles of the last minute's time to first token and
inter-token latency.
"""

from __future__ import annotations

import time
from typing import Any

from wllm.entrypoints.openai.protocol import (
    EngineStatsResponse,
    KVCacheStats,
    LatencyPercentiles,
    PreemptionStats,
    PrefixCacheStats,
    RequestCounts,
)
from wllm.entrypoints.openai.serving_common import ServerContext
from wllm.observability.metrics import RecentSamples


def _get(stats: Any, name: str) -> Any:
    return stats.get(name) if isinstance(stats, dict) else getattr(stats, name, None)


def _int(stats: Any, name: str) -> int | None:
    value = _get(stats, name)
    return None if value is None else int(value)


def _percentiles(samples: RecentSamples) -> LatencyPercentiles:
    count, (p50, p90, p99) = samples.percentiles((0.5, 0.9, 0.99))
    return LatencyPercentiles(count=count, p50=p50, p90=p90, p99=p99)


def engine_stats(ctx: ServerContext) -> EngineStatsResponse:
    """A snapshot of the engine and the server's recent latencies."""
    try:
        stats: Any = ctx.engine.stats()
    except Exception:  # a failed engine still gets an answer: healthy is false, the gauges 0
        stats = {}
    stats = stats if stats is not None else {}
    total, free = _int(stats, "num_gpu_blocks"), _int(stats, "num_free_blocks")
    swap = _int(stats, "num_preemptions_swap") or 0
    recompute = _int(stats, "num_preemptions_recompute") or 0
    preempted = _int(stats, "num_preemptions")
    metrics = ctx.metrics
    return EngineStatsResponse(
        time=time.time(),
        healthy=ctx.engine.is_healthy(),
        requests=RequestCounts(
            running=_int(stats, "num_running") or 0,
            waiting=_int(stats, "num_waiting") or 0,
            swapped=_int(stats, "num_swapped") or 0,
        ),
        tokens_per_second=metrics.tokens_per_second(),
        generation_tokens=metrics.generated_total,
        kv_cache=KVCacheStats(
            usage=float(_get(stats, "kv_cache_usage") or 0.0),
            blocks_total=total,
            blocks_used=None if total is None or free is None else total - free,
            blocks_cached=_int(stats, "num_cached_blocks"),
        ),
        prefix_cache=PrefixCacheStats(
            hit_rate=float(_get(stats, "prefix_cache_hit_rate") or 0.0),
            queries=_int(stats, "prefix_cache_queries") or 0,
            hits=_int(stats, "prefix_cache_hits") or 0,
        ),
        preemptions=PreemptionStats(
            total=preempted if preempted is not None else swap + recompute, swap=swap, recompute=recompute
        ),
        window_s=metrics.recent_ttft.window_s,
        ttft_s=_percentiles(metrics.recent_ttft),
        itl_s=_percentiles(metrics.recent_itl),
    )
