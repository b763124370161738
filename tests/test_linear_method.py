"""The linear methods' kernel choice (wllm.model.layers.linear_method), on the CPU with stand-in GPUs.

The plans a dense layer works out at load are checked against the per-call rules they replace (written out
below as `Old`), row count by row count, on meta weights of real model shapes; then the dispatch of
Linear / GatedMLP / compute_logits on small CPU layers chosen for a stand-in GPU, with the kernels replaced
by recording stand-ins.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from wllm.kernels import reference
from wllm.kernels.gemv import gated_output_fits
from wllm.model.layers import linear_method
from wllm.model.layers.embedding import VocabEmbedding, compute_logits
from wllm.model.layers.linear import Linear
from wllm.model.layers.linear_method import (
    SM70,
    SM80,
    SM90,
    DenseLinearMethod,
    DensePlan,
    KernelTable,
    KernelTarget,
    select_kernels,
    table_for,
)
from wllm.model.layers.mlp import GatedMLP

MiB = 1 << 20


@dataclass(frozen=True)
class Old:
    """The per-call rules before the linear methods (Linear.use_gemv / _adds_into, GatedMLP.forward,
    compute_logits, CudaAttentionContext.qkv_rotary_attend), for a weight on a CUDA device of compute
    capability major `major`, with or without the kernel library."""

    major: int
    kernels: bool

    def use_gemv(self, w: torch.Tensor, rows: int, width: int | None = None) -> bool:
        n, k = w.shape
        width = k if width is None else width
        numel = rows * width
        if not (w.dtype in (torch.float16, torch.bfloat16) and 0 < numel <= 16 * width and k <= 24576):
            return False
        nbytes = w.numel() * w.element_size()
        if numel > 2 * width:
            return (width == k and k % 32 == 0 and w.stride(0) % 8 == 0 and nbytes <= 10 * MiB and self.major >= 8
                    and self.kernels)
        wide_one_row = numel == width and k >= 2048 and nbytes <= 256 * MiB
        return (nbytes <= 18 * MiB or wide_one_row) and self.kernels

    def gated(self, w: torch.Tensor, rows: int) -> bool:
        """GatedMLP: the activation at the gate_up projection's outputs (w = gate_up's weight)."""
        return w.shape[0] // 2 >= 8192 and rows <= 2 and self.use_gemv(w, rows) and gated_output_fits(w)

    def activated(self, w: torch.Tensor, rows: int) -> bool:
        """GatedMLP: the activation on the down projection's input (w = down's weight)."""
        return rows <= 2 and self.use_gemv(w, rows, 2 * w.shape[1])

    def qkv_rotary(self, w: torch.Tensor, rows: int) -> bool:
        return (w.numel() * w.element_size() <= 16 * MiB and rows <= 2 and self.use_gemv(w, rows)
                and gated_output_fits(w))

    def logits(self, w: torch.Tensor, rows: int) -> bool:
        return (w.dtype in (torch.float16, torch.bfloat16) and 0 < rows <= 2 and w.shape[1] <= 24576
                and self.kernels)


# (in_features, out_features): Qwen2.5-0.5B's and Llama-3.1-8B's projections (qkv, o, gate_up, down, LM head),
# and shapes at the edges of the rules (K not a multiple of 32, just over a size bound, K past shared memory).
SHAPES = [
    (896, 1152), (896, 896), (896, 9728), (4864, 896), (896, 151936),
    (4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256),
    (4008, 8), (4096, 1000), (4096, 2048), (896, 11264), (2048, 16384), (256, 1408), (24577, 16), (64, 48),
]
CAPABILITIES = [(9, 0), (8, 0), (8, 6), (8, 9), (7, 5), (7, 0), (10, 0), (12, 0)]
ROWS = range(0, 21)


def _meta_layer(k: int, n: int, dtype: torch.dtype, bias: bool = False) -> Linear:
    with torch.device("meta"):
        return Linear(k, n, bias).to(dtype)


def _target(capability: tuple[int, int], kernels: bool = True) -> KernelTarget:
    return KernelTarget(table_for(capability), kernels)


def test_tables_by_compute_capability() -> None:
    assert table_for((9, 0)) is SM90
    for cap in [(8, 0), (8, 6), (8, 9), (10, 0), (12, 0)]:
        assert table_for(cap) is SM80
    for cap in [(7, 0), (7, 5)]:
        assert table_for(cap) is SM70
    assert SM70.gemv_mma_max_rows == 0 and SM80.gemv_mma_max_rows == SM90.gemv_mma_max_rows
    with pytest.raises(ValueError, match="gemv_mma_max_weight_bytes"):
        KernelTable("bad", gemv_mma_max_weight_bytes=20 * MiB, gemv_small_weight_bytes=18 * MiB)


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dense_plans_match_the_old_rules_at_every_row_count(capability, kernels, dtype) -> None:
    old = Old(capability[0], kernels)
    target = _target(capability, kernels)
    for k, n in SHAPES:
        for bias in (False, True):
            layer = _meta_layer(k, n, dtype, bias)
            select_kernels(layer, lambda device, t=target: t)
            plan, w = layer.method.plan, layer.weight
            assert plan.adds_residual is (not bias), (k, n, bias)
            for rows in ROWS:
                where = f"K={k} N={n} {dtype} bias={bias} rows={rows}"
                assert (0 < rows <= plan.gemv_rows) == old.use_gemv(w, rows), where
                assert (0 < rows <= plan.gated_rows) == old.gated(w, rows), where
                assert (0 < rows <= plan.activated_rows) == old.activated(w, rows), where
                assert (0 < rows <= plan.qkv_rotary_rows) == old.qkv_rotary(w, rows), where
                assert (0 < rows <= plan.logits_rows) == old.logits(w, rows), where


def test_plans_spot_checks() -> None:
    """A few plans written out, so that a change of the table shows up as a readable diff."""
    target = _target((9, 0))

    def plan(k: int, n: int) -> DensePlan:
        layer = _meta_layer(k, n, torch.bfloat16)
        select_kernels(layer, lambda device: target)
        return layer.method.plan

    # Qwen2.5-0.5B qkv (2 MB): skinny GEMM up to 16 rows (tensor cores from 3), qkv + rotary fused for 1-2.
    assert plan(896, 1152) == DensePlan(gemv_rows=16, gated_rows=0, activated_rows=2, qkv_rotary_rows=2,
                                        logits_rows=2, adds_residual=True)
    # Its gate_up (17 MB): 1-2 rows; the intermediate (4864) is below the gated-output bound.
    assert plan(896, 9728).gemv_rows == 2 and plan(896, 9728).gated_rows == 0
    # Llama-3.1-8B gate_up (235 MB, K = 4096): one row, the activation at its outputs.
    assert plan(4096, 28672) == DensePlan(gemv_rows=1, gated_rows=1, activated_rows=1, qkv_rotary_rows=0,
                                          logits_rows=2, adds_residual=True)
    # Its down (117 MB, K = 14336): one row.
    assert plan(14336, 4096).gemv_rows == 1
    # A 20 MB weight with a short K: cuBLAS at every row count.
    assert plan(896, 11264).gemv_rows == 0


def test_without_a_gpu_or_before_selection_everything_is_pytorch() -> None:
    """Off CUDA (target None) and before select_kernels a layer runs F.linear and adds nothing into a residual."""
    fresh = Linear(64, 48)
    assert fresh.method.plan == DensePlan()
    layer = Linear(64, 48).to(torch.bfloat16)
    layer.weight.data.normal_()
    select_kernels(layer)  # CPU weights: the real target lookup says None
    assert layer.method.plan == DensePlan()
    x, residual = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(3, 48, dtype=torch.bfloat16)
    before = residual.clone()
    assert torch.equal(layer(x, residual), F.linear(x, layer.weight))
    assert torch.equal(residual, before)


# ------------------------------------------------------------------------------------------
# Dispatch on small CPU layers chosen for a stand-in GPU
# ------------------------------------------------------------------------------------------


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The kernels the linear methods launch, recorded; each computes its reference instead."""
    seen: list[tuple] = []

    def gemv(x, weight, bias=None, activation=None, output_activation=None):
        seen.append(("gemv", x.shape[0], activation, output_activation))
        return reference.gemv(x, weight, bias, activation, output_activation)

    def act_and_mul(x, activation):
        seen.append(("act_and_mul", x.shape[0], activation))
        return reference.act_and_mul(x, activation)

    def gemv_rotary_cache(x, *args):
        seen.append(("gemv_rotary_cache", x.shape[0]))
        return "q"

    monkeypatch.setattr(linear_method, "gemv", gemv)
    monkeypatch.setattr(linear_method, "act_and_mul", act_and_mul)
    monkeypatch.setattr(linear_method, "gemv_rotary_cache", gemv_rotary_cache)
    return seen


def _sm90(device: torch.device) -> KernelTarget:
    return _target((9, 0))


def _cpu_linear(k: int, n: int, bias: bool = False, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(k, n, bias).to(torch.bfloat16)
    layer.weight.data.normal_(std=k**-0.5)
    if layer.bias is not None:
        layer.bias.data.normal_()
    select_kernels(layer, _sm90)
    return layer


@pytest.mark.parametrize("rows,kernel", [(1, "gemv"), (2, "gemv"), (3, "gemv"), (16, "gemv"), (17, "addmm")])
def test_linear_dispatch_by_rows(calls, rows: int, kernel: str) -> None:
    layer = _cpu_linear(64, 48)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    residual = torch.randn(rows, 48, dtype=torch.bfloat16)
    before = residual.clone()
    out = layer(x, residual)
    if kernel == "gemv":
        assert calls == [("gemv", rows, None, None)]
        assert torch.equal(out, reference.gemv(x, layer.weight)) and torch.equal(residual, before)
    else:
        assert calls == [] and out is None
        assert torch.equal(residual, torch.addmm(before, x, layer.weight.t()))
    # Without a residual, or with a bias, cuBLAS returns the product.
    calls.clear()
    if kernel == "addmm":
        assert torch.equal(layer(x), F.linear(x, layer.weight))
        biased = _cpu_linear(64, 48, bias=True)
        assert torch.equal(biased(x, residual.clone()), F.linear(x, biased.weight, biased.bias))
        assert calls == []


def test_linear_residual_needs_matching_rows_and_dtype(calls) -> None:
    layer = _cpu_linear(64, 48)
    x = torch.randn(20, 64, dtype=torch.bfloat16)
    for residual in (torch.randn(20, 40, dtype=torch.bfloat16), torch.randn(20, 48), torch.randn(1, 20, 48)):
        before = residual.clone()
        assert layer(x, residual) is not None
        assert torch.equal(residual, before)


def _cpu_mlp(hidden: int, inter: int, target_table: KernelTable = SM90, act: str = "silu") -> GatedMLP:
    torch.manual_seed(1)
    mlp = GatedMLP(hidden, inter, act).to(torch.bfloat16)
    mlp.gate_up_proj.weight.data.normal_(std=hidden**-0.5)
    mlp.down_proj.weight.data.normal_(std=inter**-0.5)
    select_kernels(mlp, lambda device: KernelTarget(target_table, True))
    return mlp


@pytest.mark.parametrize("rows", [1, 2, 3, 17])
def test_gated_mlp_small_intermediate(calls, rows: int) -> None:
    """Below gated_gemv_min_intermediate: 1-2 rows fold the activation into down's input, 3-16 rows take
    gate_up on the skinny GEMM and the activation kernel, more rows cuBLAS and the activation kernel, with
    down adding into the residual."""
    mlp = _cpu_mlp(64, 96)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    residual = torch.randn(rows, 64, dtype=torch.bfloat16)
    before = residual.clone()
    out = mlp(x, residual)
    gate_up = reference.gemv(x, mlp.gate_up_proj.weight)
    if rows <= 2:
        assert calls == [("gemv", rows, None, None), ("gemv", rows, "silu", None)]
        assert torch.equal(out, reference.gemv(gate_up, mlp.down_proj.weight, None, "silu"))
    elif rows <= 16:
        assert calls == [("gemv", rows, None, None), ("act_and_mul", rows, "silu"), ("gemv", rows, None, None)]
    else:
        assert calls == [("act_and_mul", rows, "silu")]
        assert out is None and not torch.equal(residual, before)


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_gated_mlp_large_intermediate_gates_the_gate_up_output(calls, rows: int) -> None:
    mlp = _cpu_mlp(32, 8192)
    x = torch.randn(rows, 32, dtype=torch.bfloat16)
    out = mlp(x, torch.zeros(rows, 32, dtype=torch.bfloat16))
    if rows <= 2:
        assert calls[0] == ("gemv", rows, None, "silu")
        gated = reference.gemv(x, mlp.gate_up_proj.weight, None, None, "silu")
        assert torch.equal(out, reference.gemv(gated, mlp.down_proj.weight))
    else:
        assert ("gemv", rows, None, "silu") not in calls


def test_gated_mlp_stays_in_pytorch_without_the_kernels(calls) -> None:
    """No kernel library on the GPU (or an activation the kernels lack): PyTorch's activation, and the
    down projection returns its product (the caller adds the residual)."""
    torch.manual_seed(2)
    mlp = GatedMLP(64, 96, "silu").to(torch.bfloat16)
    mlp.gate_up_proj.weight.data.normal_(std=64**-0.5)
    mlp.down_proj.weight.data.normal_(std=96**-0.5)
    select_kernels(mlp, lambda device: _target((9, 0), kernels=False))
    assert mlp.kernel_act is None
    x = torch.randn(20, 64, dtype=torch.bfloat16)
    residual = torch.randn(20, 64, dtype=torch.bfloat16)
    gate, up = F.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)
    assert torch.equal(mlp(x, residual), F.linear(F.silu(gate) * up, mlp.down_proj.weight))
    assert calls == []
    relu = GatedMLP(64, 96, "relu").to(torch.bfloat16)
    select_kernels(relu, _sm90)
    assert relu.kernel_act is None


@pytest.mark.parametrize("rows", [0, 1, 2, 3])
def test_logits_by_rows(calls, rows: int) -> None:
    torch.manual_seed(4)
    head = VocabEmbedding(300, 64).to(torch.bfloat16)
    head.weight.data.normal_(std=0.1)
    select_kernels(head, _sm90)
    h = torch.randn(rows, 64, dtype=torch.bfloat16)
    logits = compute_logits(h, head, softcap=30.0)
    assert logits.dtype == torch.float32 and logits.shape == (rows, 300)
    assert calls == ([("gemv", rows, None, None)] if 0 < rows <= 2 else [])
    raw = reference.gemv(h, head.weight) if 0 < rows <= 2 else F.linear(h, head.weight)
    assert torch.equal(logits, raw.float().div(30.0).tanh().mul(30.0))


@pytest.mark.parametrize("rows", [0, 1, 2, 3])
def test_qkv_rotary_by_rows(calls, rows: int) -> None:
    layer = _cpu_linear(64, 3 * 64)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)

    class Rotary:
        is_neox = True

        def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
            return torch.zeros(1, 2)

    got = layer.method.apply_qkv_rotary(layer, x, None, None, Rotary(), None, None, 1)
    assert got == ("q" if 0 < rows <= 2 else None)
    assert calls == ([("gemv_rotary_cache", rows)] if 0 < rows <= 2 else [])


def test_select_kernels_walks_a_model_once_per_device() -> None:
    """Every layer of a model gets its plan, the MLP its activation, and the target is asked once per device."""
    from wllm.model.config import ModelConfig
    from wllm.model.models.llama import LlamaForCausalLM

    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                                  "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 64,
                                  "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    asked = []

    def targets(device: torch.device) -> KernelTarget:
        asked.append(device)
        return _target((9, 0))

    select_kernels(model, targets)
    assert asked == [torch.device("meta")]
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4
    assert all(isinstance(m.method, DenseLinearMethod) and m.method.plan.gemv_rows == 16 for m in linears)
    assert model.model.embed_tokens.method.plan.logits_rows == 2
    assert all(layer.mlp.kernel_act == "silu" for layer in model.model.layers)


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_load_model_selects_kernels_once_the_weights_are_loaded(monkeypatch, tmp_path, load_format: str) -> None:
    from model_utils import tiny_hf_model

    from wllm.model.loader import model_loader

    tiny_hf_model("llama").save_pretrained(tmp_path)
    seen = []
    real = model_loader.select_kernels

    def spy(model: torch.nn.Module) -> None:
        seen.append(model)
        real(model)

    monkeypatch.setattr(model_loader, "select_kernels", spy)
    loaded = model_loader.load_model(tmp_path, load_format=load_format)
    assert seen == [loaded.model]


def test_table_fields_are_the_only_thresholds() -> None:
    """The tables differ only where the GPUs do (the tensor-core skinny GEMM), so their rules stay one."""
    diff = {f.name for f in dataclasses.fields(KernelTable) if getattr(SM70, f.name) != getattr(SM90, f.name)}
    assert diff == {"name", "gemv_mma_max_rows"}
