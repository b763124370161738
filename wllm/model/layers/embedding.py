"""Token embedding and the output projection to logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wllm.model.layers.linear import Linear
from wllm.model.layers.linear_method import DenseLinearMethod, KernelChoice, KernelTarget, LinearMethod


class VocabEmbedding(KernelChoice, nn.Module):
    """Embedding table [num_embeddings, dim]; also the LM head weight when embeddings are tied, which is why
    it carries a linear method (the table is the head's [vocab, dim] weight)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, method: LinearMethod | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.method = DenseLinearMethod() if method is None else method
        self.method.create_weights(self, embedding_dim, num_embeddings, bias=False)

    def choose_kernels(self, target: KernelTarget | None) -> None:
        self.method.process_weights_after_loading(self, target)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def compute_logits(hidden: torch.Tensor, head: Linear | VocabEmbedding, softcap: float | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits [N, vocab] = hidden @ W^T of the LM head (a Linear, or the tied embedding), then
    c * tanh(logits / c) when softcap = c. With `out` (float32 [N, vocab]) they are written there (the cast
    to float32 writes it: no extra pass). Decode rows run on the skinny GEMM where the head's method says so:
    the vocabulary matrix is the largest single read of a decode step."""
    raw = head.method.apply_logits(head, hidden)
    logits = raw.float() if out is None else out.copy_(raw)  # a fresh fp32 tensor either way: capped in place
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits
