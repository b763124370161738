"""Sampling on the GPU: one token per row of logits with per-request temperature, top-k, top-p,
min-p, penalties and logit_bias, seeded per (request, sequence) -- the C-ABI sampler behind a custom
op, with the PyTorch reference (`reference.sample`) off CUDA, and the packing of engine rows into its
inputs."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wllm.kernels import _lib, reference
from wllm.kernels.ops import _dtype_code, _is_compiling, _stream, persistent_workspace


def _cuda_sample(logits: torch.Tensor, params_f32: torch.Tensor, params_i64: torch.Tensor,
                 bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                 penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                 return_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    what = "sample"
    num_rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"{what}: logits must be float32 [S, V] with a contiguous last dim")
    expected = ((params_f32, torch.float32, (num_rows, 6)), (params_i64, torch.int64, (num_rows, 3)))
    for t, dtype, shape in expected:
        if t.dtype != dtype or t.shape != shape or t.device != logits.device:
            raise ValueError(f"{what}: expected {dtype} {shape} on {logits.device}, got {t.dtype} {tuple(t.shape)}")
    csr = []
    for name, group, kinds in (("logit_bias", bias, (torch.int32, torch.int32, torch.float32)),
                               ("penalties", penalties, (torch.int32, torch.int32, torch.int32))):
        if group is None:
            csr.append((None, None, None))
            continue
        offsets, tokens, values = (t.contiguous() for t in group)
        if tuple(t.dtype for t in group) != kinds or offsets.shape != (num_rows + 1,) or \
                tokens.shape != values.shape or any(t.device != logits.device for t in group):
            raise ValueError(f"{what}: {name} must be CSR (offsets int32 [S + 1], tokens int32 [N], values "
                             f"{kinds[2]} [N]) on {logits.device}")
        csr.append((offsets, tokens, values))
    saved_len = sum(c[1].numel() for c in csr if c[1] is not None)
    saved = torch.empty(max(saved_len, 1), dtype=torch.float32, device=logits.device)
    tokens_out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    logprobs_out = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    raw = torch.empty((num_rows, vocab), dtype=torch.float32, device=logits.device) if return_logprobs else None

    def ptr(t: torch.Tensor | None) -> int | None:
        return t.data_ptr() if t is not None else None

    lib = _lib.binding(logits.device.index or 0)
    # Without one (a graph captured first) the kernel runs one block per row: same results, slower.
    workspace = persistent_workspace(_SAMPLE_WORKSPACES, logits.device, lib, "wllm_sample_workspace_size")
    lib.check(lib.wllm_sample(
        logits.data_ptr(), num_rows, vocab, logits.stride(0), params_f32.contiguous().data_ptr(),
        params_i64.contiguous().data_ptr(), *(ptr(t) for t in csr[0]), *(ptr(t) for t in csr[1]), saved.data_ptr(),
        tokens_out.data_ptr(), logprobs_out.data_ptr(), ptr(raw), vocab, ptr(workspace),
        workspace.numel() if workspace is not None else 0, _stream(logits)), what)
    return tokens_out, logprobs_out, raw


_SAMPLE_WORKSPACES: dict[int, torch.Tensor] = {}


@torch.library.custom_op("wllm::sample", mutates_args=("logits",))
def sample_op(logits: torch.Tensor, params_f32: torch.Tensor, params_i64: torch.Tensor,
              bias_offsets: torch.Tensor | None, bias_tokens: torch.Tensor | None, bias_values: torch.Tensor | None,
              penalty_offsets: torch.Tensor | None, penalty_tokens: torch.Tensor | None,
              penalty_counts: torch.Tensor | None, return_logprobs: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, logprobs, raw = sample(logits, params_f32, params_i64, bias_offsets, bias_tokens, bias_values,
                                   penalty_offsets, penalty_tokens, penalty_counts, return_logprobs)
    return tokens, logprobs, raw if raw is not None else logits.new_empty((0, logits.shape[1]))


@sample_op.register_fake
def _(logits: torch.Tensor, params_f32: torch.Tensor, params_i64: torch.Tensor, bias_offsets: torch.Tensor | None,
      bias_tokens: torch.Tensor | None, bias_values: torch.Tensor | None, penalty_offsets: torch.Tensor | None,
      penalty_tokens: torch.Tensor | None, penalty_counts: torch.Tensor | None, return_logprobs: bool
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = logits.shape[0] if return_logprobs else 0
    return (logits.new_empty(logits.shape[0], dtype=torch.int64), logits.new_empty(logits.shape[0]),
            logits.new_empty((rows, logits.shape[1])))


def sample(logits: torch.Tensor, params_f32: torch.Tensor, params_i64: torch.Tensor,
           bias_offsets: torch.Tensor | None = None, bias_tokens: torch.Tensor | None = None,
           bias_values: torch.Tensor | None = None, penalty_offsets: torch.Tensor | None = None,
           penalty_tokens: torch.Tensor | None = None, penalty_counts: torch.Tensor | None = None,
           return_logprobs: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One token per row of fp32 logits [S, V]: (tokens int64 [S], raw logprob of each fp32 [S], raw
    log-softmax [S, V] when return_logprobs). Inputs as built by pack_sampling_rows; semantics in
    csrc/api.h (wllm_sample) and reference.sample. logits are left unchanged."""
    bias = (bias_offsets, bias_tokens, bias_values) if bias_offsets is not None else None
    penalties = (penalty_offsets, penalty_tokens, penalty_counts) if penalty_offsets is not None else None
    if not logits.is_cuda:
        return reference.sample(logits, params_f32, params_i64, *(bias or (None,) * 3), *(penalties or (None,) * 3),
                                return_logprobs=return_logprobs)
    if _is_compiling():
        tokens, logprobs, raw = sample_op(logits, params_f32, params_i64, *(bias or (None,) * 3),
                                          *(penalties or (None,) * 3), return_logprobs)
        return tokens, logprobs, raw if return_logprobs else None
    return _cuda_sample(logits, params_f32, params_i64, bias, penalties, return_logprobs)


@functools.lru_cache(maxsize=1 << 16)
def sequence_seed(seed: int, index: int) -> int:
    """The Philox key of sequence `index` of a request seeded with `seed` (a signed 64-bit value).
    Cached: the engine asks for the same few keys every step."""
    data = seed.to_bytes(16, "little", signed=True) + index.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


@dataclass
class SamplingLists:
    """The `sample` kernel's inputs for a batch of rows as host lists: per-row parameters and the two
    CSR lists (logit_bias plus min_tokens bans; penalty tokens with their counts)."""

    f32: list[tuple[float, float, float, float, float, float]]
    i64: list[tuple[int, int, int]]
    bias_off: list[int]
    bias_tok: list[int]
    bias_val: list[float]
    pen_off: list[int]
    pen_tok: list[int]
    pen_cnt: list[int]


def row_parameters(row: Any) -> tuple[tuple[float, float, float, float, float, float], int, int]:
    """An engine row's fixed kernel parameters: its fp32 row (temperature, top_p, min_p, repetition,
    frequency, presence) and the first two int64 columns (top_k, Philox key); the third is its output count."""
    p = row.params
    return ((p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty),
            max(p.top_k, 0), sequence_seed(row.seed, row.index))


def sampling_lists(rows: Sequence, vocab_size: int | None = None, ahead: int | Sequence = 0) -> SamplingLists:
    """Engine rows (objects with params: SamplingParams, seed, index, prompt_token_ids, output_token_ids,
    eos_token_ids) as kernel inputs, with the CPU sampler's semantics: logit_bias plus -inf bans of EOS /
    stop tokens until min_tokens outputs exist, penalties over prompt and output tokens, random stream
    keyed by (seed, index) and counted by the output position. `vocab_size` drops bias entries outside
    the vocabulary. `ahead` output tokens are counted on top of each row's list, or with a sequence
    `ahead[i]` on top of row i's (a lookahead step samples after a token the host has not seen; only its
    count matters, so rows with penalties, which need its value, must not be packed ahead)."""
    out = SamplingLists([], [], [0], [], [], [0], [], [])
    per_row = not isinstance(ahead, int)
    for i, row in enumerate(rows):
        p = row.params
        n_out = len(row.output_token_ids) + (ahead[i] if per_row else ahead)
        f32, top_k, key = row_parameters(row)
        out.f32.append(f32)
        out.i64.append((top_k, key, n_out))
        for token, value in (p.logit_bias or {}).items():
            if vocab_size is None or 0 <= int(token) < vocab_size:
                out.bias_tok.append(int(token))
                out.bias_val.append(float(value))
        if n_out < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(row.eos_token_ids))
            banned = [t for t in banned if vocab_size is None or 0 <= t < vocab_size]
            out.bias_tok += banned
            out.bias_val += [float("-inf")] * len(banned)
        out.bias_off.append(len(out.bias_tok))
        if p.has_penalties:
            counts = dict.fromkeys(row.prompt_token_ids, 0)
            for token in row.output_token_ids:
                counts[token] = counts.get(token, 0) + 1
            out.pen_tok += counts.keys()
            out.pen_cnt += counts.values()
        out.pen_off.append(len(out.pen_tok))
    return out


def pack_sampling_rows(rows: Sequence, device: torch.device | str = "cpu", vocab_size: int | None = None,
                       ahead: int | Sequence = 0) -> dict[str, torch.Tensor | None]:
    """Keyword arguments of `sample` for engine rows, as one-off tensors on `device` (see
    `sampling_lists` for the semantics and the arguments)."""
    lists = sampling_lists(rows, vocab_size, ahead)

    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device)

    out: dict[str, torch.Tensor | None] = {"params_f32": t(lists.f32, torch.float32).reshape(-1, 6),
                                           "params_i64": t(lists.i64, torch.int64).reshape(-1, 3)}
    has_bias, has_pen = bool(lists.bias_tok), bool(lists.pen_tok)
    out["bias_offsets"] = t(lists.bias_off, torch.int32) if has_bias else None
    out["bias_tokens"] = t(lists.bias_tok, torch.int32) if has_bias else None
    out["bias_values"] = t(lists.bias_val, torch.float32) if has_bias else None
    out["penalty_offsets"] = t(lists.pen_off, torch.int32) if has_pen else None
    out["penalty_tokens"] = t(lists.pen_tok, torch.int32) if has_pen else None
    out["penalty_counts"] = t(lists.pen_cnt, torch.int32) if has_pen else None
    return out


def _cuda_apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, mask_index: torch.Tensor | None) -> None:
    what = "apply_token_bitmask"
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"{what}: logits must be [S, V] with a contiguous last dim")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or not bitmask.is_contiguous() or \
            bitmask.device != logits.device:
        raise ValueError(f"{what}: bitmask must be contiguous int32 [G, W] on {logits.device}")
    if mask_index is not None and (mask_index.dtype != torch.int32 or mask_index.shape != (logits.shape[0],)
                                   or mask_index.device != logits.device):
        raise ValueError(f"{what}: mask_index must be int32 [S] on {logits.device}")
    lib = _lib.binding(logits.device.index or 0)
    lib.check(lib.wllm_apply_token_bitmask(
        logits.data_ptr(), bitmask.data_ptr(), mask_index.contiguous().data_ptr() if mask_index is not None else None,
        logits.shape[0], logits.shape[1], logits.stride(0), bitmask.shape[1], _dtype_code(logits, what),
        _stream(logits)), what)


@torch.library.custom_op("wllm::apply_token_bitmask", mutates_args=("logits",))
def apply_token_bitmask_op(logits: torch.Tensor, bitmask: torch.Tensor, mask_index: torch.Tensor | None) -> None:
    _cuda_apply_token_bitmask(logits, bitmask, mask_index)


@apply_token_bitmask_op.register_fake
def _(logits: torch.Tensor, bitmask: torch.Tensor, mask_index: torch.Tensor | None) -> None:
    return None


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, mask_index: torch.Tensor | None = None) -> None:
    """Grammar masks, in place: -inf for every token the row's mask forbids (see
    reference.apply_token_bitmask and wllm_apply_token_bitmask in csrc/api.h)."""
    if not logits.is_cuda:
        reference.apply_token_bitmask(logits, bitmask, mask_index)
    elif _is_compiling():
        apply_token_bitmask_op(logits, bitmask, mask_index)
    else:
        _cuda_apply_token_bitmask(logits, bitmask, mask_index)
