"""Settings of the engine core: KV cache and scheduler.

Plain msgspec Structs so they can cross a process boundary and be filled from CLI flags.
"""

from __future__ import annotations

from typing import Literal

import msgspec

GiB = 1 << 30


class CacheConfig(msgspec.Struct, kw_only=True):
    """How the paged KV cache is sized.

    On CUDA the number of blocks comes from `gpu_memory_utilization` of the card after a profiling
    forward pass, unless `num_gpu_blocks` is given. On the CPU it comes from `kv_cache_memory`
    (bytes) unless `num_gpu_blocks` is given. `swap_space` is the size in GiB of the CPU pool that
    preempted requests are swapped to; 0 disables swapping (preemption then always recomputes).
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int = 1 * GiB
    gpu_memory_utilization: float = 0.9
    # Bytes of the GPU wLLM may use at most (None: the whole card); utilization applies to this cap, so a
    # 12 GB card can be emulated on a bigger one.
    gpu_memory_limit: int | None = None
    swap_space: float = 1.0
    num_cpu_blocks: int | None = None  # overrides swap_space when set (tests)
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be positive, got {self.num_gpu_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.gpu_memory_limit is not None and self.gpu_memory_limit <= 0:
            raise ValueError(f"gpu_memory_limit must be positive, got {self.gpu_memory_limit}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")


class SchedulerConfig(msgspec.Struct, kw_only=True):
    """One token budget per step, shared by prefill chunks and decode tokens.

    `max_waiting` bounds the waiting queue (0 = unbounded); a request beyond it is rejected with
    `QueueFullError`. `policy` "fcfs" serves by arrival, "priority" by (priority, arrival) where a
    lower priority value is served first.
    """

    # None: ~8192 when the model is on CUDA (bigger prefill chunks keep the GPU's matmul units
    # busy), rounded to whole GEMM waves of the card (8448 on a 132-SM H100/H200), 2048 elsewhere;
    # the engine resolves it at construction (see `default_batched_tokens`).
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    max_waiting: int = 0
    policy: Literal["fcfs", "priority"] = "fcfs"
    max_model_len: int | None = None

    def validate(self) -> None:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be non-negative, got {self.max_waiting}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


CUDA_BATCHED_TOKENS = 8192
WAVE_ROWS_PER_SM = 64


def default_batched_tokens(device_type: str, sm_count: int | None = None) -> int:
    """The step token budget used when `max_num_batched_tokens` is not set: 2048 off CUDA; on
    CUDA the multiple of 64 x `sm_count` nearest to 8192 (8192 itself when the SM count is unknown).

    Why whole multiples of 64 rows per SM: a full prefill step's GEMMs have M = the budget, and
    cuBLAS cuts M into 128- or 256-row tiles; with M = 64 x SMs that is SMs / 2 (or SMs / 4) row
    tiles, so every projection with an even (or multiple-of-4) count of column tiles fills whole
    waves of the SMs instead of leaving a part-empty last wave (benchmarks/RESULTS.md has the budget
    sweep on the H200).
    """
    if device_type != "cuda":
        return 2048
    if not sm_count or sm_count < 1:
        return CUDA_BATCHED_TOKENS
    unit = WAVE_ROWS_PER_SM * sm_count
    return unit * max(1, int(CUDA_BATCHED_TOKENS / unit + 0.5))


class EngineConfig(msgspec.Struct, kw_only=True):
    """Everything the engine needs besides the model and tokenizer objects."""

    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    device: str = "auto"  # "auto" -> cuda when available, else cpu
    dtype: str = "auto"  # "auto" -> the model's dtype
    seed: int = 0  # seeds the random stream of requests that give no seed
    enforce_eager: bool = False  # CUDA: run every step eagerly (no CUDA graphs)
    # Kernel (CUDA) path: while a pure decode step runs on the device, launch the next one before
    # processing the first one's tokens, so the GPU does not wait for the host (see llm_engine.py).
    # Outputs are identical with it on or off; the PyTorch path (CPU engines) always runs in step.
    async_scheduling: bool = True

    def validate(self) -> None:
        self.cache.validate()
        self.scheduler.validate()


def engine_config_from_kwargs(**kwargs: object) -> EngineConfig:
    """Build an EngineConfig from flat keyword arguments (`block_size=16, max_num_seqs=8, ...`),
    each routed to the Struct that has that field. Unknown names raise a TypeError listing the
    supported ones."""
    sections: dict[str, dict[str, object]] = {"cache": {}, "scheduler": {}, "engine": {}}
    fields = {
        "cache": set(CacheConfig.__struct_fields__),
        "scheduler": set(SchedulerConfig.__struct_fields__),
        "engine": set(EngineConfig.__struct_fields__) - {"cache", "scheduler"},
    }
    for key, value in kwargs.items():
        for section, names in fields.items():
            if key in names:
                sections[section][key] = value
                break
        else:
            supported = sorted(set().union(*fields.values()))
            raise TypeError(f"unknown engine argument {key!r}; supported: {', '.join(supported)}")
    try:
        config = EngineConfig(cache=CacheConfig(**sections["cache"]),
                              scheduler=SchedulerConfig(**sections["scheduler"]), **sections["engine"])
    except TypeError as e:
        raise TypeError(f"bad engine argument: {e}") from None
    config.validate()
    return config
