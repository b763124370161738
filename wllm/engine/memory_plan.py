"""What a model needs on the GPU, checked before its weights are loaded.

Weights (counted exactly from the model built on the meta device), the KV cache for one sequence of
max_model_len tokens (the least that lets the longest request run), and an estimate of the activations of
the largest step plus CUDA graphs. Loading refuses a configuration that cannot fit, with the numbers and the
context length that would fit; after the profiling step the worker sizes the cache exactly (worker.py) and
the engine checks the longest sequence again against the blocks it got.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

GiB = float(1 << 30)
# CUDA graphs' private pool and allocator slack, beyond the profiled step (a few hundred MiB measured on
# H200 for 8B shapes: decode graphs hold small per-batch buffers).
GRAPH_RESERVE = 256 << 20


class InsufficientMemoryError(ValueError):
    """The model, its KV cache and its activations do not fit in the memory wLLM may use."""


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """K and V of every layer for one token."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize


def activation_bytes(config: Any, dtype: torch.dtype, num_tokens: int, num_rows: int) -> int:
    """An upper estimate of the largest step's live activations: per token the residual stream and normed
    input, q|k|v, the attention output and the gated MLP's intermediate; per sampling row the float32 logits
    and the sampler's working copies of them."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    per_token = (4 * config.hidden_size + qkv + 3 * config.intermediate_size) * itemsize
    return num_tokens * per_token + num_rows * config.vocab_size * 4 * 3


@dataclass(frozen=True)
class GpuBudget:
    """The bytes wLLM may use on a device, and where that number came from."""

    bytes: int
    total: int
    limit: int | None
    utilization: float
    used_by_others: int
    device: str
    held_by_wllm: int = 0  # models this server loaded before this one

    def describe(self) -> str:
        cap = f"--gpu-memory-limit {gib(self.limit)}" if self.limit is not None else f"{gib(self.total)} total"
        held = f", {gib(self.held_by_wllm)} held by the models loaded before" if self.held_by_wllm else ""
        return (f"{gib(self.bytes)} is available on {self.device} ({cap} x utilization {self.utilization:g}, "
                f"{gib(self.used_by_others)} used by other processes{held})")


def gpu_budget(device: torch.device, utilization: float, limit: int | None) -> GpuBudget:
    """What a model about to load may use on `device`: min(total, limit) x utilization, less what other
    processes hold and what this process has allocated already (the models served before it)."""
    free, total = torch.cuda.mem_get_info(device)
    budget = budget_from(total, free + torch.cuda.memory_reserved(device), utilization, limit, str(device))
    held = torch.cuda.memory_allocated(device)
    if not held:
        return budget
    return dataclasses.replace(budget, bytes=budget.bytes - held, held_by_wllm=held)


def budget_from(total: int, free: int, utilization: float, limit: int | None, device: str) -> GpuBudget:
    """GpuBudget from a device's total and free bytes (free counts this process's own cached memory)."""
    used_by_others = max(0, total - free)
    cap = total if limit is None else min(total, limit)
    return GpuBudget(int(cap * utilization) - used_by_others, total, limit, utilization, used_by_others, device)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes a model needs: weights, per-token KV, and the largest step's activations plus graph reserve."""

    name: str
    dtype: torch.dtype
    weights: int
    kv_per_token: int
    activations: int
    block_size: int

    def needed(self, tokens: int) -> int:
        return self.weights + self.activations + self.kv_tokens_bytes(tokens)

    def kv_tokens_bytes(self, tokens: int) -> int:
        blocks = -(-tokens // self.block_size)
        return blocks * self.block_size * self.kv_per_token

    def tokens_that_fit(self, budget: int) -> int:
        """The most KV tokens (whole blocks) that fit beside the weights and activations."""
        room = budget - self.weights - self.activations
        if room <= 0:
            return 0
        return room // (self.block_size * self.kv_per_token) * self.block_size

    def check(self, budget: GpuBudget, max_model_len: int) -> None:
        """Raise InsufficientMemoryError, with the numbers and what would fit, unless one sequence of
        `max_model_len` tokens fits."""
        need = self.needed(max_model_len)
        if need <= budget.bytes:
            return
        kv = gib(self.kv_tokens_bytes(max_model_len))
        what = (f"{self.name} in {str(self.dtype).removeprefix('torch.')} needs {gib(self.weights)} of weights + "
                f"~{gib(self.activations)} for activations and CUDA graphs + {kv} of KV cache for one "
                f"{max_model_len}-token sequence = {gib(need)}; {budget.describe()}.")
        fits = self.tokens_that_fit(budget.bytes)
        if fits >= min(max_model_len, 256):
            hint = f" At --max-model-len {round_context(fits)} it fits."
        else:
            hint = (" It does not fit even with a short context: use a smaller or quantized model, or raise "
                    "--gpu-memory-limit / --gpu-memory-utilization.")
        raise InsufficientMemoryError(what + hint)


def round_context(tokens: int) -> int:
    """A friendlier context length: a multiple of 256 when there is room for one."""
    return tokens // 256 * 256 if tokens >= 256 else tokens


def plan_for(model: torch.nn.Module, config: Any, dtype: torch.dtype, *, name: str, block_size: int,
             max_num_batched_tokens: int, max_num_seqs: int, graphs: bool) -> MemoryPlan:
    """The plan of a model built on the meta device (its parameters have shapes and dtypes, no storage)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    rows = max(1, min(max_num_batched_tokens, max_num_seqs))
    act = activation_bytes(config, dtype, max_num_batched_tokens, rows) + (GRAPH_RESERVE if graphs else 0)
    return MemoryPlan(name, dtype, weights, kv_bytes_per_token(config, dtype), act, block_size)


def loader_check(config: Any, device: torch.device) -> Any:
    """The loader's pre-allocation check on CUDA: weights + the largest step + one sequence of max_model_len
    (asked for, else up to 1024 tokens of the model's) must fit what wLLM may use of the card."""
    from wllm.engine.config import default_batched_tokens

    def check(model: torch.nn.Module, model_config: Any, dtype: torch.dtype) -> None:
        sched, cache = config.scheduler, config.cache
        dev = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        tokens = sched.max_num_batched_tokens or default_batched_tokens("cuda", sms)
        plan = plan_for(model, model_config, dtype, name="the model", block_size=cache.block_size,
                        max_num_batched_tokens=tokens, max_num_seqs=sched.max_num_seqs,
                        graphs=not config.enforce_eager)
        if sched.max_model_len is not None:
            length = sched.max_model_len
        else:
            length = min(model_config.max_position_embeddings, 1024)
        if cache.num_gpu_blocks is not None:
            length = max(length, cache.num_gpu_blocks * cache.block_size)
        plan.check(gpu_budget(dev, cache.gpu_memory_utilization, cache.gpu_memory_limit), length)

    return check
