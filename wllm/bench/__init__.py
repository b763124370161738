"""Benchmarks: batch-1 decode latency, prefill, and offline throughput.

Each measures wLLM through `wllm.LLM(..., load_format="dummy")`, HF transformers in the same
process, and the hardware floor (`floors`), and reports how they compare. Entry points:
`wllm bench ...` (wllm/entrypoints/bench_cli.py) and benchmarks/gpu_*.py.
"""

from wllm.bench.floors import H200, Hardware
from wllm.bench.report import BenchError, BenchResult, format_table
from wllm.bench.shapes import Shape, ShapeStats, resolve_shape, shape_stats
from wllm.bench.suite import BENCHMARKS, BenchConfig

__all__ = [
    "BENCHMARKS",
    "H200",
    "BenchConfig",
    "BenchError",
    "BenchResult",
    "Hardware",
    "Shape",
    "ShapeStats",
    "format_table",
    "resolve_shape",
    "shape_stats",
]
