"""Kernel references against float64 math (CPU, CI) and CUDA kernels against the references (-m cuda)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from wllm import kernels
from wllm.engine.cuda_graphs import capture_graph
from wllm.kernels import _lib, ops, reference
from wllm.kernels.ops import persistent_workspace

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _rms_norm64(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + offset)


def _rotate64(x: torch.Tensor, pos: torch.Tensor, head_size: int, rot_dim: int, base: float, neox: bool):
    """float64 rotary of x [T, H*D] from first principles (angles computed in float64)."""
    t = x.double().view(x.shape[0], -1, head_size).clone()
    half = rot_dim // 2
    inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    if neox:
        a, b = t[..., :half].clone(), t[..., half:rot_dim].clone()
        t[..., :half], t[..., half:rot_dim] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = t[..., 0:rot_dim:2].clone(), t[..., 1:rot_dim:2].clone()
        t[..., 0:rot_dim:2], t[..., 1:rot_dim:2] = a * cos - b * sin, b * cos + a * sin
    return t.view(x.shape[0], -1)


# ------------------------------------------------------------------------------------------
# References vs float64 (CPU)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 37), (5, 4099)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_reference_vs_float64(dtype: torch.dtype, shape: tuple[int, int], offset: float) -> None:
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    out = reference.rms_norm(x, w, 1e-6, offset)
    assert out.dtype == dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double(), _rms_norm64(x, w, 1e-6, offset), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_reference_vs_float64(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(9, 129).to(dtype)
    res = torch.randn(9, 129).to(dtype)
    w = torch.randn(129).to(dtype)
    summed = (x.double() + res.double()).to(dtype)  # the residual stream is kept in dtype
    x2, res2 = x.clone(), res.clone()
    kernels.fused_add_rms_norm(x2, res2, w, 1e-5)
    assert torch.equal(res2, summed)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(x2.double(), _rms_norm64(summed, w, 1e-5, 0.0), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (80, 80), (128, 64)])
def test_rotary_reference_vs_float64(dtype: torch.dtype, neox: bool, head_size: int, rot_dim: int) -> None:
    torch.manual_seed(2)
    tokens, heads, kv_heads = 11, 3, 1
    # q and k are slices of a fused qkv row, as attention layers pass them.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size).to(dtype)
    q, k = qkv[:, : heads * head_size], qkv[:, heads * head_size : (heads + kv_heads) * head_size]
    v_before = qkv[:, (heads + kv_heads) * head_size :].clone()
    pos = torch.randint(0, 300, (tokens,))
    want_q = _rotate64(q, pos, head_size, rot_dim, 10000.0, neox)
    want_k = _rotate64(k, pos, head_size, rot_dim, 10000.0, neox)
    cache = kernels.rotary_cos_sin_cache(512, rot_dim, 10000.0)
    kernels.rotary_embedding(pos, q, k, head_size, cache, neox)
    rtol, atol = TOL[dtype]
    # fp32 angles of positions up to 300 carry ~3e-5 rad of rounding, as in HF transformers.
    atol = max(atol, 1e-4)
    torch.testing.assert_close(q.double(), want_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(k.double(), want_k, rtol=rtol, atol=atol)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_size :], v_before)


def test_cos_sin_cache_layout() -> None:
    cache = kernels.rotary_cos_sin_cache(4, 8, 10000.0)
    assert cache.shape == (4, 8) and cache.dtype == torch.float32
    assert torch.equal(cache[0], torch.tensor([1.0] * 4 + [0.0] * 4))
    assert math.isclose(cache[1, 0].item(), math.cos(1.0), rel_tol=1e-6)
    assert math.isclose(cache[1, 4].item(), math.sin(1.0), rel_tol=1e-6)


def test_custom_ops_pass_opcheck() -> None:
    torch.manual_seed(3)
    x, w = torch.randn(4, 16), torch.randn(16)
    torch.library.opcheck(torch.ops.wllm.rms_norm.default, (x, w, 1e-6, 0.0))
    torch.library.opcheck(torch.ops.wllm.fused_add_rms_norm.default, (x.clone(), x.clone(), w, 1e-6, 0.0))
    pos = torch.arange(4)
    cache = kernels.rotary_cos_sin_cache(8, 8)
    torch.library.opcheck(torch.ops.wllm.rotary_embedding.default,
                          (pos, torch.randn(4, 16), torch.randn(4, 8), 8, cache, True))


def test_missing_library_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("WLLM_KERNEL_LIBRARY", str(tmp_path / "nothing.so"))
    monkeypatch.setattr(_lib, "_cdll", None)
    monkeypatch.setattr(_lib, "_bindings", {})
    with pytest.raises(kernels.KernelLibraryError, match="CPU-only install"):
        _lib.binding(0)
    assert kernels.available() is False


def test_persistent_workspace_is_made_once_and_not_under_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workspace helper the sampler and the Hopper GEMM share: sized by the library, zeroed, made once
    per device and reused; while a graph is being captured without one it returns None (no allocation in
    the graph's pool). CPU tensors stand in for the device."""

    class FakeLib:
        calls = 0

        def wllm_test_workspace_size(self, size_ref):
            FakeLib.calls += 1
            size_ref._obj.value = 24
            return 0

        def check(self, rc: int, what: str) -> None:
            assert rc == 0 and what == "test_workspace_size"

    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    cache: dict[int, torch.Tensor] = {}
    device = torch.device("cpu", 0)
    assert persistent_workspace(cache, device, FakeLib(), "wllm_test_workspace_size") is None and cache == {}
    capturing[0] = False
    first = persistent_workspace(cache, device, FakeLib(), "wllm_test_workspace_size")
    assert first.dtype == torch.uint8 and first.numel() == 24 and not first.any()
    capturing[0] = True  # made already: handed out during a capture too
    assert persistent_workspace(cache, device, FakeLib(), "wllm_test_workspace_size") is first
    assert FakeLib.calls == 1 and cache == {0: first}


# ------------------------------------------------------------------------------------------
# CUDA kernels vs references (GPU machine)
# ------------------------------------------------------------------------------------------


def test_stream_handle_falls_back_to_the_public_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torch's raw-stream call (CPU builds, a future torch) the handle comes from current_stream."""

    class FakeStream:
        cuda_stream = 1234

    asked: list[int] = []
    monkeypatch.setattr(ops, "_RAW_STREAM", None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: asked.append(index) or FakeStream())
    assert ops._stream_of(3) == 1234 and asked == [3]


@pytest.mark.cuda
def test_stream_handle_is_the_current_stream() -> None:
    """Kernels launch on the stream torch would use: the default one, a side stream, a capture's stream."""
    x = torch.zeros(4, device="cuda")
    assert ops._RAW_STREAM is not None  # CUDA builds of torch have the fast path
    assert ops._stream(x) == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert ops._stream(x) == side.cuda_stream != torch.cuda.default_stream().cuda_stream
    seen: list[tuple[int, int]] = []

    def body() -> torch.Tensor:
        seen.append((ops._stream(x), torch.cuda.current_stream().cuda_stream))
        return x.add_(1)

    capture_graph(body)  # a warm-up call on a side stream, then the capture
    assert len(seen) == 2 and all(ours == torchs for ours, torchs in seen)


@pytest.mark.cuda
def test_device_check_reports_this_sm() -> None:
    b = _lib.binding(0)
    major, minor = torch.cuda.get_device_capability(0)
    assert b.binary_sm == major * 10 + minor


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 37), (33, 4096), (3, 8193)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_cuda(dtype: torch.dtype, shape: tuple[int, int], offset: float) -> None:
    torch.manual_seed(4)
    x = (torch.randn(shape, device="cuda") * 2).to(dtype)
    w = torch.randn(shape[-1], device="cuda").to(dtype)
    out = kernels.rms_norm(x, w, 1e-6, offset)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, reference.rms_norm(x, w, 1e-6, offset), rtol=rtol, atol=atol)
    # A strided input (every other row) goes through the row stride.
    xs = x[::2]
    torch.testing.assert_close(kernels.rms_norm(xs, w, 1e-6, offset), reference.rms_norm(xs, w, 1e-6, offset),
                               rtol=rtol, atol=atol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 37), (17, 2048), (2, 5120)])
def test_fused_add_rms_norm_cuda(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    torch.manual_seed(5)
    x = torch.randn(shape, device="cuda").to(dtype)
    res = torch.randn(shape, device="cuda").to(dtype)
    w = torch.randn(shape[-1], device="cuda").to(dtype)
    x_ref, res_ref = x.clone(), res.clone()
    reference.fused_add_rms_norm(x_ref, res_ref, w, 1e-6, 0.0)
    kernels.fused_add_rms_norm(x, res, w, 1e-6)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(res, res_ref, rtol=0, atol=0)
    torch.testing.assert_close(x, x_ref, rtol=rtol, atol=atol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim,heads,kv_heads", [(64, 64, 14, 2), (80, 80, 5, 5), (96, 96, 3, 1),
                                                              (128, 128, 32, 8), (256, 128, 8, 4)])
def test_rotary_cuda(dtype: torch.dtype, neox: bool, head_size: int, rot_dim: int, heads: int, kv_heads: int) -> None:
    torch.manual_seed(6)
    tokens = 37
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, device="cuda").to(dtype)
    q, k = qkv[:, : heads * head_size], qkv[:, heads * head_size : (heads + kv_heads) * head_size]
    pos = torch.randint(0, 4000, (tokens,), device="cuda")
    cache = kernels.rotary_cos_sin_cache(4096, rot_dim, 500000.0).cuda()
    q_ref, k_ref = q.clone(), k.clone()
    reference.rotary_embedding(pos, q_ref, k_ref, head_size, cache, neox)
    v_before = qkv[:, (heads + kv_heads) * head_size :].clone()
    kernels.rotary_embedding(pos, q, k, head_size, cache, neox)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(q, q_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(k, k_ref, rtol=rtol, atol=atol)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_size :], v_before)


@pytest.mark.cuda
def test_kernels_inside_cuda_graph() -> None:
    torch.manual_seed(7)
    dtype, tokens, heads, head_size, hidden = torch.bfloat16, 16, 4, 64, 256
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    res = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    w = torch.randn(hidden, device="cuda", dtype=dtype)
    q = torch.randn(tokens, heads * head_size, device="cuda", dtype=dtype)
    pos = torch.arange(tokens, device="cuda")
    cache = kernels.rotary_cos_sin_cache(1024, head_size).cuda()

    def step() -> torch.Tensor:
        kernels.fused_add_rms_norm(x, res, w, 1e-6)
        kernels.rotary_embedding(pos, q, None, head_size, cache, True)
        return kernels.rms_norm(res, w, 1e-6)

    graph, out = capture_graph(step)
    for trial in range(3):
        x.copy_(torch.randn_like(x))
        res.copy_(torch.randn_like(res))
        q.copy_(torch.randn_like(q))
        pos.copy_(torch.randint(0, 1024, (tokens,), device="cuda"))
        x_ref, res_ref, q_ref = x.clone(), res.clone(), q.clone()
        reference.fused_add_rms_norm(x_ref, res_ref, w, 1e-6)
        reference.rotary_embedding(pos, q_ref, None, head_size, cache, True)
        out_ref = reference.rms_norm(res_ref, w, 1e-6)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(x, x_ref, rtol=1.6e-2, atol=1.6e-2, msg=f"replay {trial}")
        torch.testing.assert_close(q, q_ref, rtol=1.6e-2, atol=1.6e-2)
        torch.testing.assert_close(out, out_ref, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.cuda
def test_second_toolkit_leg_is_used_when_the_first_lacks_this_gpu() -> None:
    """A library whose primary leg has no code for this GPU falls back to the next leg.

    The device script builds it with WLLM_LEG_SM_CUDA13=8.0 WLLM_LEG_SM_CUDA12=9.0 and points
    WLLM_TEST_LEG_LIBRARY at it (the real CUDA 12.x leg carries SM 7.0, which an H200 cannot run).
    """
    import os
    import subprocess
    import sys

    path = os.environ.get("WLLM_TEST_LEG_LIBRARY")
    if not path:
        pytest.skip("WLLM_TEST_LEG_LIBRARY not set (see build_tools/device_run.sh)")
    code = (
        "import torch; from wllm import kernels; from wllm.kernels import _lib, reference\n"
        "b = _lib.binding(0); x = torch.randn(5, 300, device='cuda'); w = torch.randn(300, device='cuda')\n"
        "torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6, 0.0))\n"
        "print(b.leg)\n"
    )
    env = dict(os.environ, WLLM_KERNEL_LIBRARY=path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "cuda12"
