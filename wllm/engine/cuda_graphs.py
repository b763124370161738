"""CUDA graphs for pure-decode steps: the whole forward pass and sampling, replayed per step.

A decode step of S sequences is padded to the next captured batch size (1, 2, 4, 8, then
multiples of 8 up to max_num_seqs); padding rows write their K/V to slot -1 (skipped) and have a
context length of 0 (zero attention output), and are greedy, so they cost a little compute and
nothing else. Graphs are captured at start-up, largest first, into one shared memory pool: a
capture frees its intermediates back to the pool, so each smaller graph reuses them and the pool
is about the size of the largest batch's activations. Replay reads its inputs from the runner's
persistent device buffers, which the runner fills before each replay.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")

# fp64 [2, B]: row 0 the sampled token ids (exact in fp64), row 1 their logprobs. One tensor, so a
# replayed step comes back to the host in one copy.
GraphOutputs = torch.Tensor


def capture_graph(fn: Callable[[], T], pool: Any = None,
                  device: torch.device | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture fn() in a CUDA graph; returns the graph and fn's static outputs (rewritten by each
    replay). fn runs once first on a side stream: lazy initialisation (cuBLAS handles, workspaces)
    must not happen inside a capture."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        fn()
    current.wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph, outputs


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured batch sizes, ascending: 1, 2, 4, 8, then multiples of 8, the last covering max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    candidates = [1, 2, 4, 8] + list(range(16, -(-max_num_seqs // 8) * 8 + 1, 8))
    sizes = [b for b in candidates if b < max_num_seqs]
    sizes.append(next(b for b in candidates if b >= max_num_seqs))
    return sizes


class DecodeGraphs:
    """One CUDA graph per padded decode batch size, all in one memory pool."""

    def __init__(self, sizes: list[int], device: torch.device) -> None:
        self.sizes = sorted(sizes)
        self.device = device
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, GraphOutputs]] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs rows (None: too many, run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        if i == len(self.sizes) or self.sizes[i] not in self._graphs:
            return None
        return self.sizes[i]

    def capture(self, prepare: Callable[[int], None], forward: Callable[[int], GraphOutputs]) -> None:
        """Capture `forward(b)` for every size, largest first. `prepare(b)` fills the input buffers
        with b padding rows (launched on the current stream) before the warm-up run and capture."""
        if not self.sizes:
            return
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            prepare(b)
            self._graphs[b] = capture_graph(lambda b=b: forward(b), pool=pool, device=self.device)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = max(free_before - torch.cuda.mem_get_info(self.device)[0], 0)
        logger.info("captured %d CUDA graphs for decode batches of 1..%d sequences in %.2f s, using %.1f MiB",
                    len(self._graphs), self.max_size, self.capture_seconds, self.capture_bytes / 2**20)

    def replay(self, size: int) -> GraphOutputs:
        """Replay the graph of a captured size on the current stream; returns its static outputs
        (valid until the next replay of any graph)."""
        graph, outputs = self._graphs[size]
        graph.replay()
        return outputs
