"""The device worker: the model's device, its paged KV cache and CPU swap pool, and the step runner.

The worker sizes the KV cache (on CUDA from free memory after a profiling forward pass of the largest
step, `gpu_memory_utilization`), allocates it and the pinned CPU pool that preempted sequences swap to
(see paged_attention.py for the layout), performs a step's block copies and swaps, and picks the step
runner once: `CudaStepRunner` (cuda_runner.py: kernel attention, GPU sampling, staged inputs, CUDA
graphs) on CUDA with the kernel library and a head size, block size and dtype the kernels serve, else
`TorchStepRunner` (torch_runner.py). Both consume a `StepPlan` and know nothing of the scheduler.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from wllm import kernels
from wllm.engine.config import CacheConfig, GiB
from wllm.engine.cuda_attention import cuda_attention_unsupported
from wllm.engine.cuda_runner import CudaStepRunner
from wllm.engine.memory_plan import InsufficientMemoryError, budget_from, gib, round_context
from wllm.engine.paged_attention import allocate_kv_cache, copy_blocks, kv_cache_bytes_per_block, swap_blocks
from wllm.engine.step_plan import RowResult, StepPlan
from wllm.engine.torch_runner import TorchStepRunner
from wllm.model.layers.linear_method import select_kernels

logger = logging.getLogger(__name__)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The activation dtype of a model: that of its first floating-point parameter or buffer."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def model_device(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


class Worker:
    """Holds the model, its paged KV cache and the swap pool; runs steps through its step runner."""

    def __init__(self, model: nn.Module, cache_config: CacheConfig, max_num_batched_tokens: int,
                 dtype: torch.dtype | None = None, *, max_num_seqs: int = 256, max_model_len: int | None = None,
                 enforce_eager: bool = False, require_max_model_len: bool = False) -> None:
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "num_hidden_layers"):
            raise TypeError(f"{type(model).__name__} has no `config` with the layer shapes the KV cache needs")
        self.model = model
        self.device = model_device(model)
        if self.device.type == "cuda":
            # The loader chose each layer's kernels; a model built or moved another way gets them here.
            select_kernels(model)
        self.dtype = dtype or model_dtype(model)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.block_size = cache_config.block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or getattr(config, "max_position_embeddings", None) or 2048
        # Pooling models run the PyTorch path on every device: the kernel runner plans causal attention and
        # sampling only.
        self.use_cuda_kernels = getattr(model, "pooling", None) is None and self._cuda_kernels_usable()
        self.block_bytes = kv_cache_bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads,
                                                    self.head_dim, self.dtype)
        self.num_gpu_blocks = cache_config.num_gpu_blocks or self._blocks_from_memory(
            cache_config, max_num_batched_tokens)
        if require_max_model_len:
            self._check_max_model_len(cache_config)
        if cache_config.num_cpu_blocks is not None:
            self.num_cpu_blocks = cache_config.num_cpu_blocks
        else:
            self.num_cpu_blocks = int(cache_config.swap_space * GiB) // self.block_bytes
        self.kv_cache = allocate_kv_cache(self.num_layers, self.num_gpu_blocks, self.block_size,
                                          self.num_kv_heads, self.head_dim, self.dtype, self.device)
        pin = self.device.type == "cuda"
        self.cpu_cache = allocate_kv_cache(self.num_layers, self.num_cpu_blocks, self.block_size,
                                           self.num_kv_heads, self.head_dim, self.dtype, "cpu", pin_memory=pin)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB) on %s, %d CPU swap blocks; step budget %d tokens",
                    self.num_gpu_blocks, self.block_size, self.num_gpu_blocks * self.block_bytes / 2**20,
                    self.device, self.num_cpu_blocks, max_num_batched_tokens)
        self.runner: TorchStepRunner | CudaStepRunner
        if self.use_cuda_kernels:
            self.runner = CudaStepRunner(model, self.kv_cache, max_num_batched_tokens=max_num_batched_tokens,
                                         max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                         enforce_eager=enforce_eager)
        else:
            self.runner = TorchStepRunner(model, self.kv_cache)

    def _check_max_model_len(self, cache_config: CacheConfig) -> None:
        """An asked-for max_model_len the cache cannot hold is an error (a default one is capped later)."""
        capacity = self.num_gpu_blocks * self.block_size
        if capacity >= self.max_model_len:
            return
        need = -(-self.max_model_len // self.block_size)
        where = ("kv_cache_memory" if self.device.type != "cuda"
                 else "gpu_memory_utilization / gpu_memory_limit" if cache_config.num_gpu_blocks is None
                 else "num_gpu_blocks")
        fit = round_context(capacity)
        raise InsufficientMemoryError(
            f"max_model_len {self.max_model_len} needs {need} KV-cache blocks of {self.block_size} tokens "
            f"({gib(need * self.block_bytes)}), but {self.num_gpu_blocks} fit on {self.device} "
            f"({gib(self.num_gpu_blocks * self.block_bytes)}, from {where}); at max_model_len {fit} it fits"
        )

    def _cuda_kernels_usable(self) -> bool:
        """CUDA kernels serve this model when the library runs on the device and supports its shapes."""
        if self.device.type != "cuda" or not hasattr(self.model, "compute_logits"):
            return False
        if not kernels.available(self.device.index or 0):
            logger.warning("the CUDA kernel library is not usable on %s; running the slower PyTorch path",
                           self.device)
            return False
        why = cuda_attention_unsupported(self.head_dim, self.block_size, self.dtype)
        if why is not None:
            logger.warning("CUDA attention kernels do not support %s; running the PyTorch attention path", why)
            return False
        return True

    def _blocks_from_memory(self, cache_config: CacheConfig, max_num_batched_tokens: int) -> int:
        if self.device.type != "cuda":
            blocks = cache_config.kv_cache_memory // self.block_bytes
        else:
            blocks = self._profile_cuda(cache_config, max_num_batched_tokens)
        if blocks < 1:
            raise RuntimeError(
                f"no room for the KV cache: one block of {self.block_size} tokens needs "
                f"{self.block_bytes} bytes; raise kv_cache_memory / gpu_memory_utilization or set num_gpu_blocks"
            )
        return int(blocks)

    @torch.inference_mode()
    def _profile_cuda(self, cache_config: CacheConfig, num_tokens: int) -> int:
        """Run the largest step once with a scratch cache, then size the KV cache from what is left."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        bs = self.block_size
        scratch_blocks = -(-num_tokens // bs)
        scratch = allocate_kv_cache(self.num_layers, scratch_blocks, bs, self.num_kv_heads, self.head_dim,
                                    self.dtype, self.device)
        # Sampling rows of a step: up to one per running sequence.
        num_rows = max(1, min(num_tokens, self.max_num_seqs))
        runner_class = CudaStepRunner if self.use_cuda_kernels else TorchStepRunner
        runner_class.profile_forward(self.model, scratch, num_tokens, num_rows, self.max_model_len)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch.numel() * scratch.element_size()
        del scratch
        torch.cuda.empty_cache()
        free_now, total = torch.cuda.mem_get_info(self.device)
        budget = budget_from(total, free_now + torch.cuda.memory_reserved(self.device),
                             cache_config.gpu_memory_utilization, cache_config.gpu_memory_limit, str(self.device))
        # The step's peak allocation includes the weights: what is left is the cache's.
        return int((budget.bytes - peak) // self.block_bytes)

    @property
    def supports_in_flight(self) -> bool:
        """Whether `launch` returns before the step's tokens are on the host, so that the next step can
        be planned with this one in flight (`StepPlan.in_flight`): the kernel path only."""
        return self.runner.supports_in_flight

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: StepHandle | None = None) -> StepHandle:
        """Start a step (its block copies and swaps first); `collect` returns its results. The kernel path
        only queues device work, so the host can plan and launch the next step meanwhile (`prev`: the step
        in flight whose samples feed this one's rows). The PyTorch path runs the step right here."""
        if self.use_cuda_kernels:
            # One batched, stream-ordered copy per kind; the CPU pool is never read on the host, so the
            # step's later sync is the only one these need.
            for src, dst, pairs in ((self.kv_cache, self.kv_cache, plan.blocks_to_copy),
                                    (self.kv_cache, self.cpu_cache, plan.blocks_to_swap_out),
                                    (self.cpu_cache, self.kv_cache, plan.blocks_to_swap_in)):
                if pairs:
                    kernels.copy_blocks(src, dst, torch.tensor(pairs, dtype=torch.int64), block_dim=2)
        else:
            copy_blocks(self.kv_cache, plan.blocks_to_copy)
            swap_blocks(self.kv_cache, self.cpu_cache, plan.blocks_to_swap_out)
            swap_blocks(self.cpu_cache, self.kv_cache, plan.blocks_to_swap_in)
        if not plan.rows:
            return StepHandle(results={})
        return StepHandle(pending=self.runner.launch(plan, prev.pending if prev is not None else None))

    def collect(self, handle: StepHandle) -> dict[str, RowResult]:
        """Wait for a launched step and return each row's sampled tokens and prompt logprobs."""
        if handle.results is None:
            handle.results = self.runner.collect(handle.pending)
        return handle.results

    def release(self, handle: StepHandle) -> None:
        """Give up a launched step whose results nobody needs: wait only until the host may rewrite the
        buffers it reads (for a step planned with one in flight, until its inputs were uploaded); its device
        work runs on, ahead of anything launched later on the same stream."""
        if handle.results is None:
            self.runner.release(handle.pending)

    def synchronize(self) -> None:
        """Wait for all device work launched so far."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Drop the model, the caches and the step runner (graphs, their pool, staged buffers) once the
        device has finished with them; the worker executes nothing after this."""
        try:
            self.synchronize()
        finally:  # a device error in the wait must not keep the memory
            self.runner = None  # type: ignore[assignment]
            self.kv_cache = self.cpu_cache = torch.empty(0)
            self.model = None


class StepHandle:
    """A launched step: the runner's handle, or the results of a step without rows."""

    __slots__ = ("pending", "results")

    def __init__(self, pending: object = None, results: dict[str, RowResult] | None = None) -> None:
        self.pending = pending
        self.results = results
