"""Pure-PyTorch references for every kernel: the CPU path and the oracle in tests.

Each computes in float32 and rounds once to the input dtype, exactly as the CUDA kernel does.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv * (weight.float() + weight_offset)).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       weight_offset: float = 0.0) -> None:
    # The sum is rounded to the dtype before the norm, as an unfused `x + residual` would be.
    residual.copy_((x.float() + residual.float()).to(residual.dtype))
    x.copy_(rms_norm(residual, weight, eps, weight_offset))


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """In place on q [T, H*D] or [T, H, D] (and k); only the first rot_dim dims of a head rotate."""
    rot_dim = cos_sin_cache.shape[-1]
    half = rot_dim // 2
    cs = cos_sin_cache.index_select(0, positions.clamp(0, cos_sin_cache.shape[0] - 1)).float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for t in (q, k):
        if t is None:
            continue
        view = t.view(t.shape[0], -1, head_size)
        rot = view[..., :rot_dim].float()
        if is_neox:
            x1, x2 = rot[..., :half], rot[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        view[..., :rot_dim] = out.to(t.dtype)


def rotary_cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0,
                         inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [max_position, rot_dim] table: cos of each frequency in the first half, sin in the second.

    Computed in float32 the way HF transformers does, so positions map to bit-identical angles.
    """
    if inv_freq is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq.float())
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
