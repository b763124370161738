"""Rotary position embedding with a precomputed cos/sin table, applied through wllm.kernels."""

from __future__ import annotations

import torch
from torch import nn

from wllm.kernels import rotary_embedding
from wllm.model.config import ModelConfig, rope_attention_factor, rope_inv_freq


class RotaryEmbedding(nn.Module):
    """Rotates q and k in place by their positions.

    The cos/sin table ([max_positions, rotary_dim], cos half then sin half, fp32) is built
    lazily on the device of the first positions seen, not at construction: models are built
    on the meta device and materialised later, and a plain attribute survives that untouched.
    One instance is shared by all layers of a model.
    """

    def __init__(self, config: ModelConfig, is_neox: bool = True) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.is_neox = is_neox
        scaling = config.rope_scaling or {}
        max_pos = config.max_position_embeddings
        if scaling.get("rope_type") in ("linear", "dynamic", "yarn"):
            orig = int(scaling.get("original_max_position_embeddings") or max_pos)
            max_pos = max(max_pos, int(orig * float(scaling["factor"])))
        self.max_positions = max_pos
        self._config = config
        self._cache: torch.Tensor | None = None

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """The fp32 [max_positions, rotary_dim] table on `device` (built on first use)."""
        cache = self._cache
        if cache is None or cache.device != device:
            inv_freq = rope_inv_freq(self._config)
            t = torch.arange(self.max_positions, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)
            factor = rope_attention_factor(self._config)
            cache = torch.cat((freqs.cos() * factor, freqs.sin() * factor), dim=-1).to(device)
            self._cache = cache
        return cache

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        rotary_embedding(positions, q, k, self.head_dim, self.cos_sin_cache(positions.device), self.is_neox)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_positions={self.max_positions}"
