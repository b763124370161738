"""Token embedding and the output projection to logits."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from wllm.kernels import available as kernels_available
from wllm.kernels import gemv
from wllm.kernels.gemv import GEMV_MAX_IN_FEATURES

# Decode logits (1-2 rows) through the skinny-GEMM kernel instead of cuBLAS: the vocabulary matrix is the
# largest single read of a decode step (1 GB for Llama-3.1-8B). WLLM_LM_HEAD_GEMV=0 keeps cuBLAS (A/B
# runs). Measured on the H200 (RESULTS.md, session 4).
LM_HEAD_GEMV = os.environ.get("WLLM_LM_HEAD_GEMV", "1") != "0"
LM_HEAD_GEMV_MAX_ROWS = 2


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


def compute_logits(hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits [N, vocab] = hidden @ weight^T, then c * tanh(logits / c) when softcap = c. With
    `out` (float32 [N, vocab]) they are written there (the cast to float32 writes it: no extra pass)."""
    if (LM_HEAD_GEMV and hidden.is_cuda and hidden.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == hidden.dtype and 0 < hidden.numel() <= LM_HEAD_GEMV_MAX_ROWS * hidden.shape[-1]
            and weight.shape[1] <= GEMV_MAX_IN_FEATURES and kernels_available(hidden.device.index or 0)):
        raw = gemv(hidden, weight)
    else:
        raw = F.linear(hidden, weight)
    logits = raw.float() if out is None else out.copy_(raw)  # a fresh fp32 tensor either way: capped in place
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits
