"""RMSNorm (through wllm.kernels) and LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wllm.kernels import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add.

    `weight_offset` = 1.0 gives Gemma's (1 + w) scaling without rewriting the checkpoint.
    Called with a residual, it adds in place (residual += x) and normalises into x, returning
    (x, residual): one pass over memory instead of three.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps
        self.weight_offset = weight_offset

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.weight_offset)
        fused_add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset)
        return x, residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, weight_offset={self.weight_offset}"


class LayerNorm(nn.Module):
    """Plain LayerNorm with weight and bias (BERT); computed in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps)
        return out.to(x.dtype)
