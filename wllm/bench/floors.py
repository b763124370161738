"""Hardware floors: the best time physics allows for a workload.

Decode is bandwidth-bound: every step reads all weights plus every KV byte of the batch once.
Prefill is compute-bound: 2 FLOPs per parameter per token plus the attention matmuls. Offline
throughput is bounded by whichever of the two is larger. "Parameters" means all of them, the
embedding table included (16.06 GB of bf16 weights for Llama-3.1-8B), so the fractions printed
here are comparable with the figures in benchmarks/RESULTS.md. Sliding windows are ignored:
they are off in the standard shapes, and elsewhere they only trim the small attention term.
"""

from __future__ import annotations

from dataclasses import dataclass

from wllm.bench.shapes import ShapeStats


@dataclass(frozen=True)
class Hardware:
    """Measured ceilings of one accelerator."""

    name: str
    bandwidth: float  # bytes / s, measured device-to-device copy
    flops: float  # FLOP / s, measured bf16 dense matmul


# The H200's measured ceilings (the method and the runs: benchmarks/RESULTS.md).
H200 = Hardware("NVIDIA H200", bandwidth=4232e9, flops=758e12)


def _sum_range(lo: int, hi: int) -> int:
    """lo + (lo+1) + ... + hi (0 when hi < lo)."""
    return (lo + hi) * (hi - lo + 1) // 2 if hi >= lo else 0


def decode_floor_tok_s(stats: ShapeStats, prompt_len: int, output_len: int, hw: Hardware = H200) -> float:
    """Best batch-1 decode rate for output tokens 2..output_len after a `prompt_len` prompt.

    The first token comes from the prefill; each later step feeds one token and reads all
    weights plus the KV of its context (prompt_len + 1 ... prompt_len + output_len - 1 tokens).
    Matches the measured rate (output_len - 1) / (t(output_len) - t(1)).
    """
    steps = max(output_len - 1, 1)
    kv_tokens = _sum_range(prompt_len + 1, prompt_len + steps)
    total_bytes = steps * stats.weight_bytes + kv_tokens * stats.kv_bytes_per_token
    return steps / (total_bytes / hw.bandwidth)


def causal_attention_flops(stats: ShapeStats, past: int, new: int) -> float:
    """Score and value matmul FLOPs for `new` tokens appended after `past` cached ones, causal:
    token i attends to past + i + 1 keys, 2 matmuls x 2 FLOPs per multiply-add."""
    keys = _sum_range(past + 1, past + new)
    return 4.0 * keys * stats.attn_width * stats.num_layers


def prefill_flops(stats: ShapeStats, prompt_len: int) -> float:
    """FLOPs of one prompt's forward pass: 2 x params x tokens + causal attention."""
    return 2.0 * stats.num_params * prompt_len + causal_attention_flops(stats, 0, prompt_len)


def prefill_floor_tok_s(stats: ShapeStats, prompt_len: int, hw: Hardware = H200) -> float:
    """Best prompt tokens per second for one prompt of `prompt_len` tokens."""
    return prompt_len / (prefill_flops(stats, prompt_len) / hw.flops)


@dataclass(frozen=True)
class ThroughputFloor:
    compute_s: float
    bandwidth_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.bandwidth_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.bandwidth_s else "bandwidth"


def throughput_floor(stats: ShapeStats, num_requests: int, prompt_len: int, output_len: int,
                     hw: Hardware = H200) -> ThroughputFloor:
    """Best wall time for `num_requests` prompts of `prompt_len` tokens, `output_len` outputs each.

    Compute: each request runs prompt_len + output_len - 1 tokens through the model (the last
    output token is sampled, never fed back). Bandwidth: at least output_len steps (one prefill,
    output_len - 1 decodes with every request in the batch), each reading all weights, plus
    every decode step reading each request's KV and every token's KV being written once.
    """
    decodes = output_len - 1
    tokens = prompt_len + decodes
    flops = num_requests * (2.0 * stats.num_params * tokens + causal_attention_flops(stats, 0, prompt_len)
                            + causal_attention_flops(stats, prompt_len, decodes))
    kv_read = num_requests * _sum_range(prompt_len + 1, prompt_len + decodes)
    kv_written = num_requests * tokens
    total_bytes = output_len * stats.weight_bytes + (kv_read + kv_written) * stats.kv_bytes_per_token
    return ThroughputFloor(compute_s=flops / hw.flops, bandwidth_s=total_bytes / hw.bandwidth)
