"""Linear methods: how a linear layer stores its weight and which kernel multiplies by it.

Every `Linear` (and the token embedding, whose weight is the LM head when embeddings are tied) carries a
`LinearMethod`. The method creates the layer's parameters in its weight format (`create_weights`), and once
the weights are loaded on their device (`select_kernels`, called by the loader) it works out, once, which
kernel runs for how many rows (`process_weights_after_loading`), from the weights and the GPU's
`KernelTable`. The calls then only compare a row count with what was worked out: eager decode is bound by
the host, so nothing is looked up per call.

Today every weight is dense (fp16 / bf16 / fp32; GGUF tensors are dequantized at load) and
`DenseLinearMethod` is the only method: cuBLAS (F.linear) by default, the skinny GEMM (wllm.kernels.gemv)
for decode-sized batches, the residual add inside cuBLAS's epilogue for the layers whose output joins the
residual stream. The interface is the one that GGUF-packed weights (a dequantizing GEMV / GEMM),
LoRA-wrapped layers and tensor-parallel shards implement next. The `apply_*` calls other than `apply` may
return None ("no fused kernel for this many rows here"); the caller then takes the plain path.

Until `select_kernels` has run, a layer computes everything in PyTorch (the CPU behaviour).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from wllm.kernels import act_and_mul, gemv
from wllm.kernels import available as kernels_available
from wllm.kernels.gemv import GEMV_MAX_IN_FEATURES, gated_output_fits, gemv_rotary_cache
from wllm.model.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class KernelTable:
    """The thresholds of the kernel choice on one GPU architecture (rows are token rows of x).

    The values come from the H200 measurements of benchmarks/kernels_gemv.py and end-to-end A/B runs
    (benchmarks/RESULTS.md): below them the skinny GEMM's single pass over the weight beats cuBLAS, above
    them cuBLAS ties or wins.
    """

    name: str
    # The skinny GEMM's CUDA-core kernels: up to gemv_max_rows rows of a weight of at most
    # gemv_small_weight_bytes, and one row of a larger one (up to gemv_max_weight_bytes) when K is at least
    # gemv_wide_min_k, where the register-prefetch kernel still reads the weight faster than cuBLAS. Where
    # the two only tie (a small model's gate_up, a large one's), the skinny GEMM still wins the step: the
    # PDL kernel behind it may load its weights before its wait, which a cuBLAS predecessor does not allow.
    gemv_max_rows: int = 2
    gemv_small_weight_bytes: int = 18 << 20
    gemv_wide_min_k: int = 2048
    gemv_max_weight_bytes: int = 256 << 20
    # Its tensor-core kernel (mma.sync, SM 8.0+; K a multiple of 32): the rows above gemv_max_rows up to
    # gemv_mma_max_rows (batched decode) of weights up to gemv_mma_max_weight_bytes; larger weights lose to
    # cuBLAS there. 0 rows: the GPU has no such kernel.
    gemv_mma_max_rows: int = 16
    gemv_mma_max_weight_bytes: int = 10 << 20
    # Gated MLP, up to gemv_max_fused_rows rows: act(gate) * up inside the down projection's skinny GEMM (on
    # its input: no activation kernel; every CTA recomputes it for its copy of x, so more rows lose), or,
    # from an intermediate size of gated_gemv_min_intermediate, inside gate_up's (once, at its outputs),
    # where the long down rows make the per-CTA recomputation cost more than the gated output does.
    gemv_max_fused_rows: int = 2
    gated_gemv_min_intermediate: int = 8192
    # The LM head's decode rows on the skinny GEMM, whatever the vocabulary matrix's size: it is the largest
    # single read of a decode step.
    lm_head_gemv_max_rows: int = 2
    # The qkv projection, rotary embedding and KV-cache write as one kernel for up to
    # fused_qkv_rotary_max_rows rows (it takes two per pass over W) of a qkv weight up to
    # fused_qkv_rotary_max_bytes; behind larger ones the separate GEMV's prefetch hides more than the fused
    # kernel saves.
    fused_qkv_rotary_max_rows: int = 2
    fused_qkv_rotary_max_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        # The tensor-core rows extend the CUDA-core rows: a weight small enough for the first is small enough
        # for the second, so a layer's skinny-GEMM rows are always 1..N (one threshold per layer).
        if self.gemv_mma_max_weight_bytes > self.gemv_small_weight_bytes:
            raise ValueError(f"{self.name}: gemv_mma_max_weight_bytes must not exceed gemv_small_weight_bytes")


# Hopper, where the thresholds were measured.
SM90 = KernelTable("SM 9.0")
# Ampere / Ada and the GPUs after Hopper: the same rules (the tensor-core skinny GEMM runs on all of them).
SM80 = replace(SM90, name="SM 8.0+")
# Volta / Turing: no tensor-core skinny GEMM.
SM70 = replace(SM80, name="SM 7.x", gemv_mma_max_rows=0)


def table_for(capability: tuple[int, int]) -> KernelTable:
    """The kernel table of a GPU of this compute capability."""
    major = capability[0]
    if major == 9:
        return SM90
    return SM80 if major >= 8 else SM70


@dataclass(frozen=True)
class KernelTarget:
    """What a layer's kernels are chosen for: its GPU's table, and whether the wLLM kernel library runs there
    (without it only cuBLAS runs, and its residual epilogue)."""

    table: KernelTable
    kernels: bool


def kernel_target(device: torch.device) -> KernelTarget | None:
    """The target of weights on `device`; None off CUDA (PyTorch everywhere)."""
    if device.type != "cuda":
        return None
    index = device.index or 0
    return KernelTarget(table_for(torch.cuda.get_device_capability(index)), kernels_available(index))


class LinearMethod:
    """How one layer stores its weight and multiplies by it: the interface every weight format implements.

    `layer` is the module holding the parameters (a Linear, or the embedding serving as LM head); x holds
    rows of in_features elements (any leading dims).
    """

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        """Register the layer's parameters (`weight`, `bias`) in this method's layout, uninitialised."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module, target: KernelTarget | None) -> None:
        """Once the checkpoint is in the parameters on their device: repack what the kernels need, and decide
        which kernel runs for how many rows on `target` (None: off CUDA)."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """x W^T (+ b). Given `residual` (rows of out_features), the method may add the product into it
        instead (residual += x W^T, rounded once) and return None; otherwise it returns the product and the
        caller adds."""
        raise NotImplementedError

    def apply_gated(self, layer: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """For a [gate | up] weight: act(x gate^T) * (x up^T) ([..., out_features / 2]) with the activation
        inside the projection's kernel, or None when no such kernel takes this many rows."""
        raise NotImplementedError

    def apply_activated(self, layer: nn.Module, x: torch.Tensor, activation: str,
                        residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """`apply` of act(x[..., :K]) * x[..., K:] (x holds [gate | up] rows of 2 * in_features): the gated
        MLP's down projection. None when it went into `residual`, as for `apply`."""
        raise NotImplementedError

    def apply_qkv_rotary(self, layer: nn.Module, x: torch.Tensor, positions: torch.Tensor,
                         slot_mapping: torch.Tensor, rotary: RotaryEmbedding, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, num_heads: int) -> torch.Tensor | None:
        """For a [q | k | v] heads weight: the projection, the rotation and the KV-cache write in one kernel
        (see wllm.kernels.gemv.gemv_rotary_cache); returns q [T, num_heads, D], or None when no such kernel
        takes this many rows (the caller projects and attends as usual)."""
        raise NotImplementedError

    def apply_logits(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x W^T in the weight's dtype, for the LM head (the caller casts to float32)."""
        raise NotImplementedError


@dataclass(frozen=True)
class DensePlan:
    """For how many rows each kernel of a dense layer runs (0: never), worked out at load."""

    gemv_rows: int = 0  # apply: the skinny GEMM for 1..gemv_rows rows, cuBLAS above
    gated_rows: int = 0  # apply_gated: the skinny GEMM's gated output
    activated_rows: int = 0  # apply_activated: the skinny GEMM with the activation on its input
    qkv_rotary_rows: int = 0  # apply_qkv_rotary: gemv_rotary_cache
    logits_rows: int = 0  # apply_logits: the skinny GEMM
    adds_residual: bool = False  # apply: residual += x W^T in cuBLAS's epilogue (beta = 1)


def dense_plan(weight: torch.Tensor, has_bias: bool, target: KernelTarget | None) -> DensePlan:
    """The plan of a dense [out_features, in_features] weight on `target`."""
    if target is None:
        return DensePlan()
    # cuBLAS adds into the residual whenever it runs a bias-free layer; the residual then leaves the RMSNorm
    # after it one tensor to read and one to write instead of the fused add-and-norm's two and two.
    adds_residual = not has_bias
    out_features, in_features = weight.shape
    t = target.table
    if not (target.kernels and weight.dtype in (torch.float16, torch.bfloat16)
            and 0 < in_features <= GEMV_MAX_IN_FEATURES):
        return DensePlan(adds_residual=adds_residual)
    nbytes = weight.numel() * weight.element_size()
    if nbytes <= t.gemv_small_weight_bytes:
        skinny = t.gemv_max_rows
    elif in_features >= t.gemv_wide_min_k and nbytes <= t.gemv_max_weight_bytes:
        skinny = min(1, t.gemv_max_rows)
    else:
        skinny = 0
    mma = (t.gemv_mma_max_rows > t.gemv_max_rows and in_features % 32 == 0 and weight.stride(0) % 8 == 0
           and nbytes <= t.gemv_mma_max_weight_bytes)
    gemv_rows = t.gemv_mma_max_rows if mma else skinny
    fits = gated_output_fits(weight)
    gated = fits and out_features % 2 == 0 and out_features // 2 >= t.gated_gemv_min_intermediate
    return DensePlan(
        gemv_rows=gemv_rows,
        gated_rows=min(t.gemv_max_fused_rows, gemv_rows) if gated else 0,
        activated_rows=min(t.gemv_max_fused_rows, skinny),
        qkv_rotary_rows=(min(t.fused_qkv_rotary_max_rows, gemv_rows)
                         if fits and nbytes <= t.fused_qkv_rotary_max_bytes else 0),
        logits_rows=t.lm_head_gemv_max_rows,
        adds_residual=adds_residual,
    )


class DenseLinearMethod(LinearMethod):
    """A dense weight [out_features, in_features] as nn.Linear stores it (and an optional bias)."""

    def __init__(self) -> None:
        self._use_plan(DensePlan(), 1, 1)

    def use_plan(self, layer: nn.Module, plan: DensePlan) -> None:
        """Run `layer` by `plan` from now on (process_weights_after_loading's, or a test's)."""
        self._use_plan(plan, layer.weight.shape[1], layer.weight.shape[0])

    def _use_plan(self, plan: DensePlan, in_features: int, out_features: int) -> None:
        self.plan = plan
        self._out_features = out_features
        # The plan's row counts as element counts of x, so that a call compares x.numel() once.
        self._gemv_numel = plan.gemv_rows * in_features
        self._gated_numel = plan.gated_rows * in_features
        self._activated_numel = plan.activated_rows * 2 * in_features
        self._qkv_rotary_numel = plan.qkv_rotary_rows * in_features
        self._logits_numel = plan.logits_rows * in_features

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def process_weights_after_loading(self, layer: nn.Module, target: KernelTarget | None) -> None:
        self.use_plan(layer, dense_plan(layer.weight, layer.bias is not None, target))

    def apply(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        if 0 < x.numel() <= self._gemv_numel:
            return gemv(x, layer.weight, layer.bias)
        if (residual is not None and self.plan.adds_residual and x.dim() == 2 and residual.dim() == 2
                and residual.shape == (x.shape[0], self._out_features) and residual.dtype == x.dtype
                and layer.weight.dtype == x.dtype):
            residual.addmm_(x, layer.weight.t())
            return None
        return F.linear(x, layer.weight, layer.bias)

    def apply_gated(self, layer: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        if 0 < x.numel() <= self._gated_numel:
            return gemv(x, layer.weight, layer.bias, output_activation=activation)
        return None

    def apply_activated(self, layer: nn.Module, x: torch.Tensor, activation: str,
                        residual: torch.Tensor | None = None) -> torch.Tensor | None:
        if 0 < x.numel() <= self._activated_numel:
            return gemv(x, layer.weight, layer.bias, activation)
        return self.apply(layer, act_and_mul(x, activation), residual)

    def apply_qkv_rotary(self, layer: nn.Module, x: torch.Tensor, positions: torch.Tensor,
                         slot_mapping: torch.Tensor, rotary: RotaryEmbedding, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, num_heads: int) -> torch.Tensor | None:
        if not 0 < x.numel() <= self._qkv_rotary_numel:
            return None
        return gemv_rotary_cache(x, layer.weight, layer.bias, positions, slot_mapping, rotary.cos_sin_cache(x.device),
                                 key_cache, value_cache, num_heads, rotary.is_neox)

    def apply_logits(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if 0 < x.numel() <= self._logits_numel:
            return gemv(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)


class KernelChoice:
    """A module whose kernels are chosen once its weights are loaded on their device (see select_kernels)."""

    def choose_kernels(self, target: KernelTarget | None) -> None:
        raise NotImplementedError


@dataclass
class _Targets:
    """The target of each device, asked once per device."""

    of: Callable[[torch.device], KernelTarget | None]
    known: dict[torch.device, KernelTarget | None] = field(default_factory=dict)

    def __call__(self, device: torch.device) -> KernelTarget | None:
        if device not in self.known:
            self.known[device] = self.of(device)
        return self.known[device]


def select_kernels(model: nn.Module,
                   targets: Callable[[torch.device], KernelTarget | None] = kernel_target) -> None:
    """Choose the kernels of every layer of `model` (or of one layer) for the device its weights are on.
    The loader calls it once the weights are loaded; call it again after moving or replacing weights.
    `targets` maps a device to its target (tests pass a stand-in GPU for CPU weights)."""
    target_of = _Targets(targets)
    for module in model.modules():
        if isinstance(module, KernelChoice):
            param = next(module.parameters(), None)
            module.choose_kernels(None if param is None else target_of(param.device))
