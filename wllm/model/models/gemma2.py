"""Gemma 2: Gemma plus "sandwich" norms, attention and final logit soft-capping,
query_pre_attn_scalar and a sliding window on alternating layers (all from the config)."""

from __future__ import annotations

import torch
from torch import nn

from wllm.model.attention_interface import AttentionContext
from wllm.model.config import ModelConfig
from wllm.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from wllm.model.models.gemma import GemmaForCausalLM
from wllm.model.models.llama import DecoderAttention


class Gemma2DecoderLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then + post_ff_norm(mlp(pre_ff_norm(.)))."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        eps, h = config.norm_eps, config.hidden_size
        self.self_attn = DecoderAttention(
            config, layer_idx, rotary, qkv_bias=config.attention_bias, o_bias=config.attention_bias
        )
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(h, eps, 1.0)
        self.post_attention_layernorm = RMSNorm(h, eps, 1.0)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, 1.0)
        self.post_feedforward_layernorm = RMSNorm(h, eps, 1.0)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, ctx))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2 decoder-only LM."""

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return Gemma2DecoderLayer(config, layer_idx, self.rotary)
