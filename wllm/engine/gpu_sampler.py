"""Sampling on the GPU: persistent inputs of the `wllm.kernels.sample` kernel and logprobs on the device.

The kernel takes per-row parameters (`[S, 6]` fp32, `[S, 3]` int64) and two CSR lists (logit_bias
plus min_tokens bans; penalty tokens with their output counts). `SamplingBuffers` keeps them in
pinned host memory and in device memory of a fixed capacity, so a step writes its rows on the host
and starts asynchronous copies, and a CUDA graph captured over the device buffers stays valid for
every later step. Semantics are the CPU sampler's (see sampler.py and `pack_sampling_rows`): the
same processing order, a random stream keyed by (seed, sequence index) and counted by the output
position, so a seeded request samples the same tokens alone or in any batch. The stream itself is
Philox, not the CPU sampler's torch.Generator, so seeded CPU and GPU runs differ; greedy is identical.

Logprobs (sampled and prompt) are computed on the device as one packed fp32 matrix per step
(`logprob_matrix`) and turned into `StepLogprobs` on the host after the step's single copy back.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from wllm.engine.sampler import SamplingRow
from wllm.kernels.sampling import SamplingLists, pack_sampling_rows, row_parameters, sampling_lists
from wllm.outputs import StepLogprobs, TokenLogprob


class StagedBuffer:
    """A pinned host buffer (with a numpy view for cheap writes) and its device twin of the same shape."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.host.numpy()
        self.dev = torch.zeros(shape, dtype=dtype, device=device)

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first n rows to the device (asynchronously from pinned memory); returns them."""
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        return self.dev[:n]


class SamplingBuffers:
    """Kernel inputs for up to `max_rows` rows, with CSR capacities for logit_bias and penalties.

    `pack(rows, padded)` fills rows 0..len(rows)-1 and zero (greedy) padding rows up to `padded`.
    It returns the `sample` keyword arguments and whether they live in the persistent buffers (a
    step that overflows a capacity gets one-off tensors, and cannot replay a CUDA graph).
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, bias_capacity: int = 16384,
                 penalty_capacity: int = 262144) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.device = device
        self.f32 = StagedBuffer((max_rows, 6), torch.float32, device)
        self.i64 = StagedBuffer((max_rows, 3), torch.int64, device)
        self.bias_off = StagedBuffer((max_rows + 1,), torch.int32, device)
        self.bias_tok = StagedBuffer((bias_capacity,), torch.int32, device)
        self.bias_val = StagedBuffer((bias_capacity,), torch.float32, device)
        self.pen_off = StagedBuffer((max_rows + 1,), torch.int32, device)
        self.pen_tok = StagedBuffer((penalty_capacity,), torch.int32, device)
        self.pen_cnt = StagedBuffer((penalty_capacity,), torch.int32, device)
        # Whether a device offsets buffer may hold non-zero entries; while it is all zeros, steps
        # without entries skip its upload (the common case: no bias, no penalties).
        self._dirty = {"bias": False, "penalty": False}
        # `_stage_plain`'s record: the staged f32 array it wrote last and the rows whose fixed columns are there.
        self._staged_to: np.ndarray | None = None
        self._staged_rows: list[SamplingRow] = []

    def static_kwargs(self, rows: int, params_f32: torch.Tensor | None = None,
                      params_i64: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The kernel arguments over the persistent device buffers for `rows` rows, CSR lists at full
        capacity (what a CUDA graph captures: the kernel reads only the entries the offsets name).
        `params_f32`/`params_i64` replace the own per-row buffers when the rows are staged elsewhere."""
        return {
            "params_f32": self.f32.dev[:rows] if params_f32 is None else params_f32,
            "params_i64": self.i64.dev[:rows] if params_i64 is None else params_i64,
            "bias_offsets": self.bias_off.dev[:rows + 1], "bias_tokens": self.bias_tok.dev,
            "bias_values": self.bias_val.dev, "penalty_offsets": self.pen_off.dev[:rows + 1],
            "penalty_tokens": self.pen_tok.dev, "penalty_counts": self.pen_cnt.dev,
        }

    def pack(self, rows: Seq[SamplingRow], padded: int | None = None, *, full_csr: bool = False,
             stage: tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor] | None = None,
             ahead: int | Seq[int] = 0,
             ) -> tuple[dict[str, torch.Tensor | None], bool]:
        """Write `rows` (plus greedy padding rows up to `padded`) and copy them to the device.

        With `stage` (host f32 [>=padded, 6], host i64 [>=padded, 3], their device views) the per-row
        parameters go there instead, and the caller uploads them with the rest of its step inputs.

        `ahead` output tokens are counted on top of each row's `output_token_ids` (a sequence: per
        row): a lookahead step samples the position after a token the host has not seen yet (its
        random stream and min_tokens depend on the count only; rows with penalties, which need the
        values, are never packed ahead).

        Returns (kwargs for `wllm.kernels.sample`, static). With `full_csr` the CSR arguments are
        always the full-capacity buffers (graph replay); otherwise they are trimmed, or None when
        the step has no entries.
        """
        n = len(rows)
        padded = n if padded is None else padded
        plain = stage is not None and padded <= self.max_rows and self._stage_plain(rows, stage[0], stage[1], ahead)
        if plain:
            lists = SamplingLists([], [], [0], [], [], [0], [], [])  # rows written; no bias or penalty entries
        else:
            self._staged_to = None
            lists = sampling_lists(rows, self.vocab_size, ahead)
        bias_off, bias_tok, bias_val = lists.bias_off, lists.bias_tok, lists.bias_val
        pen_off, pen_tok, pen_cnt = lists.pen_off, lists.pen_tok, lists.pen_cnt
        if padded > self.max_rows or len(bias_tok) > self.bias_tok.np.shape[0] or \
                len(pen_tok) > self.pen_tok.np.shape[0]:
            return pack_sampling_rows(rows, self.device, self.vocab_size, ahead), False

        f32_np, i64_np = (self.f32.np, self.i64.np) if stage is None else stage[:2]
        if n and not plain:
            f32_np[:n] = lists.f32
            i64_np[:n] = lists.i64
        if n < padded:
            f32_np[n:padded] = (0.0, 1.0, 0.0, 1.0, 0.0, 0.0)  # greedy, no filters, neutral penalties
            i64_np[n:padded] = 0
        out: dict[str, torch.Tensor | None]
        if stage is None:
            out = {"params_f32": self.f32.upload(padded), "params_i64": self.i64.upload(padded)}
        else:
            f32_dev, i64_dev = stage[2], stage[3]
            if f32_dev.shape[0] != padded:
                f32_dev, i64_dev = f32_dev[:padded], i64_dev[:padded]
            out = {"params_f32": f32_dev, "params_i64": i64_dev}
        for name, off, lists, pairs in (("bias", bias_off, (bias_tok, bias_val), (self.bias_tok, self.bias_val)),
                                        ("penalty", pen_off, (pen_tok, pen_cnt), (self.pen_tok, self.pen_cnt))):
            offsets = self.bias_off if name == "bias" else self.pen_off
            count = off[-1]
            second = "values" if name == "bias" else "counts"
            if not count:
                if self._dirty[name]:
                    offsets.np[:] = 0
                    offsets.upload(offsets.np.shape[0])
                    self._dirty[name] = False
                if not full_csr:
                    out[f"{name}_offsets"] = out[f"{name}_tokens"] = out[f"{name}_{second}"] = None
                    continue
                out[f"{name}_offsets"] = offsets.dev[:padded + 1]
            else:
                offsets.np[:n + 1] = off
                offsets.np[n + 1:padded + 1] = count
                out[f"{name}_offsets"] = offsets.upload(padded + 1)
                self._dirty[name] = True
                for pair, values in zip(pairs, lists):
                    pair.np[:count] = values
                    pair.upload(count)
            out[f"{name}_tokens"] = pairs[0].dev if full_csr else pairs[0].dev[:count]
            out[f"{name}_{second}"] = pairs[1].dev if full_csr else pairs[1].dev[:count]
        return out, True

    def _stage_plain(self, rows: Seq[SamplingRow], f32_np: np.ndarray, i64_np: np.ndarray,
                     ahead: int | Seq[int]) -> bool:
        """`sampling_lists`' per-row parameters written straight into a staging layout's arrays, for steps
        whose rows need no CSR entries (no logit_bias, min_tokens or penalties: the usual decode step);
        False when a row needs them, with the rows before it possibly written already (the caller then
        writes every row, or does not use the arrays; `StepInputs.sampling_stage` has already dropped any
        block-table record these bytes could overlap).

        A row's parameters other than its output count are fixed for its sequence's life (one SamplingRow
        object serves every step), so a row written into the same arrays at the same index last time only
        gets its new count: a steady decode step writes one column, not every row. The host bytes are
        shared by all layouts: any pack into other arrays (or none) starts over (`_staged_to`)."""
        before = self._staged_rows if self._staged_to is f32_np else ()
        known = len(before)
        for i, row in enumerate(rows):
            if i < known and before[i] is row:
                continue
            p = row.params
            if p.logit_bias or p.min_tokens or p.has_penalties:
                return False
            f32, top_k, key = row_parameters(row)
            f32_np[i] = f32
            i64_np[i, :2] = (top_k, key)
        n = len(rows)
        counts = i64_np[:n, 2]
        counts[:] = [len(row.output_token_ids) for row in rows]
        if not isinstance(ahead, int) or ahead:
            counts += ahead
        self._staged_to, self._staged_rows = f32_np, list(rows)
        return True


def logprob_matrix(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> torch.Tensor:
    """Per row of fp32 logits [R, V]: [logprob of targets[r], its rank, num_top best logprobs, their
    token ids] as one fp32 matrix [R, 2 + 2 * num_top] on the device (ids and ranks are exact in fp32
    below 2^24, far above any vocabulary)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets.view(-1, 1).long())
    rank = (lp > chosen).sum(dim=-1, keepdim=True).float() + 1.0
    parts = [chosen, rank]
    if num_top > 0:
        values, ids = torch.topk(lp, min(num_top, lp.shape[-1]), dim=-1)
        parts += [values, ids.float()]
    return torch.cat(parts, dim=1)


def step_logprobs_from_row(row: Seq[float], token_id: int, num_top: int) -> StepLogprobs:
    """Unpack one row of `logprob_matrix` (as host floats) for a request that asked for num_top."""
    width = (len(row) - 2) // 2
    k = min(num_top, width)
    top = [TokenLogprob(int(row[2 + width + j]), float(row[2 + j])) for j in range(k)]
    return StepLogprobs(token_id=token_id, logprob=float(row[0]), rank=int(row[1]), top=top)

