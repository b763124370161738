"""The step plan: everything one step computes, built once by the scheduler, read by every step runner.

A step is a list of rows, one per scheduled sequence. A row computes any number of tokens at consecutive
positions of its sequence: a prompt chunk, one decode token, or (for speculative decoding) 1 + k draft
tokens to verify. Rows are laid out single-token rows first, so attention can send that group to the
decode kernel; a runner keeps the plan's order, which also numbers the step's sampling rows.

Per row the plan carries what the model and the sampler need, and nothing about the scheduler's state:
- the token ids, their start position and the sequence's block table;
- its sampling rows (one, or n when a prompt forks n sequences) and prompt-logprob targets;
- `feed`: under async scheduling, the sampling row of the step still in flight whose token (on the device,
  not yet on the host) is this row's input; the runner copies it in stream order before the forward;
- `lora`: the LoRA adapter slot the row's tokens use (-1: the base model);
- `grammar`: the slot of the row's token mask for constrained decoding (-1: unconstrained);
- `pool`: the row is a pooling request's whole prompt: the runner pools its hidden states (no sampling), with
  `token_type_start` the first token of a pair's second text (-1: none).

Flat per step (`StepPlan.build` computes them once): the token index each sampling row reads its hidden
state from, the token indices whose logits give prompt logprobs, and the feeds as (source row, token).
Grammar slots are numbered here, in row order, for the rows that sample under a grammar: the engine fills
slot g's mask from the matcher of `grammar_rows[g]` (`masks`, computed while the forward runs) and each
sampling row reads slot `sample_masks[i]` (a fork's n rows share their row's slot).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import msgspec

from wllm.engine.sampler import SampledToken, SamplingRow
from wllm.outputs import StepLogprobs
from wllm.pooling_params import PoolingParams

if TYPE_CHECKING:
    from wllm.structured.masks import StepMasks


class StepRow(msgspec.Struct):
    """One sequence's share of a step."""

    seq_id: str
    token_ids: Seq[int]  # the tokens to compute: a tuple where it holds prompt tokens, else a list
    start_pos: int  # position of token_ids[0] (= tokens already in the KV cache)
    block_ids: list[int]  # the sequence's block table
    num_samples: int  # tokens to sample after this row: 0 (mid-prompt), 1, or n at a fork
    sampling: SamplingRow | None
    prompt_logprobs: int | None = None  # top-N for prompt positions of this chunk
    prompt_logprob_targets: list[int] = msgspec.field(default_factory=list)  # next token per position
    prompt_logprob_start: int = 0  # position whose logits predict prompt_logprob_targets[0]
    feed: int = -1  # sampling row of the step in flight whose token is token_ids[0] (a placeholder here)
    lora: int = -1  # LoRA adapter slot (-1: none)
    grammar: int = -1  # token-mask slot for constrained decoding (-1: none)
    pool: PoolingParams | None = None  # a pooling request's whole prompt: pool it, sample nothing
    token_type_start: int = -1  # first token of a pair's second text (BERT token type 1), -1: none


class RowResult(msgspec.Struct):
    """What a step runner produced for one row."""

    sampled: list[SampledToken]
    prompt_logprobs: list[StepLogprobs] = msgspec.field(default_factory=list)
    pooled: list[float] | None = None  # a pooling row's output


def fork_row(row: SamplingRow, index: int) -> SamplingRow:
    """The sampling row of the `index`-th sequence forked from a prompt (no outputs yet)."""
    return SamplingRow(row.params, row.seed, index, row.prompt_token_ids, [], row.eos_token_ids)


class StepPlan:
    """One step: its rows (single-token rows first), the block copies and swaps done before it, and the
    flat indices both runners read. Built by `StepPlan.build`; read-only afterwards."""

    __slots__ = ("rows", "blocks_to_copy", "blocks_to_swap_out", "blocks_to_swap_in", "num_batched_tokens",
                 "in_flight", "num_tokens", "num_decode", "samples", "sample_owners", "sample_tokens",
                 "sample_ahead", "prompt_tokens", "feed_rows", "feed_tokens", "one_token", "one_sample_each",
                 "pool_spans", "grammar_rows", "sample_masks", "masks")

    rows: list[StepRow]
    blocks_to_copy: list[tuple[int, int]]  # (src, dst) GPU blocks, done first
    blocks_to_swap_out: list[tuple[int, int]]  # (GPU block, CPU block), done second
    blocks_to_swap_in: list[tuple[int, int]]  # (CPU block, GPU block), done third
    num_batched_tokens: int
    in_flight: bool  # planned while the step before it was in flight: rows may be fed from it
    num_tokens: int
    num_decode: int  # leading single-token rows, when there are also longer rows; else 0
    samples: list[SamplingRow]  # the step's sampling rows, in row order (n per forking row)
    sample_owners: list[str]  # the seq_id of each sampling row's row
    sample_tokens: list[int]  # the token index each sampling row samples after
    sample_ahead: list[int] | int  # per sampling row: outputs in flight not in its output list (or all same)
    prompt_tokens: list[int]  # token indices whose logits give prompt logprobs, in row order
    feed_rows: list[int]  # sampling rows of the step in flight ...
    feed_tokens: list[int]  # ... and the token indices of this step they feed
    one_token: bool  # every row has one token (the decode kernel serves the whole step)
    one_sample_each: bool  # every row samples exactly once (sampling row i is row i)
    pool_spans: list[tuple[int, int, int]]  # pooling rows: (row index, first token index, tokens)
    grammar_rows: list[StepRow]  # the rows of grammar slots 0, 1, ... (rows that sample under a grammar)
    sample_masks: list[int] | None  # per sampling row: its grammar slot or -1 (None: no grammar in the step)
    masks: StepMasks | None  # the slots' token masks, set by the engine before launch

    @classmethod
    def build(cls, rows: list[StepRow], blocks_to_copy: list[tuple[int, int]] | None = None,
              blocks_to_swap_out: list[tuple[int, int]] | None = None,
              blocks_to_swap_in: list[tuple[int, int]] | None = None, num_batched_tokens: int | None = None,
              in_flight: bool = False) -> StepPlan:
        """The plan of `rows` (in scheduled order; laid out here single-token rows first)."""
        single = [r for r in rows if len(r.token_ids) == 1]
        num_decode = 0
        if single and len(single) != len(rows):
            num_decode = len(single)
            rows = single + [r for r in rows if len(r.token_ids) != 1]
        plan = cls.__new__(cls)
        plan.rows = rows
        plan.blocks_to_copy = blocks_to_copy or []
        plan.blocks_to_swap_out = blocks_to_swap_out or []
        plan.blocks_to_swap_in = blocks_to_swap_in or []
        plan.in_flight = in_flight
        plan.num_decode = num_decode
        samples: list[SamplingRow] = []
        owners: list[str] = []
        sample_tokens: list[int] = []
        prompt_tokens: list[int] = []
        feed_rows: list[int] = []
        feed_tokens: list[int] = []
        one_token = one_sample_each = True
        pool_spans: list[tuple[int, int, int]] = []
        grammar_rows: list[StepRow] = []
        t = 0
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            if row.pool is not None:
                pool_spans.append((i, t, n))
            if n != 1:
                one_token = False
            k = row.num_samples
            if k != 1:
                one_sample_each = False
            if row.prompt_logprob_targets:
                first = t + row.prompt_logprob_start - row.start_pos
                prompt_tokens.extend(range(first, first + len(row.prompt_logprob_targets)))
            if row.feed >= 0:
                feed_rows.append(row.feed)
                feed_tokens.append(t)
            if k:
                sampling = row.sampling
                assert sampling is not None
                if sampling.params.grammar is not None:
                    row.grammar = len(grammar_rows)
                    grammar_rows.append(row)
                samples.append(sampling)
                owners.append(row.seq_id)
                sample_tokens.append(t + n - 1)
                for j in range(1, k):
                    samples.append(fork_row(sampling, j))
                    owners.append(row.seq_id)
                    sample_tokens.append(t + n - 1)
            t += n
        plan.num_tokens = t
        plan.num_batched_tokens = t if num_batched_tokens is None else num_batched_tokens
        plan.samples, plan.sample_owners, plan.sample_tokens = samples, owners, sample_tokens
        plan.prompt_tokens = prompt_tokens
        plan.feed_rows, plan.feed_tokens = feed_rows, feed_tokens
        plan.one_token, plan.one_sample_each = one_token, one_sample_each
        plan.pool_spans = pool_spans
        plan.grammar_rows, plan.masks = grammar_rows, None
        plan.sample_masks = [r.grammar for r in rows for _ in range(r.num_samples)] if grammar_rows else None
        # A fed row samples the position after its placeholder: its output list lacks that one token.
        if not feed_rows:
            plan.sample_ahead = 0
        elif len(feed_rows) == len(samples):
            plan.sample_ahead = 1
        else:
            plan.sample_ahead = [int(r.feed >= 0) for r in rows for _ in range(r.num_samples)]
        return plan

    @property
    def is_empty(self) -> bool:
        return not (self.rows or self.blocks_to_copy or self.blocks_to_swap_out or self.blocks_to_swap_in)

    def __repr__(self) -> str:
        return (f"StepPlan({len(self.rows)} rows, {self.num_tokens} tokens, {len(self.samples)} samples, "
                f"in_flight={self.in_flight})")
