"""Timing wLLM through its public offline API, `wllm.LLM(..., load_format="dummy").generate`.

Every timed call gets prompts no earlier call has seen, so the prefix cache never shortens a
prefill that the measurement assumes is done in full.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from wllm.bench.report import BenchError
from wllm.bench.shapes import Shape


@dataclass
class EngineOptions:
    """How the wLLM engine is built for a benchmark. `engine_args` are extra LLM(...) keywords
    (EngineConfig fields such as max_num_batched_tokens) and win over the fields here."""

    device: str = "auto"
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.6
    kv_cache_memory: int = 512 << 20  # the KV cache on the CPU (ignored on CUDA)
    max_model_len: int | None = None  # None: 4096, or the workload's length when longer
    seed: int = 0
    quantization: str | None = None  # random GGUF blocks of this preset (q4_k_m, q8_0, ...) instead of dense
    engine_args: dict[str, Any] = field(default_factory=dict)


class PromptSource:
    """Fresh random token-id prompts from a seeded generator (ids below `vocab_size`)."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self._gen = torch.Generator().manual_seed(seed)

    def take(self, count: int, length: int) -> list[list[int]]:
        return torch.randint(0, self.vocab_size, (count, length), generator=self._gen).tolist()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory() -> None:
    """Give freed model and cache memory back before the next model is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_llm(shape: Shape, opts: EngineOptions, workload_len: int) -> Any:
    """An LLM over `shape` with random weights; returns it (import kept lazy for `--help`)."""
    from wllm.entrypoints.llm import LLM

    max_len = opts.max_model_len or max(4096, workload_len)
    kwargs: dict[str, Any] = {
        "device": opts.device,
        "dtype": opts.dtype,
        "gpu_memory_utilization": opts.gpu_memory_utilization,
        "kv_cache_memory": opts.kv_cache_memory,
        "max_model_len": max_len,
        "seed": opts.seed,
    }
    if opts.quantization is not None:
        kwargs["quantization"] = opts.quantization
    kwargs.update(opts.engine_args)
    return LLM(shape.source, load_format="dummy", **kwargs)


def _params(max_tokens: int) -> Any:
    from wllm.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def timed_generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds for `llm.generate` to finish every prompt with exactly `max_tokens` tokens."""
    device = llm.engine.worker.device
    synchronize(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, _params(max_tokens))
    synchronize(device)
    elapsed = time.perf_counter() - start
    for out in outs:
        got = len(out.outputs[0].token_ids)
        if out.error or got != max_tokens:
            raise BenchError(f"wLLM request {out.request_id} finished with {got} of {max_tokens} tokens "
                               f"(finish_reason={out.outputs[0].finish_reason}, error={out.error})")
    return elapsed


@dataclass
class LatencyTiming:
    """Batch-1 timings: medians over runs of the 1-token call and the full-length call."""

    first_token_s: float
    total_s: float
    output_len: int
    runs_first_s: list[float]
    runs_total_s: list[float]

    @property
    def decode_tok_s(self) -> float:
        """Decode rate after the first token: (n - 1) / (t(n) - t(1))."""
        steps = self.output_len - 1
        span = self.total_s - self.first_token_s
        if steps < 1 or span <= 0:
            return self.output_len / self.total_s
        return steps / span


def latency_timing(call: Any, prompts: PromptSource, prompt_len: int, output_len: int, runs: int,
                   warmup: int) -> LatencyTiming:
    """Median timings of `call(prompt_ids_batch, max_tokens) -> seconds` at batch 1."""
    for _ in range(warmup):
        call(prompts.take(1, prompt_len), min(output_len, 8))
    firsts, totals = [], []
    for _ in range(runs):
        firsts.append(call(prompts.take(1, prompt_len), 1))
        totals.append(call(prompts.take(1, prompt_len), output_len))
    return LatencyTiming(statistics.median(firsts), statistics.median(totals), output_len, firsts, totals)


def wllm_latency(llm: Any, prompts: PromptSource, prompt_len: int, output_len: int, runs: int,
                 warmup: int) -> LatencyTiming:
    """Batch-1 decode: `runs` pairs of (1 token, output_len tokens) after `warmup` calls."""
    return latency_timing(lambda batch, n: timed_generate(llm, batch, n), prompts, prompt_len, output_len,
                          runs, warmup)


def wllm_prefill(llm: Any, prompts: PromptSource, prompt_len: int, runs: int, warmup: int) -> list[float]:
    """Seconds per call for one `prompt_len` prompt with max_tokens=1, one per run."""
    for _ in range(warmup):
        timed_generate(llm, prompts.take(1, prompt_len), 1)
    return [timed_generate(llm, prompts.take(1, prompt_len), 1) for _ in range(runs)]


def wllm_throughput(llm: Any, prompts: PromptSource, num_requests: int, prompt_len: int, output_len: int,
                    warmup: int, runs: int = 1) -> list[float]:
    """Wall seconds for all requests submitted at once (new random prompts each time), one per run,
    after warm-up batches of a few requests."""
    for _ in range(warmup):
        timed_generate(llm, prompts.take(min(num_requests, 8), prompt_len), min(output_len, 4))
    return [timed_generate(llm, prompts.take(num_requests, prompt_len), output_len) for _ in range(max(runs, 1))]
