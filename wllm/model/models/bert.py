"""BERT encoder (BertModel): bidirectional attention, absolute position and token-type
embeddings, post-LayerNorm blocks. Returns the last hidden states (for embeddings); `BertForSequenceClassification`
adds the pooler and the classifier of a cross-encoder (`classify`)."""

from __future__ import annotations

import torch
from torch import nn

from wllm.model.attention_interface import AttentionContext
from wllm.model.config import ModelConfig
from wllm.model.layers import LayerNorm, Linear, MergedLinear, VocabEmbedding, get_activation
from wllm.model.models.base import ModelBase


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = VocabEmbedding(config.vocab_size, h)
        self.position_embeddings = VocabEmbedding(config.max_position_embeddings, h)
        self.token_type_embeddings = VocabEmbedding(max(config.type_vocab_size, 1), h)
        self.LayerNorm = LayerNorm(h, config.norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.qkv_proj = MergedLinear(h, (h, h, h), ("q", "k", "v"), bias=True)


class BertAttentionOutput(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=True)
        self.LayerNorm = LayerNorm(config.hidden_size, config.norm_eps)


class BertAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertAttentionOutput(config)


class BertDense(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.dense = Linear(n_in, n_out, bias=True)


class BertOutput(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.LayerNorm = LayerNorm(config.hidden_size, config.norm_eps)


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.attention = BertAttention(config)
        self.intermediate = BertDense(config.hidden_size, config.intermediate_size)
        self.output = BertOutput(config)
        self.act = get_activation(config.hidden_act)

    def forward(self, hidden: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        n = hidden.shape[0]
        qkv = self.attention.self.qkv_proj
        q, k, v = (t.reshape(n, self.num_heads, self.head_dim) for t in qkv.split(qkv(hidden)))
        attn = ctx.attend(self.layer_idx, q, k, v, scale=self.head_dim**-0.5, causal=False)
        out = self.attention.output
        hidden = out.LayerNorm(out.dense(attn.reshape(n, -1)) + hidden)
        inter = self.act(self.intermediate.dense(hidden))
        return self.output.LayerNorm(self.output.dense(inter) + hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, i) for i in range(config.num_hidden_layers))


class BertModel(ModelBase):
    """BERT encoder; `forward` returns the last hidden states [T, hidden] (no pooler)."""

    stacked_params = (("qkv_proj", "query", "q"), ("qkv_proj", "key", "k"), ("qkv_proj", "value", "v"))
    ignored_substrings = ("embeddings.position_ids", "pooler.", "cls.")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        pos_type = config.raw.get("position_embedding_type", "absolute")
        if pos_type != "absolute":
            raise ValueError(f"BertModel: position_embedding_type {pos_type!r} is not supported (only 'absolute')")
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def map_name(self, name: str) -> str | None:
        name = name.removeprefix("bert.")
        # Old TF-converted checkpoints name LayerNorm parameters gamma/beta.
        return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Last hidden states [T, hidden] for flattened tokens; each sequence attends to itself only."""
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, ctx)
        return hidden


class BertForSequenceClassification(BertModel):
    """A BERT cross-encoder: the encoder, then the pooler (dense + tanh on the CLS token) and a linear
    classifier; `classify` maps CLS hidden states to the logits."""

    ignored_substrings = ("embeddings.position_ids", "cls.")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        h = config.hidden_size
        labels = config.raw.get("num_labels") or len(config.raw.get("id2label") or {}) or 2
        self.pooler = BertDense(h, h)
        self.classifier = Linear(h, int(labels), bias=True)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, num_labels] for the CLS hidden states [N, hidden]."""
        return self.classifier(torch.tanh(self.pooler.dense(cls_hidden)))
