"""Activations and the gated (SwiGLU / GeGLU) MLP."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from wllm.kernels import act_and_mul, gemm_sm90, gemv
from wllm.kernels import available as kernels_available
from wllm.kernels.gemv import gated_output_fits
from wllm.model.layers.linear import Linear, MergedLinear

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# Up to this many rows, the activation runs inside the down projection's skinny GEMM (no separate
# act_and_mul kernel). Each CTA of that kernel recomputes the activation for its own copy of x, a
# cost that grows with the rows; above this the separate kernel is cheaper. Measured on the H200
# (benchmarks/kernels_gemv.py, "down+act" rows): Qwen2.5-0.5B's down 6.7 vs 9.7 us (act + cuBLAS)
# at 1 row, 8.3 vs 9.8 at 2, a loss at 4. The weight-size bound of Linear.use_gemv applies too.
GEMV_MAX_FUSED_ROWS = 2

# Up to GEMV_MAX_FUSED_ROWS rows and for intermediate sizes of at least GATED_GEMV_MIN_INTERMEDIATE, the
# activation is applied by the gate_up projection's skinny GEMM at its outputs (it reads [gate | up] rows of
# W together and writes act(gate) * up once) rather than by every CTA of the down projection for its copy
# of x. H200, behind the kernel that writes x (benchmarks/kernels_gemv.py, RESULTS.md session 4): Llama's
# down (K = 14336) 32.4 us with SiLU on x vs 28.5 plain, for 1.8 us more in gate_up; Qwen's (K = 4864)
# 4.3 us vs 4.7, so small MLPs keep the activation in the down projection. WLLM_GATED_GEMV=0 turns it off
# (A/B runs).
GATED_GEMV = os.environ.get("WLLM_GATED_GEMV", "1") != "0"
GATED_GEMV_MIN_INTERMEDIATE = 8192

# HF activation names the fused act-and-mul kernel computes (the others stay in PyTorch).
_FUSED: dict[str, str] = {"silu": "silu", "swish": "silu", "gelu_new": "gelu_tanh",
                          "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function for an HF `hidden_act` name."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}") from None


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul (`gate_up_proj`).

    On CUDA (kernel library present) act(gate) * up is one fused kernel over the [gate | up]
    output; for decode-sized batches it is fused further, into the gate_up projection's skinny GEMM
    (which writes act(gate) * up) or else the down projection's (which applies it to its input): no
    activation kernel at all. On the CPU it stays in PyTorch, unchanged.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, (intermediate_size, intermediate_size), ("gate", "up"), bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)
        self.act = get_activation(act)
        self.fused_act = _FUSED.get(act)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """The MLP's output; None when it went straight into `residual` (given, and the down projection
        on cuBLAS: see Linear.forward)."""
        if self.fused_act is not None and x.is_cuda and kernels_available(x.device.index or 0):
            gate_up_proj = self.gate_up_proj
            if gate_up_proj.use_sm90(x):
                # The Hopper GEMM's epilogue gates its fp32 accumulators: no [rows, 2 I] intermediate and
                # no activation kernel (linear.SM90_GEMM_ROWS says for which batches).
                return self.down_proj(gemm_sm90(x, gate_up_proj.weight, self.fused_act))
            if (GATED_GEMV and self.down_proj.in_features >= GATED_GEMV_MIN_INTERMEDIATE
                    and x.numel() <= GEMV_MAX_FUSED_ROWS * x.shape[-1] and gate_up_proj.use_gemv(x)
                    and gated_output_fits(gate_up_proj.weight)):
                return self.down_proj(gemv(x, gate_up_proj.weight, gate_up_proj.bias,
                                           output_activation=self.fused_act))
        gate_up = self.gate_up_proj(x)
        if self.fused_act is not None and gate_up.is_cuda and kernels_available(gate_up.device.index or 0):
            down = self.down_proj
            few_rows = gate_up.numel() <= GEMV_MAX_FUSED_ROWS * gate_up.shape[-1]
            if few_rows and down.use_gemv(gate_up, 2 * down.in_features):
                return gemv(gate_up, down.weight, down.bias, self.fused_act)
            return down(act_and_mul(gate_up, self.fused_act), residual)
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(self.act(gate) * up)
