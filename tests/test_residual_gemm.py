"""The residual add inside cuBLAS's epilogue (Linear.forward with a residual): o_proj and down_proj add their output
into the residual stream in the GEMM (beta = 1) so that the RMSNorm after them reads one tensor, not two.
Where the layer would not run on cuBLAS (CPU, bias, skinny-GEMM batches) nothing changes; a model computes the
same logits as with the separate add (the fused add-and-norm), up to rounding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from model_utils import randomize, tiny_hf_model

from wllm.model.contiguous_attention import ContiguousAttention
from wllm.model.layers.linear import Linear
from wllm.model.layers.linear_method import DenseLinearMethod, select_kernels
from wllm.model.loader import load_model


def _linear(k: int, n: int, dtype: torch.dtype, device: str, bias: bool = False) -> Linear:
    layer = Linear(k, n, bias).to(device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.normal_(0, k**-0.5)
        if layer.bias is not None:
            layer.bias.normal_()
    select_kernels(layer)
    return layer


def _without_residual_epilogue(module: torch.nn.Module) -> None:
    """The plans of every dense layer of `module` with the residual add left to the caller."""
    for layer in module.modules():
        if isinstance(layer, Linear) and isinstance(layer.method, DenseLinearMethod):
            layer.method.use_plan(layer, dataclasses.replace(layer.method.plan, adds_residual=False))


def _adds(layer: Linear, x: torch.Tensor, residual: torch.Tensor) -> bool:
    """The layer added x W^T into residual (returned None) rather than returning the product."""
    return layer(x, residual) is None


def test_forward_add_declines_on_cpu() -> None:
    layer = _linear(24, 40, torch.float32, "cpu")
    x, residual = torch.randn(5, 24), torch.randn(5, 40)
    before = residual.clone()
    assert not _adds(layer, x, residual)
    assert torch.equal(residual, before)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [17, 64, 257])
@pytest.mark.parametrize("k,n", [(96, 200), (1000, 72)])
def test_forward_add_matches_linear_plus_add(dtype, rows, k, n) -> None:
    torch.manual_seed(rows + k)
    layer = _linear(k, n, dtype, "cuda")
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    residual = torch.randn(rows, n, device="cuda", dtype=dtype)
    expect = (residual.float() + x.float() @ layer.weight.float().t()).to(dtype)
    assert _adds(layer, x, residual)
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    torch.testing.assert_close(residual, expect, rtol=tol, atol=tol)


@pytest.mark.cuda
def test_forward_add_declines_where_cublas_does_not_run() -> None:
    x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(40, 32, device="cuda", dtype=torch.bfloat16)
    before = residual.clone()
    assert not _adds(_linear(64, 32, torch.bfloat16, "cuda", bias=True), x, residual)  # bias
    assert not _adds(_linear(64, 48, torch.bfloat16, "cuda"), x, residual)  # shape mismatch
    assert not _adds(_linear(64, 32, torch.bfloat16, "cuda"), x[:1], residual[:1])  # skinny GEMM
    assert not _adds(_linear(64, 32, torch.bfloat16, "cuda"), x, residual.float())  # dtype
    assert not _adds(_linear(64, 32, torch.bfloat16, "cuda"), x.unsqueeze(0), residual.unsqueeze(0))  # 3-D
    assert not _adds(Linear(64, 32).to("cuda", torch.bfloat16), x, residual)  # kernels not chosen yet
    assert torch.equal(residual, before)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_forward_same_with_and_without_gemm_residual(tmp_path, dtype) -> None:
    hf = tiny_hf_model("llama")
    randomize(hf)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=dtype, device="cuda").model
    ids = torch.randint(0, hf.config.vocab_size, (37,), device="cuda")
    positions = torch.arange(37, device="cuda")

    def run() -> torch.Tensor:
        ctx = ContiguousAttention()
        ctx.prepare([0], [37])
        with torch.inference_mode():
            return model.compute_logits(model(ids, positions, ctx))

    fused = run()
    _without_residual_epilogue(model)
    plain = run()
    tol = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(fused, plain, rtol=tol, atol=tol)
    assert F.cosine_similarity(fused.flatten(), plain.flatten(), dim=0) > 0.999
