"""Token embedding and the output projection to logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """Embedding table [num_embeddings, dim]; also the LM head weight when embeddings are tied."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def compute_logits(hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """float32 logits [N, vocab] = hidden @ weight^T, then c * tanh(logits / c) when softcap = c."""
    logits = F.linear(hidden, weight).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits
