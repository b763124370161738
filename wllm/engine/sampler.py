"""Turn a batch of logits into next tokens, one row per sequence, each with its own parameters.

Order of processing (per row): logit_bias, min_tokens masking (EOS and stop_token_ids get -inf
until `min_tokens` outputs exist, unless `ignore_eos` for EOS), repetition penalty (prompt and
output tokens: positive logits divided by the penalty, negative ones multiplied), frequency and
presence penalties (output tokens: `logit -= frequency * count + presence * (count > 0)`), the grammar
mask (-inf for tokens a row's grammar forbids; temperature only scales, so masking before it is the same);
then greedy rows take the argmax, and random rows apply temperature, top-k, top-p, min-p and
draw with the exponential race `argmax(p / E)`, `E ~ Exp(1)`.

The noise of a row comes from a generator seeded by (request seed, sequence index, output
position) only, so a seeded request samples the same tokens whether it runs alone or in any
batch. Reported logprobs are those of the model's raw distribution (log-softmax of the logits
before any processing), as in vLLM.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence as Seq

import msgspec
import torch

from wllm.kernels.reference import apply_token_bitmask
from wllm.outputs import StepLogprobs, TokenLogprob
from wllm.sampling_params import SamplingParams


class SamplingRow(msgspec.Struct):
    """What the sampler needs about one sequence for one step."""

    params: SamplingParams
    seed: int  # the request seed (or one the engine drew for it)
    index: int  # which of the request's n sequences
    prompt_token_ids: Seq[int]  # the request's prompt tuple (see wllm.engine.request)
    output_token_ids: list[int]
    eos_token_ids: list[int]


class SampledToken(msgspec.Struct):
    token_id: int
    logprob: float  # raw model logprob of the chosen token
    logprobs: StepLogprobs | None = None  # filled when params.logprobs is set


def row_seed(seed: int, index: int, position: int) -> int:
    """A 63-bit generator seed from (seed, index, position): a counter-based random stream."""
    data = seed.to_bytes(16, "little", signed=True) + index.to_bytes(8, "little") + position.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def step_logprobs(logprobs: torch.Tensor, token_id: int, num_top: int) -> StepLogprobs:
    """Logprob and rank of `token_id` in a 1-D logprob row plus the `num_top` best tokens."""
    chosen = logprobs[token_id]
    rank = int((logprobs > chosen).sum().item()) + 1
    top: list[TokenLogprob] = []
    if num_top > 0:
        values, ids = torch.topk(logprobs, min(num_top, logprobs.numel()))
        top = [TokenLogprob(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist())]
    return StepLogprobs(token_id=token_id, logprob=float(chosen.item()), rank=rank, top=top)


def prompt_logprobs(logits: torch.Tensor, next_token_ids: Seq[int], num_top: int) -> list[StepLogprobs]:
    """For prompt positions: row j of `logits` predicts `next_token_ids[j]`."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [step_logprobs(lp[j], int(t), num_top) for j, t in enumerate(next_token_ids)]


def _apply_penalties(logits: torch.Tensor, rows: Seq[SamplingRow]) -> None:
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
            if ids.numel():
                bias = torch.tensor([p.logit_bias[t] for t in ids.tolist()], dtype=logits.dtype)
                logits[i].index_add_(0, ids.to(logits.device), bias.to(logits.device))
        if len(row.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(row.eos_token_ids))
            banned = [t for t in banned if 0 <= t < vocab]
            if banned:
                logits[i, banned] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            ids = [*row.prompt_token_ids, *row.output_token_ids]
            if ids:
                seen[torch.tensor(ids, dtype=torch.long, device=logits.device)] = True
            r = p.repetition_penalty
            penalised = torch.where(logits[i] > 0, logits[i] / r, logits[i] * r)
            logits[i] = torch.where(seen, penalised, logits[i])
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and row.output_token_ids:
            out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on one row; returns probabilities."""
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
        # already does.
        drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


class Sampler:
    """Samples one token per row; stateless apart from the device it runs on."""

    def __call__(self, logits: torch.Tensor, rows: Seq[SamplingRow], masks: torch.Tensor | None = None,
                 mask_index: Seq[int] | None = None) -> list[SampledToken]:
        """`masks` [G, W] int32 grammar bitmasks and `mask_index` (per row: its mask row, -1 for none)."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"sampler got {logits.shape[0]} logit rows for {len(rows)} sequences")
        if not rows:
            return []
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = logits.clone()
        _apply_penalties(processed, rows)
        if masks is not None and mask_index is not None:
            apply_token_bitmask(processed, masks, torch.tensor(mask_index, dtype=torch.int32, device=logits.device))
        greedy_ids = torch.argmax(processed, dim=-1).tolist()
        out: list[SampledToken] = []
        for i, row in enumerate(rows):
            p = row.params
            if p.temperature == 0.0:
                token = int(greedy_ids[i])
            else:
                probs = _filter(processed[i], p)
                gen = torch.Generator(device=logits.device)
                gen.manual_seed(row_seed(row.seed, row.index, len(row.output_token_ids)))
                noise = torch.empty_like(probs).exponential_(generator=gen)
                token = int(torch.argmax(probs / noise).item())
            lp = raw_logprobs[i]
            if p.logprobs is not None:
                step = step_logprobs(lp, token, p.logprobs)
                out.append(SampledToken(token, step.logprob, step))
            else:
                out.append(SampledToken(token, float(lp[token].item())))
        return out
