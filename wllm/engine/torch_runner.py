"""The PyTorch step runner: any device, any model, the reference the CUDA path is tested against.

It turns a `StepPlan` into flattened `input_ids[T]`, `positions[T]` and a `PagedAttentionContext`, runs
the forward pass, computes logits only for the rows the plan names (sampled rows and prompt positions
whose logprobs were asked for) and samples with the PyTorch `Sampler`, all before `launch` returns. Rows of
pooling requests are pooled instead (`wllm.model.pooling.pool`): the embedding or score is the row's result; a
step of pooling rows attends through `PoolingAttentionContext` (batched, no KV cache writes).
"""

from __future__ import annotations

import torch
from torch import nn

from wllm.engine.paged_attention import PagedAttentionContext
from wllm.engine.pooling_attention import PoolingAttentionContext
from wllm.engine.sampler import Sampler, prompt_logprobs
from wllm.engine.step_plan import RowResult, StepPlan
from wllm.model.pooling import PoolingConfig, pool


class TorchStepRunner:
    """Runs steps synchronously in PyTorch over the paged KV cache `kv_cache`."""

    supports_in_flight = False  # every step's tokens are on the host when `launch` returns

    def __init__(self, model: nn.Module, kv_cache: torch.Tensor) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.sampler = Sampler()
        # A pooling model's pooling (None: a generative model, whose plans have no pooling rows).
        self.pooling: PoolingConfig | None = getattr(model, "pooling", None)

    @staticmethod
    def profile_forward(model: nn.Module, scratch: torch.Tensor, num_tokens: int, num_rows: int,
                        max_model_len: int) -> None:
        """The largest step's forward and logits over a scratch cache, for memory profiling."""
        device = scratch.device
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        positions = torch.arange(num_tokens, device=device) % max_model_len
        ctx: PagedAttentionContext | PoolingAttentionContext
        if getattr(model, "pooling", None) is not None:
            # A pooling step runs through the batched context: its fullest step, prompts of max_model_len tokens.
            full, rest = divmod(num_tokens, max_model_len)
            ctx = PoolingAttentionContext([max_model_len] * full + [rest] * (rest > 0), device)
        else:
            ctx = PagedAttentionContext(scratch, [list(range(scratch.shape[2]))], [0], [num_tokens])
        hidden = model(ids, positions, ctx)
        model.compute_logits(hidden[-num_rows:])

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: object = None) -> dict[str, RowResult]:
        """Run the step; the handle is its results."""
        if plan.in_flight:
            raise ValueError("a step planned with a step in flight needs a runner with supports_in_flight")
        if not plan.rows:
            return {}
        ids: list[int] = []
        positions: list[int] = []
        for r in plan.rows:
            ids.extend(r.token_ids)
            positions.extend(range(r.start_pos, r.start_pos + len(r.token_ids)))
        device = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        rows = plan.rows
        ctx: PagedAttentionContext | PoolingAttentionContext
        if len(plan.pool_spans) == len(rows) and all(r.start_pos == 0 for r in rows):
            # Whole prompts that no later step reads: batched attention, nothing written to the cache.
            ctx = PoolingAttentionContext([len(r.token_ids) for r in rows], device)
        else:
            ctx = PagedAttentionContext(self.kv_cache, [r.block_ids for r in rows], [r.start_pos for r in rows],
                                        [len(r.token_ids) for r in rows])
        if any(r.token_type_start >= 0 for r in rows):
            # A cross-encoder's pairs: token type 1 from the second text on (pooling rows are whole prompts).
            types = [int(i >= r.token_type_start >= 0) for r in rows for i in range(len(r.token_ids))]
            hidden = self.model(input_ids, pos, ctx,
                                token_type_ids=torch.tensor(types, dtype=torch.long, device=device))
        else:
            hidden = self.model(input_ids, pos, ctx)
        results = {r.seq_id: RowResult([]) for r in rows}
        if plan.pool_spans:
            pooled = pool(self.model, self.pooling, hidden, [(t, n) for _, t, n in plan.pool_spans],
                          [rows[i].pool for i, _, _ in plan.pool_spans])
            for (i, _, _), vector in zip(plan.pool_spans, pooled):
                results[rows[i].seq_id].pooled = vector
        num_prompt = len(plan.prompt_tokens)
        if not num_prompt and not plan.samples:
            return results
        logit_rows = torch.tensor(plan.prompt_tokens + plan.sample_tokens, dtype=torch.long, device=device)
        logits = self.model.compute_logits(hidden[logit_rows])

        p = 0
        for r in rows:
            n = len(r.prompt_logprob_targets)
            if n:
                results[r.seq_id].prompt_logprobs = prompt_logprobs(logits[p:p + n], r.prompt_logprob_targets,
                                                                    r.prompt_logprobs or 0)
                p += n
        if plan.samples:
            # The grammar masks were filled on the host while the forward ran.
            masks = plan.masks.wait() if plan.masks is not None else None
            sampled = self.sampler(logits[num_prompt:], plan.samples, masks, plan.sample_masks)
            for owner, tok in zip(plan.sample_owners, sampled):
                results[owner].sampled.append(tok)
        return results

    def collect(self, handle: dict[str, RowResult]) -> dict[str, RowResult]:
        return handle

    def release(self, handle: dict[str, RowResult]) -> None:
        """Nothing runs on after `launch` here."""
