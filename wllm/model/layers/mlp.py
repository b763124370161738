"""Activations and the gated (SwiGLU / GeGLU) MLP."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from wllm.model.layers.linear import Linear, MergedLinear
from wllm.model.layers.linear_method import KernelChoice, KernelTarget

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# HF activation names the fused act-and-mul kernel computes (the others stay in PyTorch).
_FUSED: dict[str, str] = {"silu": "silu", "swish": "silu", "gelu_new": "gelu_tanh",
                          "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function for an HF `hidden_act` name."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}") from None


class GatedMLP(KernelChoice, nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul (`gate_up_proj`).

    Where the kernel library runs, act(gate) * up is one fused kernel over the [gate | up] output; for
    decode-sized batches it is fused further, into the gate_up projection's kernel (which writes
    act(gate) * up) or else the down projection's (which applies it to its input): no activation kernel at
    all. The two layers' linear methods say for how many rows. Elsewhere (the CPU) it stays in PyTorch.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, (intermediate_size, intermediate_size), ("gate", "up"), bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)
        self.act = get_activation(act)
        self.fused_act = _FUSED.get(act)
        # The activation the kernels compute, once select_kernels found them on the weights' device.
        self.kernel_act: str | None = None

    def choose_kernels(self, target: KernelTarget | None) -> None:
        self.kernel_act = self.fused_act if target is not None and target.kernels else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """The MLP's output; None when it went straight into `residual` (given, and the down projection
        on cuBLAS: see Linear.forward)."""
        act = self.kernel_act
        gate_up_proj, down_proj = self.gate_up_proj, self.down_proj
        if act is None:
            gate, up = gate_up_proj.split(gate_up_proj(x))
            return down_proj(self.act(gate) * up)
        gated = gate_up_proj.method.apply_gated(gate_up_proj, x, act)
        if gated is not None:
            return down_proj(gated)
        return down_proj.method.apply_activated(down_proj, gate_up_proj(x), act, residual)
