"""Runs one scheduled step: block copies and swaps, the forward pass, logits and sampling.

The runner owns the device KV cache and the CPU swap pool (see paged_attention.py for the
layout) and turns a `SchedulerOutput` into flattened `input_ids[T]`, `positions[T]` and a
`PagedAttentionContext`. Logits are computed only for rows that are sampled (the last token of
a sequence whose chunk reaches its end) and for prompt positions whose logprobs were asked for.

On CUDA with the kernel library (and a head size, block size and dtype the kernels support) steps
go through `CudaStepRunner` instead: kernel attention, GPU sampling, persistent staged inputs and
CUDA graphs for decode steps (see cuda_runner.py). Elsewhere the PyTorch path below runs them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from wllm import kernels
from wllm.engine.config import CacheConfig, GiB
from wllm.engine.cuda_attention import CudaAttentionContext, cuda_attention_unsupported, layer_caches
from wllm.engine.paged_attention import (
    PagedAttentionContext,
    allocate_kv_cache,
    copy_blocks,
    kv_cache_bytes_per_block,
    swap_blocks,
)
from wllm.engine.sampler import Sampler, SamplingRow, prompt_logprobs
from wllm.engine.scheduler import SchedulerOutput, SeqResult

if TYPE_CHECKING:
    from wllm.engine.cuda_runner import PendingStep

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


class StepHandle:
    """A launched step: the kernel path's pending device work, or results already computed."""

    __slots__ = ("pending", "results")

    def __init__(self, pending: PendingStep | None = None, results: dict[str, SeqResult] | None = None) -> None:
        self.pending = pending
        self.results = results


class ModelRunner:
    """Holds the model, its paged KV cache and the swap pool; executes steps."""

    def __init__(self, model: nn.Module, cache_config: CacheConfig, max_num_batched_tokens: int,
                 dtype: torch.dtype | None = None, *, max_num_seqs: int = 256, max_model_len: int | None = None,
                 enforce_eager: bool = False) -> None:
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "num_hidden_layers"):
            raise TypeError(f"{type(model).__name__} has no `config` with the layer shapes the KV cache needs")
        self.model = model
        self.device = model_device(model)
        self.dtype = dtype or model_dtype(model)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.block_size = cache_config.block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or getattr(config, "max_position_embeddings", None) or 2048
        self.use_cuda_kernels = self._cuda_kernels_usable()
        self.block_bytes = kv_cache_bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads,
                                                    self.head_dim, self.dtype)
        self.num_gpu_blocks = cache_config.num_gpu_blocks or self._blocks_from_memory(
            cache_config, max_num_batched_tokens)
        if cache_config.num_cpu_blocks is not None:
            self.num_cpu_blocks = cache_config.num_cpu_blocks
        else:
            self.num_cpu_blocks = int(cache_config.swap_space * GiB) // self.block_bytes
        self.kv_cache = allocate_kv_cache(self.num_layers, self.num_gpu_blocks, self.block_size,
                                          self.num_kv_heads, self.head_dim, self.dtype, self.device)
        pin = self.device.type == "cuda"
        self.cpu_cache = allocate_kv_cache(self.num_layers, self.num_cpu_blocks, self.block_size,
                                           self.num_kv_heads, self.head_dim, self.dtype, "cpu", pin_memory=pin)
        self.sampler = Sampler()
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB) on %s, %d CPU swap blocks; step budget %d tokens",
                    self.num_gpu_blocks, self.block_size, self.num_gpu_blocks * self.block_bytes / 2**20,
                    self.device, self.num_cpu_blocks, max_num_batched_tokens)
        self.cuda_runner = None
        if self.use_cuda_kernels:
            from wllm.engine.cuda_runner import CudaStepRunner

            self.cuda_runner = CudaStepRunner(model, self.kv_cache, max_num_batched_tokens=max_num_batched_tokens,
                                              max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                              enforce_eager=enforce_eager)

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
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        # Positions wrap at max_model_len: the rotary table has no rows past it; memory is the same.
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        # Sampling rows of a step: up to one per running sequence.
        num_rows = max(1, min(num_tokens, self.max_num_seqs))
        if self.use_cuda_kernels:
            i32 = {"dtype": torch.int32, "device": self.device}
            slots = torch.arange(num_tokens, device=self.device)
            ctx = CudaAttentionContext(layer_caches(scratch), slots, torch.arange(scratch_blocks, **i32)[None],
                                       torch.tensor([num_tokens], **i32), torch.tensor([0, num_tokens], **i32),
                                       decode=False, max_seq_len=num_tokens)
            hidden = self.model(ids, positions, ctx)
            logits = self.model.compute_logits(hidden[-num_rows:])
            kernels.sample(logits, torch.zeros(num_rows, 6, device=self.device),
                           torch.zeros(num_rows, 3, dtype=torch.int64, device=self.device))
        else:
            ctx = PagedAttentionContext(scratch, [list(range(scratch_blocks))], [0], [num_tokens])
            hidden = self.model(ids, positions, ctx)
            logits = self.model.compute_logits(hidden[-num_rows:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch.numel() * scratch.element_size()
        del scratch, ctx, hidden, logits
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        free_now, _ = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free_now - torch.cuda.memory_reserved(self.device)
        budget = total * cache_config.gpu_memory_utilization - peak - max(used_by_others, 0)
        return int(budget // self.block_bytes)

    @property
    def supports_lookahead(self) -> bool:
        """Whether `launch` accepts a lookahead step (`SchedulerOutput.prev_rows`): the kernel path only."""
        return self.cuda_runner is not None

    def execute(self, out: SchedulerOutput) -> dict[str, SeqResult]:
        """Run one step and return each scheduled sequence's sampled tokens and prompt logprobs."""
        return self.collect(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: StepHandle | None = None) -> StepHandle:
        """Start a step; `collect` returns its results. On the kernel path this only queues device
        work, so the host can prepare and launch the next step meanwhile (`prev`: the step a
        lookahead step takes its input tokens from). The PyTorch path runs the step right here."""
        if self.cuda_runner is None:
            if out.prev_rows is not None:
                raise ValueError("lookahead steps need the CUDA kernel path")
            return StepHandle(results=self._execute_torch(out))
        # One batched, stream-ordered copy per kind; the CPU pool is never read on the host, so
        # the step's later sync is the only one these need.
        for src, dst, pairs in ((self.kv_cache, self.kv_cache, out.blocks_to_copy),
                                (self.kv_cache, self.cpu_cache, out.blocks_to_swap_out),
                                (self.cpu_cache, self.kv_cache, out.blocks_to_swap_in)):
            if pairs:
                kernels.copy_blocks(src, dst, torch.tensor(pairs, dtype=torch.int64), block_dim=2)
        if not out.seqs:
            return StepHandle(results={})
        return StepHandle(pending=self.cuda_runner.launch(out, prev.pending if prev is not None else None))

    def collect(self, handle: StepHandle) -> dict[str, SeqResult]:
        """Wait for a launched step and return each scheduled sequence's sampled tokens and prompt logprobs."""
        if handle.results is None:
            assert self.cuda_runner is not None and handle.pending is not None
            handle.results = self.cuda_runner.collect(handle.pending)
        return handle.results

    def release(self, handle: StepHandle) -> None:
        """Give up a launched step whose results nobody needs: wait only until the host may rewrite
        the buffers it reads (for a lookahead step, until its inputs were uploaded); its device work
        runs on, ahead of anything launched later on the same stream."""
        if handle.pending is not None and self.cuda_runner is not None:
            self.cuda_runner.release(handle.pending)

    def synchronize(self) -> None:
        """Wait for all device work launched so far."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Drop the model, the caches and the CUDA runner (graphs, their pool, staged buffers) once the
        device has finished with them; the runner executes nothing after this."""
        try:
            self.synchronize()
        finally:  # a device error in the wait must not keep the memory
            self.cuda_runner = None
            self.kv_cache = self.cpu_cache = torch.empty(0)
            self.model = None

    def _execute_torch(self, out: SchedulerOutput) -> dict[str, SeqResult]:
        """The PyTorch path: block copies, forward pass and sampling, all before it returns."""
        copy_blocks(self.kv_cache, out.blocks_to_copy)
        swap_blocks(self.kv_cache, self.cpu_cache, out.blocks_to_swap_out)
        swap_blocks(self.cpu_cache, self.kv_cache, out.blocks_to_swap_in)
        if not out.seqs:
            return {}
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        for s in out.seqs:
            base = len(ids)
            ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
            if s.prompt_logprob_targets:
                first = base + s.prompt_logprob_start - s.start_pos
                logit_rows.extend(range(first, first + len(s.prompt_logprob_targets)))
            if s.num_samples:
                logit_rows.append(base + len(s.token_ids) - 1)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        ctx = PagedAttentionContext(self.kv_cache, [s.block_ids for s in out.seqs],
                                    [s.start_pos for s in out.seqs], [len(s.token_ids) for s in out.seqs])
        hidden = self.model(input_ids, pos, ctx)
        logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, dtype=torch.long, device=self.device)])

        results: dict[str, SeqResult] = {}
        sample_logits: list[int] = []
        rows = []
        owners: list[str] = []
        r = 0
        for s in out.seqs:
            result = SeqResult([])
            if s.prompt_logprob_targets:
                n = len(s.prompt_logprob_targets)
                result.prompt_logprobs = prompt_logprobs(logits[r:r + n], s.prompt_logprob_targets,
                                                         s.prompt_logprobs or 0)
                r += n
            if s.num_samples:
                assert s.sampling is not None
                for k in range(s.num_samples):
                    row = s.sampling if k == 0 else _fork_row(s.sampling, k)
                    rows.append(row)
                    sample_logits.append(r)
                    owners.append(s.seq_id)
                r += 1
            results[s.seq_id] = result
        if rows:
            sampled = self.sampler(logits[torch.tensor(sample_logits, dtype=torch.long, device=logits.device)], rows)
            for owner, tok in zip(owners, sampled):
                results[owner].sampled.append(tok)
        return results


def _fork_row(row: SamplingRow, index: int) -> SamplingRow:
    """The sampling row of the `index`-th sequence forked from a prompt (no outputs yet)."""
    return SamplingRow(row.params, row.seed, index, row.prompt_token_ids, [], row.eos_token_ids)
