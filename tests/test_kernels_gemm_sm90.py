"""Hopper GEMM with the gated-activation epilogue (wllm.kernels.gemm_sm90).

CPU (CI): the reference against float64 math, argument errors, the fallback off SM 9.0, the layout check.
CUDA (-m cuda, SM 9.0 GPUs): the kernel against the reference at odd sizes (partial tiles in every
direction, K not a multiple of the 64-wide k-tile, a single row), both dtypes, all epilogues, strided
rows, inside a CUDA graph, both schedules (whole tiles, stream-K with its partial sums and flags).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from wllm.engine.cuda_graphs import capture_graph
from wllm.kernels import gemm_sm90, reference
from wllm.kernels.gemm_sm90 import _cuda_gemm, fits, supported

# The module (wllm.kernels re-exports its function under the same name).
gemm_sm90_module = importlib.import_module("wllm.kernels.gemm_sm90")

DTYPES = [torch.float16, torch.bfloat16]
ACTIVATIONS = [None, "silu", "gelu_tanh"]
# fp32 accumulation in a different order, then one rounding to the dtype.
TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def make(m: int, n: int, k: int, dtype: torch.dtype, activation: str | None, device: str = "cpu",
         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] and a weight of n output columns ([2 n, k] = [gate | up] when gated), outputs O(1)."""
    gen = torch.Generator().manual_seed(seed)
    rows = n if activation is None else 2 * n
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(rows, k, generator=gen) / k**0.5).to(dtype)
    return x.to(device), w.to(device)


def gemm64(x: torch.Tensor, w: torch.Tensor, activation: str | None) -> torch.Tensor:
    """From first principles in float64 (no rounding before the activation)."""
    y = x.double() @ w.double().t()
    if activation is None:
        return y
    n = w.shape[0] // 2
    gate, up = y[:, :n], y[:, n:]
    if activation == "silu":
        return gate / (1 + torch.exp(-gate)) * up
    return 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up


# ------------------------------------------------------------------------------------------
# Reference, errors, dispatch conditions (CPU)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("m,n,k", [(1, 8, 72), (5, 33, 200), (17, 64, 13)])
def test_reference_vs_float64(dtype, activation, m, n, k) -> None:
    x, w = make(m, n, k, dtype, activation)
    out = gemm_sm90(x, w, activation)  # CPU tensors: the reference
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.double(), gemm64(x, w, activation), rtol=TOL[dtype][0], atol=TOL[dtype][1])


def test_reference_rounds_once_after_the_activation() -> None:
    """The gated result comes from the fp32 products: rounding them to bf16 first (the unfused path) can
    differ, the kernel's reference must not."""
    x, w = make(64, 48, 256, torch.bfloat16, "silu", seed=4)
    fused = reference.gemm(x, w, "silu")
    want = reference.act_and_mul((x.float() @ w.float().t()), "silu").to(torch.bfloat16)
    assert torch.equal(fused, want)


@pytest.mark.parametrize("bad,match", [
    (lambda x, w: (x, w, "relu"), "unknown activation"),
    (lambda x, w: (x, w[:, :-1], None), "do not multiply"),
    (lambda x, w: (x.float(), w.float(), None), "float16 or bfloat16"),
    (lambda x, w: (x, w.half(), None), "float16 or bfloat16"),
    (lambda x, w: (x, w[:-1], "silu"), "even count"),
    (lambda x, w: (x, w, None, "split_k"), "unknown schedule"),
])
def test_argument_errors(bad, match) -> None:
    x, w = make(3, 16, 64, torch.bfloat16, "silu")
    with pytest.raises(ValueError, match=match):
        gemm_sm90(*bad(x, w))


def test_fits_checks_the_tma_layout() -> None:
    x, w = make(4, 32, 64, torch.bfloat16, None)
    assert fits(x, w)
    assert not fits(x.float(), w.float())
    assert not fits(x[:, :60], w[:, :60])  # K % 8: row strides of the weight stay 64, K not
    wide = torch.zeros(32, 72, dtype=torch.bfloat16)[:, :64]
    assert fits(x, wide)  # padded weight rows (stride 72) are fine
    assert not fits(x.t().contiguous().t(), w)  # column-major x
    assert not fits(torch.zeros(4, 68, dtype=torch.bfloat16)[:, :64], w)  # x rows 68 elements apart


def test_not_supported_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert not any(supported(d) for d in range(1))


# ------------------------------------------------------------------------------------------
# The kernel (SM 9.0)
# ------------------------------------------------------------------------------------------


def _sm90() -> None:
    if not supported(0):
        pytest.skip(f"gemm_sm90 needs an SM 9.0 GPU (this one is {torch.cuda.get_device_capability()})")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("m,n,k", [
    (1, 64, 64),  # one row: rank 1 of the cluster has no rows at all
    (7, 300, 128),  # partial column tile, gated: the gate half overlaps the up rows past n (clipped)
    (129, 257, 200),  # partial tiles everywhere, K not a multiple of 64, odd n (padded output stride)
    (300, 1000, 1032),
    (513, 4104, 896),  # Qwen-like K, many column tiles
    (2000, 1536, 4096),  # several waves of the persistent grid
])
def test_kernel_vs_reference(dtype, activation, m, n, k) -> None:
    _sm90()
    x, w = make(m, n, k, dtype, activation, "cuda", seed=m + n + k)
    out = gemm_sm90(x, w, activation)
    assert out.shape == (m, n) and out.dtype == dtype
    want = reference.gemm(x, w, activation)
    torch.testing.assert_close(out.float(), want.float(), rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.cuda
def test_kernel_strided_rows_and_3d_input() -> None:
    """x rows further apart than K (a slice of a wider tensor) and a [B, T, K] input."""
    _sm90()
    x_wide, w = make(600, 200, 264, torch.bfloat16, "silu", "cuda", seed=9)
    x = x_wide[:, :256]
    w = w[:, :256].contiguous()
    out = gemm_sm90(x, w, "silu")
    torch.testing.assert_close(out.float(), reference.gemm(x, w, "silu").float(), rtol=1.6e-2, atol=1.6e-2)
    x3 = x.contiguous().view(3, 200, 256)
    out3 = gemm_sm90(x3, w, "silu")
    assert out3.shape == (3, 200, 200)
    assert torch.equal(out3.view(600, 200), gemm_sm90(x.contiguous(), w, "silu"))


@pytest.mark.cuda
def test_kernel_is_deterministic_and_graph_capturable() -> None:
    _sm90()
    x, w = make(1024, 2048, 1024, torch.bfloat16, "silu", "cuda", seed=2)
    eager = gemm_sm90(x, w, "silu")
    assert torch.equal(gemm_sm90(x, w, "silu"), eager)
    graph, out = capture_graph(lambda: gemm_sm90(x, w, "silu"))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


# Stream-K cases: tiles cut between many clusters (1 k-block each: up to 17 partial sums per tile), a
# single k-block in all (one cluster), decode shapes (Llama-3.1-8B's qkv and a long K like its down).
STREAM_K_SHAPES = [(1, 64, 64), (239, 1000, 1032), (300, 2048, 200), (129, 257, 200), (239, 6144, 4096),
                   (240, 520, 14336)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("m,n,k", STREAM_K_SHAPES)
def test_schedules_vs_reference(dtype, activation, m, n, k) -> None:
    """Whole tiles and stream-K both match the reference; stream-K is deterministic (a fixed order of the
    partial sums) and leaves the workspace's flags zero for the next call."""
    _sm90()
    x, w = make(m, n, k, dtype, activation, "cuda", seed=m + 3 * n + k)
    want = reference.gemm(x, w, activation).float()
    tiles = gemm_sm90(x, w, activation, schedule="tiles")
    streamed = gemm_sm90(x, w, activation, schedule="stream_k")
    torch.testing.assert_close(tiles.float(), want, rtol=TOL[dtype][0], atol=TOL[dtype][1])
    torch.testing.assert_close(streamed.float(), want, rtol=TOL[dtype][0], atol=TOL[dtype][1])
    assert torch.equal(gemm_sm90(x, w, activation, schedule="stream_k"), streamed)
    flags = gemm_sm90_module._WORKSPACES[0][:8 * torch.cuda.get_device_properties(0).multi_processor_count]
    assert not flags.any()  # the flags (2 int32 per CTA) are zero again


@pytest.mark.cuda
def test_auto_schedule_streams_decode_sizes_only() -> None:
    """auto takes stream-K where whole tiles leave SMs idle (239 rows x 4096 columns: 16 tiles for 60+ CTA
    pairs) and whole tiles for many waves (4096 rows: 256 tiles); bit-identical to the forced schedule."""
    _sm90()
    x, w = make(239, 4096, 1024, torch.bfloat16, None, "cuda", seed=3)
    assert torch.equal(gemm_sm90(x, w), gemm_sm90(x, w, schedule="stream_k"))
    x, w = make(4096, 4096, 256, torch.bfloat16, None, "cuda", seed=4)
    assert torch.equal(gemm_sm90(x, w), gemm_sm90(x, w, schedule="tiles"))


@pytest.mark.cuda
def test_stream_k_in_cuda_graphs(monkeypatch) -> None:
    """Replays reuse the workspace (its flags are zero after every run); a graph captured before any
    workspace exists keeps to whole tiles instead of allocating in the graph's pool."""
    _sm90()
    x, w = make(239, 3000, 2048, torch.bfloat16, "silu", "cuda", seed=5)
    eager = gemm_sm90(x, w, "silu", schedule="stream_k")
    graph, out = capture_graph(lambda: gemm_sm90(x, w, "silu"))
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    monkeypatch.setattr(gemm_sm90_module, "_WORKSPACES", {})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm_sm90(x, w, "silu")
    assert gemm_sm90_module._WORKSPACES == {}
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemm_sm90(x, w, "silu", schedule="tiles"))


@pytest.mark.cuda
def test_kernel_refuses_bad_layouts() -> None:
    _sm90()
    x, w = make(64, 64, 72, torch.bfloat16, None, "cuda")
    with pytest.raises(Exception, match="16-byte aligned|multiples of 8"):
        _cuda_gemm(x.view(-1)[1:1 + 64 * 64].view(64, 64), w[:, :64].contiguous(), None)
