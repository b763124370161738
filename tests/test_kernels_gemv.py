"""Skinny GEMM for decode (wllm.kernels.gemv) and its use by Linear / GatedMLP.

CPU (CI): the PyTorch reference against float64 math, argument errors. CUDA (-m cuda): the kernel
against the reference on odd sizes, both dtypes, with and without bias and fused activations,
strided and misaligned inputs, inside a CUDA graph, and the layers' skinny path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from model_utils import cuda_gated_mlp

from wllm import kernels
from wllm.engine.cuda_graphs import capture_graph
from wllm.kernels import reference
from wllm.kernels.gemv import VARIANTS, gemv_variant
from wllm.model.layers import linear_method
from wllm.model.layers.embedding import VocabEmbedding, compute_logits
from wllm.model.layers.linear import Linear
from wllm.model.layers.linear_method import SM90, select_kernels

GEMV_MAX_ROWS = SM90.gemv_max_rows
GEMV_MAX_FUSED_ROWS = SM90.gemv_max_fused_rows
GATED_GEMV_MIN_INTERMEDIATE = SM90.gated_gemv_min_intermediate
LM_HEAD_GEMV_MAX_ROWS = SM90.lm_head_gemv_max_rows

DTYPES = [torch.float16, torch.bfloat16]
ACTIVATIONS = [None, "silu", "gelu_tanh"]
TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def make(m: int, n: int, k: int, dtype: torch.dtype, activation: str | None, bias: bool, device: str = "cpu",
         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random x [m, k] (or [m, 2k] of [gate | up]), weight [n, k] scaled so outputs are O(1), bias [n]."""
    gen = torch.Generator().manual_seed(seed)
    width = k if activation is None else 2 * k
    x = torch.randn(m, width, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x.to(device), w.to(device), b.to(device) if b is not None else None


def gemv64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    """From first principles in float64: the activation (rounded to the dtype, as the unfused path
    stores it), then one dot product per output element."""
    xd = x.double()
    if activation is not None:
        k = w.shape[1]
        gate, up = xd[:, :k], xd[:, k:]
        if activation == "silu":
            act = gate / (1 + torch.exp(-gate))
        else:
            act = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)))
        xd = (act * up).to(x.dtype).double()
    out = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for r in range(x.shape[0]):
        out[r] = (w.double() * xd[r]).sum(dim=1)
    if b is not None:
        out += b.double()
    return out


# ------------------------------------------------------------------------------------------
# Reference and errors (CPU)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("m,n,k", [(1, 7, 72), (3, 1, 200), (8, 33, 13), (16, 65, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_vs_float64(dtype, activation, m, n, k, bias) -> None:
    x, w, b = make(m, n, k, dtype, activation, bias)
    out = kernels.gemv(x, w, b, activation)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.double(), gemv64(x, w, b, activation), rtol=TOL[dtype][0], atol=TOL[dtype][1])


def gated64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, activation: str) -> torch.Tensor:
    """The gated output from first principles: the product rounded to the dtype (as a GEMM stores it), then
    act(gate) * up in float64."""
    y = gemv64(x, w, b, None).to(x.dtype).double()
    gate, up = y.chunk(2, dim=-1)
    if activation == "silu":
        act = gate / (1 + torch.exp(-gate))
    else:
        act = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)))
    return act * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m,n,k", [(1, 14, 72), (3, 2, 200), (8, 66, 13)])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_gated_output_vs_float64(dtype, activation, m, n, k, bias) -> None:
    """output_activation: weight rows [gate | up], result act(gate) * up with half the columns."""
    x, w, b = make(m, n, k, dtype, None, bias)
    out = kernels.gemv(x, w, b, output_activation=activation)
    assert out.dtype == dtype and out.shape == (m, n // 2)
    torch.testing.assert_close(out.double(), gated64(x, w, b, activation), rtol=TOL[dtype][0], atol=TOL[dtype][1])


def test_reference_keeps_leading_dims_and_strided_rows() -> None:
    x, w, b = make(6, 9, 40, torch.bfloat16, None, True)
    wide = torch.zeros(6, 100, dtype=torch.bfloat16)
    wide[:, 7:47] = x
    strided = wide[:, 7:47]
    assert not strided.is_contiguous()
    torch.testing.assert_close(kernels.gemv(strided, w, b), kernels.gemv(x, w, b), rtol=0, atol=0)
    out3 = kernels.gemv(x.view(2, 3, 40), w, b)
    assert out3.shape == (2, 3, 9)
    torch.testing.assert_close(out3.view(6, 9), kernels.gemv(x, w, b), rtol=0, atol=0)


@pytest.mark.parametrize("case,match", [
    ("x_width", "last dimension is 11, expected in_features = 12"),
    ("act_width", r"expected 2 \* in_features"),
    ("weight_1d", "weight must be 2-D"),
    ("bias_shape", r"bias must have shape \(5,\)"),
    ("float32", "float32 unsupported"),
    ("int", "int32 unsupported"),
    ("mixed", "weight is torch.float16 on cpu but x is torch.bfloat16"),
    ("activation", "unknown activation 'relu'"),
    ("output_activation", "unknown output_activation 'relu'"),
    ("both_activations", "on x or on the output, not both"),
    ("odd_gated_rows", "an even count; got 5"),
])
def test_errors(case: str, match: str) -> None:
    x = torch.randn(2, 12, dtype=torch.bfloat16)
    w = torch.randn(5, 12, dtype=torch.bfloat16)
    b, activation, output_activation = None, None, None
    if case == "x_width":
        x = x[:, :11]
    elif case == "act_width":
        activation = "silu"
    elif case == "weight_1d":
        w = w[0]
    elif case == "bias_shape":
        b = torch.zeros(4, dtype=torch.bfloat16)
    elif case == "float32":
        x, w = x.float(), w.float()
    elif case == "int":
        x, w = x.int(), w.int()
    elif case == "mixed":
        w = w.half()
    elif case == "activation":
        activation = "relu"
    elif case == "output_activation":
        output_activation = "relu"
    elif case == "both_activations":
        x, activation, output_activation = torch.cat([x, x], dim=1), "silu", "silu"
    elif case == "odd_gated_rows":
        output_activation = "silu"
    with pytest.raises(ValueError, match=match):
        kernels.gemv(x, w, b, activation, output_activation)


def test_variant_names() -> None:
    """A forced kernel variant is checked by name; on the CPU every variant is the reference."""
    x, w, b = make(2, 9, 40, torch.bfloat16, None, True)
    with pytest.raises(ValueError, match="unknown variant 'row_group_4'"):
        gemv_variant(x, w, b, None, "row_group_4")
    for variant in VARIANTS:
        torch.testing.assert_close(gemv_variant(x, w, b, None, variant), reference.gemv(x, w, b), rtol=0, atol=0)


def test_linear_stays_on_pytorch_on_cpu() -> None:
    """The skinny path is CUDA-only: a CPU Linear is exactly F.linear."""
    layer = Linear(16, 5, bias=True).to(torch.bfloat16)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    select_kernels(layer)
    x = torch.randn(1, 16, dtype=torch.bfloat16)
    assert layer.method.plan.gemv_rows == 0
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


# ------------------------------------------------------------------------------------------
# CUDA kernel
# ------------------------------------------------------------------------------------------

CUDA_K = [72, 200, 896, 1000, 4864, 14336]
CUDA_N = [1, 7, 1153]
CUDA_M = [1, 2, 3, 4, 5, 8, 16]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", CUDA_K)
@pytest.mark.parametrize("n", CUDA_N)
@pytest.mark.parametrize("m", CUDA_M)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gemv_matches_reference(dtype, k, n, m, activation) -> None:
    bias = (m + n) % 2 == 0  # half the cases with bias, spread over every size
    x, w, b = make(m, n, k, dtype, activation, bias, device="cuda", seed=m * 1000 + n + k)
    out = kernels.gemv(x, w, b, activation)
    want = reference.gemv(x, w, b, activation)
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out, want, rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("variant", ["split_k", "row_group_32", "row_group_16", "row_group_8", "reg_prefetch", "mma"])
@pytest.mark.parametrize("k", [72, 200, 896, 4096, 4864, 14336])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_each_variant(dtype, activation, variant, k, m) -> None:
    """Every kernel and lane-group size on the decode K's (and short rows where lanes get 1-2 chunks or
    none), odd N, 1-4 rows of x: each matches the reference."""
    n = 1153 if k <= 4864 else 257
    x, w, b = make(m, n, k, dtype, activation, (m + k) % 2 == 0, device="cuda", seed=m * 100 + k)
    torch.testing.assert_close(gemv_variant(x, w, b, activation, variant), reference.gemv(x, w, b, activation),
                               rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.cuda
@pytest.mark.parametrize("m,k", [(1, 8192), (2, 14336), (1, 14344), (3, 14336)])
def test_gemv_auto_long_plain_rows_run_split_k(m, k) -> None:
    """A plain x with K >= 8192 and 1-2 rows: auto is the split-K kernel (bit-identical to the forced
    variant, matching the reference); 3 rows go to the tensor-core kernel (K a multiple of 32, SM 8.0+),
    else stay on the row-group kernel."""
    x, w, b = make(m, 257, k, torch.bfloat16, None, True, device="cuda", seed=k + m)
    auto = kernels.gemv(x, w, b)
    torch.testing.assert_close(auto, reference.gemv(x, w, b), rtol=2e-2, atol=2e-2)
    tensor_cores = k % 32 == 0 and torch.cuda.get_device_capability()[0] >= 8
    expected = "split_k" if m <= 2 else ("mma" if tensor_cores else "row_group")
    assert torch.equal(auto, gemv_variant(x, w, b, None, expected))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [3, 7, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("n,k", [(1, 32), (16, 96), (17, 4096), (4104, 896), (300, 14336)])
def test_gemv_tensor_core_kernel(dtype, m, n, k) -> None:
    """The tensor-core kernel (3-16 rows of a plain x per pass; more rows take several passes): N not a
    multiple of its 16-row tiles, K from one 32-wide slab to 448 (warps with different slab counts), one
    and two n8 blocks of x rows, bias on odd M; auto is bit-identical to the forced variant."""
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the tensor-core kernel needs SM 8.0+")
    x, w, b = make(m, n, k, dtype, None, m % 2 == 1, device="cuda", seed=m * 31 + n + k)
    got = gemv_variant(x, w, b, None, "mma")
    torch.testing.assert_close(got, reference.gemv(x, w, b), rtol=TOL[dtype][0], atol=TOL[dtype][1])
    big = torch.zeros(m, k + 40, device="cuda", dtype=dtype)  # rows k + 40 apart (16-byte aligned)
    big[:, 8:8 + k] = x
    strided = kernels.gemv(big[:, 8:8 + k], w, b)
    torch.testing.assert_close(strided, reference.gemv(x, w, b), rtol=TOL[dtype][0], atol=TOL[dtype][1])
    # Passes are 16 rows whatever K is (the kernel keeps x out of shared memory); when every pass has 3+
    # rows, auto runs the tensor-core kernel on each, as the forced variant does.
    if m % 16 == 0 or m % 16 >= 3:
        assert torch.equal(got, kernels.gemv(x, w, b)) and torch.equal(got, strided)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [17, 18, 19])
def test_gemv_tensor_core_passes_with_a_remainder_too_wide_for_shared_memory(m) -> None:
    """K = 57,344: one row of x fits the CUDA-core kernels' shared memory, two do not. Auto runs 16 rows on
    tensor cores, then a remainder of 1-2 rows one row at a time; 3 rows all on tensor cores."""
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the tensor-core kernel needs SM 8.0+")
    if not 120 << 10 <= torch.cuda.get_device_properties(0).shared_memory_per_block_optin < 228 << 10:
        pytest.skip("needs shared memory for one 57,344-wide row of x but not two (H100/H200, A100)")
    x, w, b = make(m, 17, 57344, torch.bfloat16, None, True, device="cuda", seed=m)
    got = kernels.gemv(x, w, b)
    torch.testing.assert_close(got, reference.gemv(x, w, b), rtol=TOL[torch.bfloat16][0],
                               atol=4 * TOL[torch.bfloat16][1])
    forced = gemv_variant(x, w, b, None, "mma")
    assert torch.equal(got[:16], forced[:16])
    if m == 19:
        assert torch.equal(got, forced)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [3, 8, 16, 17])
def test_linear_sends_batched_decode_rows_to_the_tensor_core_kernel(rows) -> None:
    """3..GEMV_MMA_MAX_ROWS rows with K a multiple of 32 and a small weight take the skinny GEMM (and match
    F.linear); more rows, K not a multiple of 32 or a larger weight stay on cuBLAS."""
    layer = _cuda_linear(4096, 1000, bias=True)  # 8.2 MB
    layer.weight.data.normal_(std=0.02)
    layer.bias.data.normal_()
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    expected = rows <= SM90.gemv_mma_max_rows and torch.cuda.get_device_capability()[0] >= 8
    assert (rows <= layer.method.plan.gemv_rows) == expected
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=2e-2, atol=2e-2)
    odd = _cuda_linear(4008, 8)  # K = 4008: a multiple of 8, not of 32
    assert not rows <= odd.method.plan.gemv_rows
    big = _cuda_linear(4096, 2048)  # 16.8 MB
    assert (rows <= big.method.plan.gemv_rows) == (rows <= GEMV_MAX_ROWS)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("m,n,k", [(1, 28672, 4096), (2, 6144, 4096), (1, 4096, 14336), (2, 9728, 896),
                                   (4, 28672, 4096), (2, 4096, 14336), (8, 896, 4864), (3, 9728, 896),
                                   (40, 300, 512), (2, 50000, 896)])
def test_gemv_large_and_many_rows(dtype, activation, m, n, k) -> None:
    """Many rows per persistent CTA (row-group kernel, several rounds; split-K: the reduction buffers
    alternate), long K split over 8 warps, more than 16 rows (several passes over W)."""
    x, w, b = make(m, n, k, dtype, activation, True, device="cuda", seed=7)
    torch.testing.assert_close(kernels.gemv(x, w, b, activation), reference.gemv(x, w, b, activation),
                               rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", ["row_stride", "misaligned_x", "misaligned_weight", "odd_k", "batch_dims"])
@pytest.mark.parametrize("m", [2, 5])
def test_gemv_layouts(dtype, activation, layout, m) -> None:
    """Strided rows of x, x and W off 16-byte boundaries, K not a multiple of 8 (the scalar paths), with
    2 rows (row-group kernel where W allows it) and 5 (split-K)."""
    n, k = 131, 13 if layout == "odd_k" else 264
    x, w, b = make(m, n, k, dtype, activation, True, device="cuda", seed=3)
    width = x.shape[1]
    if layout == "row_stride":
        big = torch.randn(m, 3 * width + 8, device="cuda").to(dtype)
        big[:, 8:8 + width] = x
        x = big[:, 8:8 + width]  # rows 3 * width + 8 apart, still 16-byte aligned
    elif layout == "misaligned_x":
        big = torch.randn(m, width + 3, device="cuda").to(dtype)
        big[:, 3:] = x
        x = big[:, 3:]
    elif layout == "misaligned_weight":
        big = torch.randn(n, k + 1, device="cuda").to(dtype)
        big[:, 1:] = w
        w = big[:, 1:]
    elif layout == "batch_dims":
        x = x.view(1, m, width)
    out = kernels.gemv(x, w, b, activation)
    want = reference.gemv(x, w, b, activation)
    assert out.shape == (*x.shape[:-1], n)
    torch.testing.assert_close(out, want, rtol=TOL[dtype][0], atol=TOL[dtype][1])


# (n, k) for the register-prefetch kernel, k = 8 * odd: 8-lane teams (k <= 1024: 72, 200, 904), 16-lane
# (2040), one warp (4088), 2 / 4 / 8 warps per row with the shared-memory reduction (4872, 14344, 24568),
# two passes per row (40008: the first pass from the registers loaded before the wait, the second
# streamed), and more rows than resident teams (9999 x 904, 28673 x 4088: later rows streamed).
PREFETCH_SHAPES = [(1, 72), (7, 200), (1153, 904), (9999, 904), (1153, 2040), (28673, 4088), (1153, 4872),
                   (257, 14344), (37, 24568), (37, 40008)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("n,k", PREFETCH_SHAPES)
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_reg_prefetch(dtype, activation, n, k, m) -> None:
    """The register-prefetch kernel (forced, and as auto's choice where csrc/gemv.cu's launch_rows picks
    it) on odd N, K = 8 * odd, every lane layout it picks, with and without bias: each matches the
    reference, and where auto picks it, auto is the same kernel (bit-identical)."""
    x, w, b = make(m, n, k, dtype, activation, (n + m) % 2 == 1, device="cuda", seed=n + k + m)
    out = gemv_variant(x, w, b, activation, "reg_prefetch")
    torch.testing.assert_close(out, reference.gemv(x, w, b, activation), rtol=TOL[dtype][0], atol=TOL[dtype][1])
    auto = kernels.gemv(x, w, b, activation)
    torch.testing.assert_close(auto, reference.gemv(x, w, b, activation), rtol=TOL[dtype][0], atol=TOL[dtype][1])
    # launch_rows' rule: one row, and the activation fused with K <= 8192, or 2048 <= K < 8192 and W <= 64 MB
    # (a plain x with K >= 8192 runs split-K).
    picked = m == 1 and ((activation is not None and k <= 8192) or
                         (activation is None and 2048 <= k < 8192 and n * k * w.element_size() <= 64 << 20))
    if picked:
        assert torch.equal(auto, out)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", ["row_stride", "misaligned_x", "misaligned_weight"])
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_reg_prefetch_layouts(dtype, activation, layout, m) -> None:
    """Strided rows of x (16-byte loads of x), x off 16-byte boundaries (scalar staging of x), and W off
    them (falls back to the split-K kernel): all match the reference."""
    n, k = 1153, 4872
    x, w, b = make(m, n, k, dtype, activation, True, device="cuda", seed=5 + m)
    width = x.shape[1]
    if layout == "row_stride":
        big = torch.randn(m, 2 * width + 24, device="cuda").to(dtype)
        big[:, 16:16 + width] = x
        x = big[:, 16:16 + width]
    elif layout == "misaligned_x":
        big = torch.randn(m, width + 1, device="cuda").to(dtype)
        big[:, 1:] = x
        x = big[:, 1:]
    else:
        big = torch.randn(n, k + 1, device="cuda").to(dtype)
        big[:, 1:] = w
        w = big[:, 1:]
    torch.testing.assert_close(gemv_variant(x, w, b, activation, "reg_prefetch"),
                               reference.gemv(x, w, b, activation), rtol=TOL[dtype][0], atol=TOL[dtype][1])


def replays_behind_norm(x: torch.Tensor, kernels_after: Callable[[], Any], trials: int = 3):
    """Capture (fused_add_rms_norm writing x in place, then `kernels_after()`) in a CUDA graph with PDL on;
    yield (trial, outputs of kernels_after) after each replay with new x and residual, once the norm's
    output is checked against the reference (x then holds it)."""
    residual = torch.zeros_like(x)
    norm_w = torch.ones(x.shape[1], device="cuda", dtype=x.dtype)
    previous = kernels.set_pdl(True)
    try:
        def step() -> Any:
            kernels.fused_add_rms_norm(x, residual, norm_w, 1e-6)
            return kernels_after()

        graph, out = capture_graph(step)
    finally:
        kernels.set_pdl(previous)
    for trial in range(trials):
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(residual))
        want_x, want_res = x.clone(), residual.clone()
        reference.fused_add_rms_norm(want_x, want_res, norm_w, 1e-6)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(x, want_x, rtol=2e-2, atol=2e-2)
        yield trial, out


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("m,n,k", [(1, 9728, 896), (2, 1153, 904), (1, 4096, 14336), (2, 257, 14344),
                                   (1, 28673, 4088)])
def test_gemv_reg_prefetch_behind_writer_in_graph(activation, m, n, k) -> None:
    """In a CUDA graph with PDL on, right behind the kernel that writes x (fused_add_rms_norm, in place):
    the weights this kernel loads before its PDL wait are constants, x is read only after it. Each replay
    with new inputs matches the reference computed from the norm's output."""
    x, w, b = make(m, n, k, torch.bfloat16, activation, True, device="cuda", seed=13)
    for trial, out in replays_behind_norm(x, lambda: gemv_variant(x, w, b, activation, "reg_prefetch")):
        torch.testing.assert_close(out, reference.gemv(x, w, b, activation), rtol=2e-2, atol=2e-2,
                                   msg=lambda msg, t=trial: f"replay {t}: {msg}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("variant", ["auto", "row_group_32", "row_group_16", "row_group_8"])
@pytest.mark.parametrize("n,k", [(2, 72), (14, 200), (2306, 904), (1154, 4096), (514, 14344), (28672, 4096)])
@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_gemv_gated_output(dtype, activation, variant, n, k, m) -> None:
    """The gated output (gate_up writing act(gate) * up) on every lane-group size, odd N / 2, K = 8 * odd
    and the decode K's, 1-2 rows (one launch) and 3 / 5 (passes of 2 rows), with and without bias:
    it matches the reference (product rounded, then act_and_mul), and equals the kernel's own plain
    product followed by act_and_mul up to the activation's last rounding step."""
    x, w, b = make(m, n, k, dtype, None, (n + m) % 2 == 0, device="cuda", seed=n + k + m)
    out = gemv_variant(x, w, b, None, variant, activation)
    assert out.shape == (m, n // 2) and out.dtype == dtype
    want = reference.gemv(x, w, b, None, activation)
    torch.testing.assert_close(out, want, rtol=TOL[dtype][0], atol=TOL[dtype][1])
    two_step = kernels.act_and_mul(gemv_variant(x, w, b, None, variant), activation)
    torch.testing.assert_close(out, two_step, rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("layout", ["row_stride", "misaligned_x", "misaligned_weight", "odd_k", "batch_dims"])
def test_gemv_gated_output_layouts(activation, layout) -> None:
    """Strided and misaligned x (the kernel's scalar staging), and W the kernel cannot stream in pairs
    (misaligned, K not a multiple of 8: product then act_and_mul): all match the reference."""
    m, n, k = 2, 262, 13 if layout == "odd_k" else 264
    x, w, b = make(m, n, k, torch.bfloat16, None, True, device="cuda", seed=17)
    if layout == "row_stride":
        big = torch.randn(m, 3 * k + 8, device="cuda").to(x.dtype)
        big[:, 8:8 + k] = x
        x = big[:, 8:8 + k]
    elif layout == "misaligned_x":
        big = torch.randn(m, k + 3, device="cuda").to(x.dtype)
        big[:, 3:] = x
        x = big[:, 3:]
    elif layout == "misaligned_weight":
        big = torch.randn(n, k + 1, device="cuda").to(x.dtype)
        big[:, 1:] = w
        w = big[:, 1:]
    elif layout == "batch_dims":
        x = x.view(1, m, k)
    out = kernels.gemv(x, w, b, output_activation=activation)
    assert out.shape == (*x.shape[:-1], n // 2)
    torch.testing.assert_close(out, reference.gemv(x, w, b, None, activation), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(1, 9728, 896), (2, 28672, 4096), (1, 2306, 904)])
def test_gemv_gated_output_behind_writer_in_graph(m, n, k) -> None:
    """gate_up with the gated output, then the down projection on its plain output, in a CUDA graph with
    PDL on behind the norm that writes x (the decode MLP): each replay matches the reference."""
    x, w, b = make(m, n, k, torch.bfloat16, None, False, device="cuda", seed=19)
    down = (torch.randn(k, n // 2, device="cuda") / (n // 2) ** 0.5).to(torch.bfloat16)

    def mlp() -> tuple[torch.Tensor, torch.Tensor]:
        h = kernels.gemv(x, w, b, output_activation="silu")
        return h, kernels.gemv(h, down)

    for trial, (h, out) in replays_behind_norm(x, mlp):
        want_h = reference.gemv(x, w, b, None, "silu")
        torch.testing.assert_close(h, want_h, rtol=2e-2, atol=2e-2, msg=lambda msg, t=trial: f"replay {t}: {msg}")
        torch.testing.assert_close(out, reference.gemv(h, down), rtol=2e-2, atol=2e-2,
                                   msg=lambda msg, t=trial: f"replay {t}: {msg}")


@pytest.mark.cuda
def test_gemv_empty_rows_and_cuda_errors() -> None:
    w = torch.randn(7, 64, device="cuda", dtype=torch.bfloat16)
    assert kernels.gemv(torch.empty(0, 64, device="cuda", dtype=torch.bfloat16), w).shape == (0, 7)
    with pytest.raises(ValueError, match="float32 unsupported"):
        kernels.gemv(torch.randn(1, 64, device="cuda"), w.float())
    with pytest.raises(ValueError, match="x is torch.bfloat16 on cuda"):
        kernels.gemv(torch.randn(1, 64, device="cuda", dtype=torch.bfloat16), w.cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("m,n,k", [(1, 1152, 896), (4, 896, 4864), (8, 1153, 200), (4, 1000, 14336),
                                   (2, 6144, 4096), (1, 4096, 14336)])
def test_gemv_inside_cuda_graph(activation, m, n, k) -> None:
    """Captured once, replayed with new inputs in the same buffers: each replay matches the reference.
    (4, 1000, 14336) stages 112 KiB of x: the shared-memory opt-in happens during capture. Up to 4 rows
    run the row-group kernel, 8 the split-K one."""
    x, w, b = make(m, n, k, torch.bfloat16, activation, True, device="cuda", seed=11)
    graph, out = capture_graph(lambda: kernels.gemv(x, w, b, activation))
    for trial in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, reference.gemv(x, w, b, activation), rtol=2e-2, atol=2e-2,
                                   msg=lambda msg, t=trial: f"replay {t}: {msg}")


# ------------------------------------------------------------------------------------------
# Layers on CUDA
# ------------------------------------------------------------------------------------------

real_table_for = linear_method.table_for


def _cuda_linear(in_features: int, out_features: int, bias: bool = False) -> Linear:
    """A bf16 Linear on the GPU (uninitialised) with its kernels chosen as the loader chooses them."""
    layer = Linear(in_features, out_features, bias).to("cuda", torch.bfloat16)
    select_kernels(layer)
    return layer


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 17])
def test_linear_uses_gemv_for_decode_rows(rows: int, monkeypatch) -> None:
    """A 2 MB weight with K a multiple of 32: 1-2 rows take the CUDA-core kernels, 3..GEMV_MMA_MAX_ROWS the
    tensor-core one (SM 8.0+), more rows cuBLAS."""
    calls = []
    real = linear_method.gemv
    monkeypatch.setattr(linear_method, "gemv", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    layer = _cuda_linear(896, 1152, bias=True)
    layer.weight.data.normal_(std=896**-0.5)
    layer.bias.data.normal_()
    x = torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    mma = rows <= SM90.gemv_mma_max_rows and torch.cuda.get_device_capability()[0] >= 8
    assert len(calls) == (1 if rows <= GEMV_MAX_ROWS or mma else 0)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows", [1, GEMV_MAX_FUSED_ROWS, GEMV_MAX_FUSED_ROWS + 1, GEMV_MAX_ROWS + 5])
def test_gated_mlp_fuses_the_activation_into_a_gemv(gated: bool, act: str, rows: int, monkeypatch) -> None:
    """Decode rows: the activation runs inside the gate_up projection's GEMV (at its outputs; large MLPs,
    here a table whose bound this small MLP meets) or inside the down projection's (on its input; small
    MLPs); more rows: act_and_mul."""
    bound = 704 if gated else 705
    monkeypatch.setattr(linear_method, "table_for",
                        lambda cap: dataclasses.replace(real_table_for(cap), gated_gemv_min_intermediate=bound))
    fused = []
    real = linear_method.gemv

    def spy(*a, **kw):
        # Only the fused calls: an activation at the outputs, or on the input (gemv's 4th argument).
        if kw.get("output_activation"):
            fused.append(("out", kw["output_activation"]))
        elif len(a) > 3 and a[3]:
            fused.append(("in", a[3]))
        return real(*a, **kw)

    monkeypatch.setattr(linear_method, "gemv", spy)
    torch.manual_seed(5)
    mlp = cuda_gated_mlp(256, 704, act)
    x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    gate, up = (x.float() @ mlp.gate_up_proj.weight.float().t()).to(x.dtype).chunk(2, dim=-1)
    hidden = (mlp.act(gate.float()) * up.float()).to(x.dtype)
    want = (hidden.float() @ mlp.down_proj.weight.float().t()).to(x.dtype)
    torch.testing.assert_close(mlp(x), want, rtol=3e-2, atol=3e-2)
    expect = [("out" if gated else "in", mlp.fused_act)] if rows <= GEMV_MAX_FUSED_ROWS else []
    assert fused == expect


@pytest.mark.cuda
@pytest.mark.parametrize("inter,gated", [(4864, False), (GATED_GEMV_MIN_INTERMEDIATE, True), (14336, True)])
def test_gated_mlp_policy_by_size(inter: int, gated: bool, monkeypatch) -> None:
    """By default only MLPs with an intermediate size of at least GATED_GEMV_MIN_INTERMEDIATE move the
    activation to the gate_up projection (where the down projection's K is long)."""
    kinds = []
    real = linear_method.gemv

    def spy(*a, **kw):
        # Only the fused calls (plain decode projections take the same kernel without an activation).
        if kw.get("output_activation"):
            kinds.append("out")
        elif len(a) > 3 and a[3]:
            kinds.append("in")
        return real(*a, **kw)

    monkeypatch.setattr(linear_method, "gemv", spy)
    mlp = cuda_gated_mlp(2048, inter, "silu")
    mlp(torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16))
    assert kinds == ["out" if gated else "in"]


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, LM_HEAD_GEMV_MAX_ROWS, LM_HEAD_GEMV_MAX_ROWS + 1])
@pytest.mark.parametrize("vocab,hidden", [(50257, 896), (12347, 4096)])
def test_logits_use_gemv_for_decode_rows(rows: int, vocab: int, hidden: int, monkeypatch) -> None:
    """The lm_head of 1-2 decode rows runs the skinny GEMM (float32 logits of the rounded product, as
    F.linear(...).float() gives); more rows stay on cuBLAS."""
    calls = []
    real = linear_method.gemv
    monkeypatch.setattr(linear_method, "gemv", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    torch.manual_seed(3)
    head = VocabEmbedding(vocab, hidden).to("cuda", torch.bfloat16)
    head.weight.data.copy_(torch.randn(vocab, hidden, device="cuda") / hidden**0.5)
    select_kernels(head)
    weight = head.weight
    h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    logits = compute_logits(h, head)
    assert logits.dtype == torch.float32 and logits.shape == (rows, vocab)
    assert len(calls) == (1 if rows <= LM_HEAD_GEMV_MAX_ROWS else 0)
    torch.testing.assert_close(logits, F.linear(h, weight).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("in_f,out_f,rows,expect", [
    (896, 1152, 2, True),  # small weight: up to GEMV_MAX_ROWS rows
    (896, 9728, 1, True),  # Qwen's 17 MB gate_up: the kernel lets the down projection behind it use PDL
    (896, 11264, 1, False),  # 20 MB with a short K: cuBLAS
    (4096, 4096, 1, True),  # wide K, one row
    (4096, 4096, 2, False),  # wide K, two rows: cuBLAS
])
def test_linear_gemv_dispatch_follows_the_measurements(in_f: int, out_f: int, rows: int, expect: bool) -> None:
    layer = _cuda_linear(in_f, out_f)
    assert (rows <= layer.method.plan.gemv_rows) is expect
