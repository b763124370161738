"""Llama (1, 2, 3, 3.1 with "llama3" rope scaling) and the decoder pieces other families reuse."""

from __future__ import annotations

import torch
from torch import nn

from wllm.model.attention_interface import AttentionContext, attend_with_rotary
from wllm.model.config import ModelConfig
from wllm.model.layers import (
    GatedMLP,
    Linear,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    compute_logits,
)
from wllm.model.models.base import ModelBase


class DecoderAttention(nn.Module):
    """Self-attention with fused qkv, optional per-head q/k RMSNorm (Qwen3) and RoPE.

    Scale, sliding window and softcap come from the config, so Gemma 2 uses it unchanged.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.layer_sliding_windows[layer_idx] if config.layer_sliding_windows else None
        self.softcap = config.attn_logit_softcapping
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps) if qk_norm else None
        self.rotary = rotary

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        ctx: AttentionContext,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The attention output after o_proj; None when it went straight into `residual` (given, and
        o_proj on cuBLAS: see Linear.forward)."""
        n = hidden.shape[0]
        fused = getattr(ctx, "qkv_rotary_attend", None)
        if fused is not None and self.q_norm is None:
            # The context may project, rotate and write the cache in one kernel (CUDA decode steps).
            out = fused(self.layer_idx, hidden, self.qkv_proj, positions, self.rotary, self.num_heads,
                        scale=self.scale, sliding_window=self.sliding_window, logit_softcap=self.softcap)
            if out is not None:
                return self.o_proj(out.reshape(n, self.num_heads * self.head_dim), residual)
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # Norm over each head: [T * heads, head_dim] rows for the kernel.
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(n, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(n, self.num_kv_heads, self.head_dim)
        # The context may fuse the rotation into its KV-cache write (one kernel on CUDA).
        out = attend_with_rotary(
            ctx,
            self.layer_idx,
            q,
            k,
            v,
            positions,
            self.rotary,
            scale=self.scale,
            causal=True,
            sliding_window=self.sliding_window,
            logit_softcap=self.softcap,
        )
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim), residual)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)), with the adds fused into the norms."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool = False,
        norm_offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_idx, rotary, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps, norm_offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps, norm_offset)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        residual: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(output, residual stream); output None when the down projection has already added it into
        the residual (the next layer's or the final norm then normalises the residual alone)."""
        hidden, residual = _norm_add(self.input_layernorm, hidden, residual)
        attn = self.self_attn(positions, hidden, ctx, residual)
        hidden, residual = _norm_add(self.post_attention_layernorm, attn, residual)
        return self.mlp(hidden, residual), residual


def _norm_add(
    norm: RMSNorm, x: torch.Tensor | None, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x), the add in place; x None: already added; residual None: the
    first layer (x is the stream)."""
    if residual is None:
        assert x is not None
        return norm(x), x
    if x is None:
        return norm(residual), residual
    return norm(x, residual)


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(
        self,
        config: ModelConfig,
        layers: list[nn.Module],
        norm_offset: float = 0.0,
        embed_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, norm_offset)
        self.embed_scale = embed_scale
        self._scales: dict[torch.dtype, float] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            # Gemma rounds the scale to the activation dtype before multiplying; a Python float
            # holding that rounded value gives the same products without a tensor per call.
            scale = self._scales.get(hidden.dtype)
            if scale is None:
                scale = self._scales[hidden.dtype] = float(torch.tensor(self.embed_scale, dtype=hidden.dtype))
            hidden = hidden * scale
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        hidden, _ = _norm_add(self.norm, hidden, residual)
        return hidden


class LlamaForCausalLM(ModelBase):
    """Llama-family decoder-only LM. Subclasses change the knobs below or the layer class."""

    qkv_bias: bool | None = None  # None: follow config.attention_bias
    o_bias: bool | None = None
    qk_norm = False
    norm_offset = 0.0
    scale_embeddings = False
    headless = False  # a base-model checkpoint (an embedder): no LM head, tensor names without "model."

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.rotary = RotaryEmbedding(config)
        layers = [self.make_layer(config, i) for i in range(config.num_hidden_layers)]
        embed_scale = config.hidden_size**0.5 if self.scale_embeddings else None
        self.model = DecoderModel(config, layers, self.norm_offset, embed_scale)
        tied = config.tie_word_embeddings or self.headless
        self.lm_head = None if tied else Linear(config.hidden_size, config.vocab_size)

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        qkv_bias = config.attention_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = config.attention_bias if self.o_bias is None else self.o_bias
        return LlamaDecoderLayer(
            config,
            layer_idx,
            self.rotary,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=self.qk_norm,
            norm_offset=self.norm_offset,
        )

    def map_name(self, name: str) -> str | None:
        if name.startswith("lm_head.") and self.lm_head is None:
            return None  # tied: some checkpoints still store a copy of the embedding
        if self.headless and not name.startswith("model."):
            return "model." + name
        return name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for flattened tokens of a batch."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [N, vocab] (into `out` when given); final logit softcap applied when the config
        has one."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return compute_logits(hidden, head, self.config.final_logit_softcapping, out)


class LlamaModel(LlamaForCausalLM):
    """A headless Llama (an embedding checkpoint)."""

    headless = True


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama layout; its sliding window (when set) applies to every layer."""
