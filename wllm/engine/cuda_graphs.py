"""CUDA graphs of whole steps: the forward pass and sampling, replayed per step.

A decode step of S sequences is padded to the next captured batch size (1, 2, 4, 8, then
multiples of 8 up to max_num_seqs); padding rows write their K/V to slot -1 (skipped) and have a
context length of 0 (zero attention output), and are greedy, so they cost a little compute and
nothing else. Short prefill and mixed steps (up to PREFILL_GRAPH_MAX_TOKENS tokens) are padded the
same way to a captured (tokens, sequences) shape: eagerly, such a step costs the host more time than
the GPU (Python and a launch per kernel for every layer), so a slow or busy host CPU would set its speed. In
them the single-token rows (a mixed step's decode rows, laid out first) take the decode kernel, with
its split-KV for long contexts, and the prompt chunks the prefill kernel; which rows are which is
worked out on the device from the staged query offsets, so one graph serves any mix. Steps without decode
rows of up to PREFILL_ONLY_GRAPH_MAX_SEQS sequences (a prompt reaching an idle server) have graphs of
their own without the decode kernel's launch.
Graphs are captured at start-up, largest first, into one shared memory pool: a capture frees its
intermediates back to the pool, so each smaller graph reuses them and the pool is about the size
of the largest step's activations. Replay reads its inputs from the runner's persistent device
buffers, which the runner fills before each replay.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

# Prefill/mixed steps captured: token counts 16, 32, ..., PREFILL_GRAPH_MAX_TOKENS by sequence counts 1,
# 2, 4, ... (powers of two, at most the token count). Larger steps keep the GPU busy longer than the host
# needs to launch them. --enforce-eager turns every graph off.
PREFILL_GRAPH_MAX_TOKENS = 512
# Steps of prompt chunks only also have graphs without the decode kernel for up to this many sequences: in
# a mixed graph its launch over no decode rows is a measurable part of a short prefill (RESULTS.md).
PREFILL_ONLY_GRAPH_MAX_SEQS = 8

# fp64 [2, B]: row 0 the sampled token ids (exact in fp64), row 1 their logprobs. One tensor, so a
# replayed step comes back to the host in one copy.
GraphOutputs = torch.Tensor


_WARMUP_STREAMS: dict[int, torch.cuda.Stream] = {}


def _warmup_stream(device: torch.device | None) -> torch.cuda.Stream:
    """The one side stream of `device` that every capture's warm-up run uses. cuBLAS keeps a workspace
    (32 MiB on Hopper) for each stream it has run on, for the life of the process, and new streams cycle
    through torch's pool of 32: a stream per graph left about a GiB allocated, outside the memory the
    KV cache was sized against and still held after the engine was dropped."""
    with torch.cuda.device(device):
        index = torch.cuda.current_device()
    stream = _WARMUP_STREAMS.get(index)
    if stream is None:
        stream = _WARMUP_STREAMS[index] = torch.cuda.Stream(index)
    return stream


def capture_graph(fn: Callable[[], T], pool: Any = None,
                  device: torch.device | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture fn() in a CUDA graph; returns the graph and fn's static outputs (rewritten by each
    replay). fn runs once first on a side stream: lazy initialisation (cuBLAS handles, workspaces)
    must not happen inside a capture."""
    current = torch.cuda.current_stream(device)
    side = _warmup_stream(device)
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


def prefill_graph_shapes(max_num_batched_tokens: int, max_num_seqs: int) -> list[tuple[int, int, bool]]:
    """Captured (tokens, sequences, mixed) shapes of prefill/mixed steps: token counts from 16 and sequence
    counts from 1 in powers of two up to PREFILL_GRAPH_MAX_TOKENS, each list cut after its first entry that
    holds the step budget (resp. max_num_seqs), as no step can be larger; a shape has no more sequences
    than tokens. Every shape is captured mixed (decode rows allowed); those of up to
    PREFILL_ONLY_GRAPH_MAX_SEQS sequences also without decode rows (mixed False)."""
    tokens = [t for t in (16 << i for i in range(32)) if t <= PREFILL_GRAPH_MAX_TOKENS]
    seqs = [s for s in (1 << i for i in range(32)) if s <= PREFILL_GRAPH_MAX_TOKENS]

    def cut(sizes: list[int], limit: int) -> list[int]:
        return [x for i, x in enumerate(sizes) if i == 0 or sizes[i - 1] < limit]

    shapes = [(t, s) for t in cut(tokens, max_num_batched_tokens) for s in cut(seqs, max_num_seqs) if s <= t]
    return [(t, s, mixed) for t, s in shapes for mixed in (False, True)
            if mixed or s <= PREFILL_ONLY_GRAPH_MAX_SEQS]


class StepGraphs(Generic[K]):
    """One CUDA graph per padded step shape (key), captured into a memory pool."""

    what = "steps"

    def __init__(self, keys: list[K], device: torch.device) -> None:
        self.keys = sorted(keys)
        self.device = device
        self._graphs: dict[K, tuple[torch.cuda.CUDAGraph, GraphOutputs]] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def capture(self, prepare: Callable[[K], None], forward: Callable[[K], GraphOutputs],
                pool: Any = None) -> None:
        """Capture `forward(key)` for every key, largest first, into `pool` (a new one when None).
        `prepare(key)` fills the input buffers with padding rows (launched on the current stream)
        before the warm-up run and capture."""
        if not self.keys:
            return
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        for key in reversed(self.keys):
            prepare(key)
            self._graphs[key] = capture_graph(lambda key=key: forward(key), pool=pool, device=self.device)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = max(free_before - torch.cuda.mem_get_info(self.device)[0], 0)
        logger.info("captured %d CUDA graphs for %s in %.2f s, using %.1f MiB", len(self._graphs), self.what,
                    self.capture_seconds, self.capture_bytes / 2**20)

    def replay(self, key: K) -> GraphOutputs:
        """Replay the graph of a captured shape on the current stream; returns its static outputs
        (valid until the next replay of any graph)."""
        graph, outputs = self._graphs[key]
        graph.replay()
        return outputs


class DecodeGraphs(StepGraphs[int]):
    """One CUDA graph per padded decode batch size."""

    def __init__(self, sizes: list[int], device: torch.device) -> None:
        super().__init__(sizes, device)
        self.what = f"decode batches of 1..{self.max_size} sequences"

    @property
    def sizes(self) -> list[int]:
        """The captured batch sizes, ascending."""
        return self.keys

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs rows (None: too many, run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        if i == len(self.sizes) or self.sizes[i] not in self._graphs:
            return None
        return self.sizes[i]


class PrefillGraphs(StepGraphs[tuple[int, int, bool]]):
    """One CUDA graph per padded (tokens, sequences, mixed) shape of short prefill and mixed steps."""

    def __init__(self, shapes: list[tuple[int, int, bool]], device: torch.device) -> None:
        super().__init__(shapes, device)
        self.tokens = sorted({t for t, _, _ in self.keys})
        self.seqs = sorted({s for _, s, _ in self.keys})
        most = (self.tokens[-1], self.seqs[-1]) if self.keys else (0, 0)
        self.what = f"prefill steps of up to {most[0]} tokens and {most[1]} sequences"

    def padded_shape(self, num_tokens: int, num_seqs: int, mixed: bool) -> tuple[int, int, bool] | None:
        """The smallest captured shape holding the step (None: none does, run eagerly); a step without
        decode rows (mixed False) takes a mixed graph where it has no graph of its own."""
        i = bisect.bisect_left(self.tokens, num_tokens)
        j = bisect.bisect_left(self.seqs, num_seqs)
        if i == len(self.tokens) or j == len(self.seqs):
            return None
        for key in ((self.tokens[i], self.seqs[j], mixed), (self.tokens[i], self.seqs[j], True)):
            if key in self._graphs:
                return key
        return None
