"""Request state inside the engine.

A user request (`RequestGroup`) asks for `n` sequences. The scheduler only sees `Sequence`s:
the first one is queued at once; the other `n - 1` are forked from it when its prompt is done,
sharing the prompt's KV blocks.

Token ids and the cyclic garbage collector: a full (generation-2) collection walks every item of every
live list, however small the ints in it, and the token-id lists of an offline batch (256 requests x 640
tokens) are most of what it walks. So the engine keeps each token once: the prompt as one tuple per
request (the collector untracks a tuple of ints the first time it sees it, and never walks it again),
shared by its sequences, and each sequence's generated ids in one list. A sequence's whole token
sequence (prompt + outputs) is never stored; `Sequence.token_ids` and `Sequence.block_token_ids` read
the slices that scheduling and prefix-cache hashing need from the two parts.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from wllm.outputs import RequestMetrics, StepLogprobs
from wllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from wllm.engine.beam_search import BeamSearch
    from wllm.engine.block_pool import KVBlock
    from wllm.engine.sampler import SamplingRow
    from wllm.engine.stop_checker import TextState
    from wllm.pooling_params import PoolingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`; the caller should retry later (HTTP 503/429)."""


class Sequence:
    """One generated sequence: its tokens, KV blocks and sampling state."""

    def __init__(self, group: RequestGroup, index: int, output_token_ids: list[int] | None = None) -> None:
        self.group = group
        self.index = index
        self.seq_id = group.request_id if index == 0 else f"{group.request_id}#{index}"
        self.prompt_token_ids: tuple[int, ...] = group.prompt_token_ids  # the group's: one per request
        self.num_prompt_tokens = len(self.prompt_token_ids)  # an attribute: read several times per step
        self.output_token_ids: list[int] = list(output_token_ids or [])
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit length at first scheduling; -1 = not yet
        self.blocks: list[KVBlock] = []
        self._ids_of: list[KVBlock] | None = None  # the `blocks` list _block_ids mirrors
        self._block_ids: list[int] = []
        self.num_registered_blocks = 0  # leading full blocks already offered to the prefix cache
        self.block_hashes: list[bytes] = []
        self.swapped_cpu_blocks: list[int] = []
        self.logprobs: list[StepLogprobs] | None = [] if group.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text_state: TextState | None = None  # set by the engine's output processor
        # The scheduler's SamplingRow of this sequence: every field is fixed for its lifetime (the
        # output list is this sequence's own, growing list), so one object serves every step.
        self.sampling_row: SamplingRow | None = None
        # The sequence's own grammar state (an llguidance.LLMatcher) under a grammar; forks get a copy.
        self.matcher: Any = None

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def priority(self) -> int:
        return self.group.priority

    @property
    def arrival_time(self) -> float:
        return self.group.arrival_time

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> Seq[int]:
        """The ids at positions [start, end) of prompt + outputs (a step's input chunk), in a new object:
        a list slice of the outputs, or a tuple where it covers prompt tokens (sliced from the prompt
        tuple without a list in between; the collector untracks it on its first pass)."""
        p = self.num_prompt_tokens
        if start >= p:  # a decode token or a chunk of outputs (recompute after preemption)
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + tuple(self.output_token_ids[:end - p])

    def block_token_ids(self, index: int, block_size: int) -> tuple[int, ...]:
        """The ids of full block `index` (positions index * block_size onward), as the prefix cache keys
        and stores them. The caller makes sure the block is full."""
        ids = self.token_ids(index * block_size, (index + 1) * block_size)
        return ids if isinstance(ids, tuple) else tuple(ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def block_ids(self) -> list[int]:
        """The ids of `blocks`, kept in step with it without a rebuild every step: `blocks` only
        ever grows in place or is replaced by another list. The list is shared: read it, copy it
        to keep it (a step's inputs are staged from it right away)."""
        blocks, ids = self.blocks, self._block_ids
        if self._ids_of is not blocks:
            self._ids_of = blocks
            ids = self._block_ids = [b.block_id for b in blocks]
        elif len(ids) != len(blocks):
            ids.extend(b.block_id for b in blocks[len(ids):])
        return ids

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, blocks={[b.block_id for b in self.blocks]})")


class RequestGroup:
    """A user request: one prompt, `params.n` sequences, and its bookkeeping."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_id: int = 0,
        arrival_time: float | None = None,
        seed: int = 0,
        final_only: bool = False,
        pooling: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        # A tuple, not a list: see the module docstring. Outputs get a list (`prompt_list`).
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self._prompt_list: list[int] | None = None
        self.params = params
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_id = lora_id
        # The request's random stream; the engine draws one when params.seed is None.
        self.seed = params.seed if params.seed is not None else seed
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.seqs: list[Sequence] = [Sequence(self, 0)]
        # Beam search keeps `beam_width` beams through `beam` (set by the scheduler), not n - 1 forks of the prompt.
        self.num_pending_forks = 0 if params.beam_width else params.n - 1
        self.beam: BeamSearch | None = None
        self.final_only = final_only  # outputs only when finished (LLMEngine.add_request)
        self.prompt_logprobs: list[StepLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.error: str | None = None
        # A pooling request: its whole prompt runs in one step, nothing is sampled, `pooled` is the output.
        self.pooling = pooling
        self.pooled: list[float] | None = None

    def prompt_list(self) -> list[int]:
        """The prompt ids as the list `RequestOutput.prompt_token_ids` carries. Made on the first call and
        shared by every later output of the request, so a streaming request pays for one copy, and a
        final-only one (offline batches) holds no prompt list until it finishes."""
        if self._prompt_list is None:
            self._prompt_list = list(self.prompt_token_ids)
        return self._prompt_list

    @property
    def is_finished(self) -> bool:
        if self.num_pending_forks:
            return False
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, without a generator per call (hot in the step loop)
            return seqs[0].status is SequenceStatus.FINISHED
        return all(s.status is SequenceStatus.FINISHED for s in seqs)

    def release(self) -> None:
        """Cut the group <-> sequence reference cycle once the request is done with (finished and its
        final output made), so that reference counting frees the request and its token ids at once.
        Left as a cycle, a finished request lives on until a full (generation-2) collection, which then
        walks it: an offline batch's first full collection walked the whole previous batch."""
        self.seqs = []

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def extra_hash_key(self) -> bytes:
        """What besides token ids distinguishes this request's KV content in the prefix cache."""
        salt = self.cache_salt.encode() if self.cache_salt else b""
        return self.lora_id.to_bytes(8, "little", signed=True) + len(salt).to_bytes(4, "little") + salt
