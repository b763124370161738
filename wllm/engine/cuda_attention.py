"""`AttentionContext` on CUDA: the paged KV cache through the prebuilt kernels.

Each layer's `attend` writes the new keys and values into their slots with `reshape_and_cache`
(slot -1 = a padding row, skipped); `attend_rotary` instead rotates q and k and writes k/v in one
kernel (`rotary_and_cache`), saving a launch per layer; at decode batch sizes `qkv_rotary_attend`
folds that into the qkv projection's skinny GEMM as well (`gemv_rotary_cache`). Each then runs
`paged_decode_attention` when every sequence has exactly one new token, and `paged_prefill_attention`
otherwise (it handles prefill chunks, prefix hits and decode tokens in one mixed batch). In a mixed batch whose first
`num_decode_seqs` sequences have one new token each, those rows go to the decode kernel instead:
the prefill kernel gives every query row a whole 64-128-row tensor-core tile, so a decode row
inside it costs as much as a full prefill tile over its context (the throughput workload's mixed
steps carry ~140 decode rows next to ~7,800 prefill rows, and spent 0.73 s of 6.2 s in prefill
attention). Sliding window, logit soft-capping and grouped-query attention go straight to the
kernels. All metadata are device tensors prepared by the runner, so the same context object can
be captured in a CUDA graph and replayed with new contents.

Cache layout as in paged_attention.py: `[num_layers, 2, num_blocks, block_size, Hkv, D]`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from wllm.kernels import paged_decode_attention, paged_prefill_attention, reshape_and_cache, rotary_and_cache
from wllm.kernels.ops import DECODE_HEAD_SIZES, PREFILL_HEAD_SIZES
from wllm.model.layers.linear import Linear
from wllm.model.layers.rotary import RotaryEmbedding

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def cuda_attention_unsupported(head_dim: int, block_size: int, dtype: torch.dtype) -> str | None:
    """Why the CUDA attention kernels cannot serve this cache (None when they can)."""
    if head_dim not in DECODE_HEAD_SIZES or head_dim not in PREFILL_HEAD_SIZES:
        return f"head size {head_dim} (kernels support {', '.join(map(str, DECODE_HEAD_SIZES))})"
    if block_size < 8 or block_size & (block_size - 1):
        return f"block size {block_size} (kernels need a power of two >= 8)"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (kernels support float16, bfloat16, float32)"
    return None


def mixed_split(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> dict[str, torch.Tensor]:
    """`decode_lens` and `prefill_starts` (see CudaAttentionContext) of a step whose single-token sequences
    come first, worked out on the device from its staged inputs, so that one captured graph serves any mix
    of decode rows and prompt chunks: each single-token sequence's context (0 for the others), and the query
    offsets with those sequences' ranges emptied (every offset at least their count)."""
    single = (query_start_loc[1:] - query_start_loc[:-1]) == 1
    return {"decode_lens": seq_lens * single,
            "prefill_starts": torch.maximum(query_start_loc, single.sum(dtype=torch.int32))}


def layer_caches(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(key cache, value cache) views [num_blocks, block_size, Hkv, D] of every layer, made once so
    the per-layer call does no indexing."""
    return [(kv_cache[layer, 0], kv_cache[layer, 1]) for layer in range(kv_cache.shape[0])]


class CudaAttentionContext:
    """One forward pass over the paged cache with the CUDA kernels.

    slot_mapping int64 [T]; block_tables int32 [S, max_blocks]; seq_lens int32 [S] (context
    including this step's tokens, 0 for a padding row); query_start_loc int32 [S + 1].
    `decode` selects the decode kernel (one new token per sequence); `max_seq_len` bounds seq_lens
    for it and must stay fixed across graph replays; `workspace` is its split-KV scratch. Otherwise
    the first `num_decode_seqs` sequences (one new token each) still go to the decode kernel and the
    rest to the prefill kernel. A captured mixed step, whose split is only known on the device, passes
    `decode_lens` (int32 [S]: the context of each single-token sequence, 0 for the others) and
    `prefill_starts` (query_start_loc with those sequences' query ranges emptied) instead: the decode
    kernel then runs over all S sequences and the prefill kernel over the prompt rows.
    """

    def __init__(
        self,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        *,
        decode: bool,
        max_seq_len: int,
        workspace: torch.Tensor | None = None,
        num_decode_seqs: int = 0,
        decode_lens: torch.Tensor | None = None,
        prefill_starts: torch.Tensor | None = None,
    ) -> None:
        self.caches = caches
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.query_start_loc = query_start_loc
        self.decode = decode
        self.max_seq_len = max_seq_len
        self.workspace = workspace
        self.num_decode_seqs = 0 if decode else num_decode_seqs
        if (decode_lens is None) != (prefill_starts is None):
            raise ValueError("decode_lens and prefill_starts go together")
        self.decode_lens = None if decode else decode_lens
        self.prefill_starts = prefill_starts

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        causal: bool = True,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        """Store k/v of the new tokens, return attention [T, Hq, D] over each sequence's cache."""
        if not causal:
            raise ValueError("the paged CUDA attention is causal only; encoder models run without the engine")
        key_cache, value_cache = self.caches[layer_idx]
        reshape_and_cache(k, v, key_cache, value_cache, self.slot_mapping)
        return self._attention(q, key_cache, value_cache, scale, sliding_window, logit_softcap)

    def attend_rotary(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
        *,
        scale: float,
        causal: bool = True,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        """`rotary(positions, q, k)` then `attend`, with the rotation and the KV write in one kernel
        (q rotated in place; k is left unrotated: the rotated keys exist only in the cache)."""
        if type(rotary) is not RotaryEmbedding:  # a subclass or other callable may rotate differently
            rotary(positions, q, k)
            return self.attend(layer_idx, q, k, v, scale=scale, causal=causal, sliding_window=sliding_window,
                               logit_softcap=logit_softcap)
        if not causal:
            raise ValueError("the paged CUDA attention is causal only; encoder models run without the engine")
        key_cache, value_cache = self.caches[layer_idx]
        rotary_and_cache(positions, q, k, v, key_cache, value_cache, self.slot_mapping,
                         rotary.cos_sin_cache(positions.device), rotary.is_neox)
        return self._attention(q, key_cache, value_cache, scale, sliding_window, logit_softcap)

    def qkv_rotary_attend(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        qkv_proj: Linear,
        positions: torch.Tensor,
        rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
        num_heads: int,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor | None:
        """Decode steps whose qkv projection's linear method fuses the rotation and the KV write into it
        (`apply_qkv_rotary`: a small weight, 1-2 rows): the projection of `hidden` by `qkv_proj` (over
        [q | k | v] heads), the rotation and the KV write in one kernel, then attention [T, Hq, D]. None when
        that does not apply; the caller then projects and calls `attend_rotary`."""
        if not (self.decode and type(rotary) is RotaryEmbedding):
            return None
        key_cache, value_cache = self.caches[layer_idx]
        q = qkv_proj.method.apply_qkv_rotary(qkv_proj, hidden, positions, self.slot_mapping, rotary, key_cache,
                                             value_cache, num_heads)
        if q is None:
            return None
        return self._attention(q, key_cache, value_cache, scale, sliding_window, logit_softcap)

    def _attention(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
                   sliding_window: int | None, logit_softcap: float | None) -> torch.Tensor:
        """Attention of q over the cache, which already holds this step's keys and values."""
        if self.decode:
            return paged_decode_attention(q, key_cache, value_cache, self.block_tables, self.seq_lens, scale,
                                          max_seq_len=self.max_seq_len, sliding_window=sliding_window,
                                          logit_softcap=logit_softcap, workspace=self.workspace)
        if self.decode_lens is not None:
            # Decode rows first (the others come back zero), then the prompt rows over them; the prefill
            # kernel leaves the rows in front of prefill_starts[0] alone.
            out = torch.empty_like(q)
            s = self.decode_lens.shape[0]
            paged_decode_attention(q[:s], key_cache, value_cache, self.block_tables, self.decode_lens, scale,
                                   max_seq_len=self.max_seq_len, sliding_window=sliding_window,
                                   logit_softcap=logit_softcap, workspace=self.workspace, out=out[:s])
            return paged_prefill_attention(q, key_cache, value_cache, self.block_tables, self.seq_lens,
                                           self.prefill_starts, scale, sliding_window=sliding_window,
                                           logit_softcap=logit_softcap, out=out)
        n = self.num_decode_seqs
        if not n:
            return paged_prefill_attention(q, key_cache, value_cache, self.block_tables, self.seq_lens,
                                           self.query_start_loc, scale, sliding_window=sliding_window,
                                           logit_softcap=logit_softcap)
        out = torch.empty_like(q)
        # The prefill sequences keep their offsets into q (query_start_loc[n] = n); the kernel skips
        # the tiles of the decode rows in front of them and leaves those output rows alone.
        paged_prefill_attention(q, key_cache, value_cache, self.block_tables[n:], self.seq_lens[n:],
                                self.query_start_loc[n:], scale, sliding_window=sliding_window,
                                logit_softcap=logit_softcap, out=out)
        paged_decode_attention(q[:n], key_cache, value_cache, self.block_tables[:n], self.seq_lens[:n], scale,
                               max_seq_len=self.max_seq_len, sliding_window=sliding_window,
                               logit_softcap=logit_softcap, out=out[:n])
        return out
