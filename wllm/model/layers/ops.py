"""The fused ops model layers call, taken from `wllm.kernels`.

`wllm.kernels` dispatches to the CUDA library on the GPU and to a PyTorch reference on the
CPU. Until that package provides them this module falls back to equivalent PyTorch code so
the models stay runnable; the fallback follows the same contracts exactly.
"""

from __future__ import annotations

import torch

try:  # pragma: no cover - which branch runs depends on the kernels package
    from wllm.kernels import fused_add_rms_norm, rms_norm, rotary_embedding
except ImportError:  # pragma: no cover

    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
    ) -> torch.Tensor:
        """x / rms(x) * (weight + weight_offset), in fp32, cast back to x.dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * (weight.float() + weight_offset)).to(x.dtype)

    def fused_add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
    ) -> None:
        """In place: residual += x; x = rms_norm(residual)."""
        residual.add_(x)
        x.copy_(rms_norm(residual, weight, eps, weight_offset))

    def rotary_embedding(
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        head_size: int,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
    ) -> None:
        """Rotate the first rot_dim dims of every q/k head in place."""
        rot = cos_sin_cache.shape[1]
        cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rot/2] each
        for t in (q, k):
            x = t.view(t.shape[0], -1, head_size)
            r = x[..., :rot].float()
            c, s = cos[:, None, :], sin[:, None, :]
            if is_neox:
                x1, x2 = r[..., : rot // 2], r[..., rot // 2 :]
                out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
            else:
                x1, x2 = r[..., 0::2], r[..., 1::2]
                out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
            x[..., :rot] = out.to(t.dtype)


__all__ = ["fused_add_rms_norm", "rms_norm", "rotary_embedding"]
