"""Skinny GEMM for decode: y = x @ W^T (+ b) for a few rows of x, fp16/bf16, one pass over W.

At decode every linear layer multiplies a handful of token rows by a weight matrix that is read
once per step, so the step is bound by weight bandwidth; cuBLAS reaches 65-80% of it on the
medium matrices (and splits K into a second reduce kernel), this kernel aims at >= 90%. With an
activation ("silu" / "gelu_tanh") x holds [gate | up] rows and the kernel applies act(gate) * up
on the fly, so a gated MLP's down projection needs no separate activation kernel; with an
output_activation the weight holds [gate | up] rows and the kernel writes act(gate) * up, so the
gate_up projection does the activation once, at its outputs, and the down projection reads a plain x.

The CUDA library runs it on GPU tensors; elsewhere `reference.gemv` computes the same thing. The
op is also a `torch.library.custom_op` (`wllm::gemv`) for torch.compile; eager CUDA calls take the
raw ctypes binding (the dispatcher costs host time on every call).
"""

from __future__ import annotations

import torch

from wllm.kernels import _lib, reference
from wllm.kernels.ops import _is_compiling, _stream, act_and_mul, rotary_and_cache

_DTYPES = {torch.float16: 1, torch.bfloat16: 2}
# Prologue codes of wllm_gemv: 0 = none, 1 = SiLU-and-mul, 2 = tanh-GELU-and-mul.
PROLOGUES = {None: 0, "silu": 1, "gelu_tanh": 2}
# Kernel choice (bits 8..15 of wllm_gemv's prologue argument), for benchmarks and tests: "auto" picks the
# register-prefetch kernel (each lane loads its first 16 chunks of W into registers before the PDL wait)
# for 1-2 rows with 16-byte aligned weight rows, the tensor-core kernel (mma.sync, SM 8.0+) for 3-16 rows
# of a plain x with aligned rows and K a multiple of 32, the row-group kernel (a group of 8/16/32 lanes per
# output row, no barriers) for other 3-4 aligned rows and the split-K kernel otherwise; a forced variant
# that does not apply falls back (reg_prefetch with 3-4 rows to the row-group kernel, mma to auto).
VARIANTS = {"auto": 0, "split_k": 1, "row_group": 2, "row_group_32": 3, "row_group_16": 4, "row_group_8": 5,
            "reg_prefetch": 6, "mma": 7}
# Longest row of x (after the activation) any GPU holds in shared memory: 48 KiB of fp16/bf16.
GEMV_MAX_IN_FEATURES = 24576


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
           output_activation: str | None = None) -> int:
    """Validate shapes, dtypes and devices; returns the width of x's rows (in_features, doubled with an
    activation). Raises ValueError saying what is wrong."""
    if activation not in PROLOGUES:
        raise ValueError(f"gemv: unknown activation {activation!r}; supported: None, 'silu', 'gelu_tanh'")
    if output_activation not in PROLOGUES:
        raise ValueError(f"gemv: unknown output_activation {output_activation!r}; supported: None, 'silu', "
                         "'gelu_tanh'")
    if activation is not None and output_activation is not None:
        raise ValueError("gemv: an activation on x or on the output, not both")
    if weight.dim() != 2:
        raise ValueError(f"gemv: weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if x.dim() < 1:
        raise ValueError("gemv: x must have at least one dimension (its last is in_features)")
    out_features, in_features = weight.shape
    if out_features == 0 or in_features == 0:
        raise ValueError(f"gemv: empty weight of shape {tuple(weight.shape)}")
    if output_activation is not None and out_features % 2:
        raise ValueError(f"gemv: a gated output needs [gate | up] weight rows, an even count; got {out_features}")
    width = in_features * (1 if activation is None else 2)
    if x.shape[-1] != width:
        layout = "in_features" if activation is None else f"2 * in_features ([gate | up] for {activation})"
        raise ValueError(f"gemv: x's last dimension is {x.shape[-1]}, expected {layout} = {width} for a weight "
                         f"of shape {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"gemv: bias must have shape ({out_features},), got {tuple(bias.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"gemv: dtype {x.dtype} unsupported (float16 or bfloat16 only; use F.linear otherwise)")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"gemv: {name} is {t.dtype} on {t.device} but x is {x.dtype} on {x.device}; they must "
                             "match")
    return width


def gated_output_fits(weight: torch.Tensor) -> bool:
    """True when the kernel can write a gated output for this weight in one pass: rows of a multiple of
    8 elements, 16-byte aligned (otherwise gemv computes the product, then act_and_mul)."""
    return (weight.shape[1] % 8 == 0 and weight.stride(1) == 1 and weight.stride(0) % 8 == 0
            and weight.data_ptr() % 16 == 0)


def _cuda_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str | None, variant: int = 0, output_activation: str | None = None) -> torch.Tensor:
    width = _check(x, weight, bias, activation, output_activation)
    if output_activation is not None and not gated_output_fits(weight):
        return act_and_mul(_cuda_gemv(x, weight, bias, None, variant), output_activation)
    out_features, in_features = weight.shape
    out_width = out_features if output_activation is None else out_features // 2
    out = torch.empty(*x.shape[:-1], out_width, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    # A view when the leading dims collapse to one row stride (strided rows stay strided), else a copy.
    x2 = x.reshape(-1, width)
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    # One row: its stride is meaningless (may be 1); the row length keeps 16-byte loads possible.
    x_stride = x2.stride(0) if x2.shape[0] > 1 else width
    flags = PROLOGUES[activation] | (variant << 8) | (PROLOGUES[output_activation] << 16)
    lib = _lib.binding(x.device.index or 0)
    lib.check(lib.wllm_gemv(out.data_ptr(), x2.data_ptr(), weight.data_ptr(),
                            bias.data_ptr() if bias is not None else None, x2.shape[0], out_features, in_features,
                            out_width, x_stride, weight.stride(0), flags, _DTYPES[x.dtype], _stream(x)),
              "gemv")
    return out


@torch.library.custom_op("wllm::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
            output_activation: str | None = None) -> torch.Tensor:
    if x.is_cuda:
        return _cuda_gemv(x, weight, bias, activation, 0, output_activation)
    _check(x, weight, bias, activation, output_activation)
    return reference.gemv(x, weight, bias, activation, output_activation)


@gemv_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
      output_activation: str | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0] // (1 if output_activation is None else 2))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         activation: str | None = None, output_activation: str | None = None) -> torch.Tensor:
    """y[..., n] = sum_k in[..., k] * weight[n, k] (+ bias[n]), fp32 accumulation, rounded to x's dtype.

    in = x, or act(x[..., :K]) * x[..., K:] rounded to the dtype when `activation` is "silu" or
    "gelu_tanh" (x then has 2 * in_features columns). With `output_activation` ("silu" / "gelu_tanh")
    weight holds [gate | up] rows and the result is act(y[..., :N/2]) * y[..., N/2:] rounded to the dtype
    ([..., out_features / 2]; y rounded first, as act_and_mul over the plain product). fp16/bf16 only;
    meant for a few rows (decode); any number works, in passes of 16 rows over W (2 with a gated output).
    Raises ValueError on bad shapes or dtypes.
    """
    if not x.is_cuda:
        _check(x, weight, bias, activation, output_activation)
        return reference.gemv(x, weight, bias, activation, output_activation)
    if _is_compiling():
        return gemv_op(x, weight, bias, activation, output_activation)
    return _cuda_gemv(x, weight, bias, activation, 0, output_activation)


def gemv_variant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str | None = None, variant: str = "auto",
                 output_activation: str | None = None) -> torch.Tensor:
    """`gemv` with the CUDA kernel forced to one of VARIANTS (benchmarks and tests compare them; a gated
    output always runs the row-group kernel, with the lanes a row_group_* variant names); on the CPU it
    is `gemv`. Raises ValueError for an unknown variant."""
    if variant not in VARIANTS:
        raise ValueError(f"gemv: unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    if not x.is_cuda:
        return gemv(x, weight, bias, activation, output_activation)
    return _cuda_gemv(x, weight, bias, activation, VARIANTS[variant], output_activation)


def gemv_rotary_cache(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, cos_sin_cache: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, num_heads: int, is_neox: bool) -> torch.Tensor:
    """The qkv projection of decode rows with the rotary embedding and the KV-cache write fused in.

    x [T, K]; weight [(num_heads + 2 * Hkv) * D, K] (q, k, v heads; bias likewise); caches
    [num_blocks, block_size, Hkv, D]; positions and slot_mapping int64 [T] (slot -1 is skipped);
    cos_sin_cache fp32 [max_position, rot_dim]. Returns q [T, num_heads, D], rotated; k (rotated) and v
    go into the caches at the slots. The same values as gemv, split, then rotary_and_cache (the product
    rounded to the dtype first). One kernel on CUDA for fp16/bf16 with 16-byte aligned weight rows (a few
    rows: decode); otherwise those kernels in turn (the references off CUDA). Raises ValueError on bad
    shapes or dtypes.
    """
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("gemv_rotary_cache: caches must both be [num_blocks, block_size, Hkv, D] with the same "
                         "strides")
    _, _, num_kv_heads, head_size = key_cache.shape
    rows = (num_heads + 2 * num_kv_heads) * head_size
    if weight.dim() != 2 or weight.shape[0] != rows:
        raise ValueError(f"gemv_rotary_cache: weight must have {rows} rows ({num_heads} + 2 * {num_kv_heads} heads "
                         f"of {head_size}), got shape {tuple(weight.shape)}")
    _check(x, weight, bias, None)
    if x.dim() != 2:
        raise ValueError(f"gemv_rotary_cache: x must be [T, in_features], got shape {tuple(x.shape)}")
    num_tokens = x.shape[0]
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,) or \
            positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise ValueError(f"gemv_rotary_cache: positions and slot_mapping must be int64 [{num_tokens}]")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] > head_size or \
            cos_sin_cache.shape[1] % 2:
        raise ValueError(f"gemv_rotary_cache: cos_sin_cache must be float32 [max_position, even rot_dim <= "
                         f"{head_size}]")
    if key_cache.dtype != x.dtype or key_cache.device != x.device or key_cache.stride(-1) != 1:
        raise ValueError("gemv_rotary_cache: the caches must be contiguous in their head dims, of x's dtype and "
                         "device")
    if not x.is_cuda or not gated_output_fits(weight):
        # The two ops it fuses (each picks the kernel or the reference by device).
        qkv = gemv(x, weight, bias)
        q, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
        q = q.reshape(num_tokens, num_heads, head_size).contiguous()
        rotary_and_cache(positions, q, k, v, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox)
        return q
    q = torch.empty(num_tokens, num_heads, head_size, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return q
    if x.stride(-1) != 1:
        x = x.contiguous()
    table = cos_sin_cache.contiguous()
    lib = _lib.binding(x.device.index or 0)
    lib.check(lib.wllm_gemv_rotary_cache(
        q.data_ptr(), x.data_ptr(), weight.data_ptr(), bias.contiguous().data_ptr() if bias is not None else None,
        num_tokens, weight.shape[1], num_heads * head_size, x.stride(0) if num_tokens > 1 else weight.shape[1],
        weight.stride(0), positions.contiguous().data_ptr(), slot_mapping.contiguous().data_ptr(), table.data_ptr(),
        table.shape[0], table.shape[1], key_cache.data_ptr(), value_cache.data_ptr(), key_cache.shape[0],
        key_cache.shape[1], num_heads, num_kv_heads, head_size, key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), int(is_neox), _DTYPES[x.dtype], _stream(x)), "gemv_rotary_cache")
    return q
