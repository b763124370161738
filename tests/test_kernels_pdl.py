"""Programmatic Dependent Launch (PDL): the decode-path kernels start their prologue while the kernel
before them finishes (sm_90+), and must give the same bits as without it.

One decoder layer's kernel chain -- rms_norm -> gemv (qkv) -> rotary_and_cache -> paged_decode_attention
-> gemv (o) -> fused_add_rms_norm -> gemv (gate_up) -> act_and_mul -> gemv (down), plus the down
projection with the activation fused into gemv -- is captured in a CUDA graph with PDL on and replayed
decode step after decode step (new hidden states, one more token of context each time). Each replay
is compared bit for bit with the same chain run eagerly with PDL off from the same state, and against
the PyTorch references on the CPU. A PDL kernel that read its predecessor's output (q, the newest K/V
row, x) before griddepcontrol.wait would see stale data and differ.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from wllm import kernels
from wllm.engine.cuda_graphs import capture_graph
from wllm.kernels import reference

EPS = 1e-6
STATE = ("x", "residual", "k_cache", "v_cache", "seq_lens", "positions", "slots")


@dataclass(frozen=True)
class Shape:
    """One decode step's sizes. seq_lens of 0 are graph padding rows (slot -1)."""

    hidden: int
    heads: int
    kv_heads: int
    head_size: int
    inter: int
    block_size: int
    max_blocks: int  # block-table width: max_seq_len = max_blocks * block_size
    seq_lens: tuple[int, ...]
    num_splits: int  # 0: automatic; > 0 forces split-KV with the fused merge


SHAPES = [
    # Qwen2.5-0.5B-like batch-1 step: vectorised rms_norm, row-group gemv, one attention CTA per KV head.
    Shape(896, 14, 2, 64, 1216, 16, 8, (37,), 0),
    # Odd sizes: scalar rms_norm and act_and_mul paths, split-K gemv with scalar loads, head size 80,
    # forced splits (fused merge) and a padding row.
    Shape(900, 6, 2, 80, 500, 8, 64, (1, 200, 77, 0), 4),
    # Four rows: row-group gemv with 4 rows, GQA 4:1, head size 128, automatic splits.
    Shape(1024, 8, 2, 128, 1536, 16, 32, (300, 5, 129, 64), 0),
]


@pytest.fixture
def pdl_on() -> Iterator[None]:
    """PDL on for the test, the previous setting restored after it."""
    previous = kernels.set_pdl(True)
    yield
    kernels.set_pdl(previous)


def make_layer(shape: Shape, seed: int, device: str = "cuda") -> dict[str, torch.Tensor]:
    """Random weights (scaled to keep activations O(1)), inputs and a scattered paged cache."""
    gen = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    rows = len(shape.seq_lens)
    hq, hkv, d = shape.heads, shape.kv_heads, shape.head_size

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) * k**-0.5).to(dt)

    num_blocks = rows * shape.max_blocks + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables = order[: rows * shape.max_blocks].view(rows, shape.max_blocks).to(torch.int32)
    t = {
        "x": torch.randn(rows, shape.hidden, generator=gen).to(dt),
        "residual": torch.randn(rows, shape.hidden, generator=gen).to(dt),
        "w_in": (1.0 + 0.1 * torch.randn(shape.hidden, generator=gen)).to(dt),
        "w_post": (1.0 + 0.1 * torch.randn(shape.hidden, generator=gen)).to(dt),
        "w_qkv": w((hq + 2 * hkv) * d, shape.hidden),
        "b_qkv": (0.1 * torch.randn((hq + 2 * hkv) * d, generator=gen)).to(dt),
        "w_o": w(shape.hidden, hq * d),
        "w_gate_up": w(2 * shape.inter, shape.hidden),
        "w_down": w(shape.hidden, shape.inter),
        "k_cache": torch.randn(num_blocks, shape.block_size, hkv, d, generator=gen).to(dt),
        "v_cache": torch.randn(num_blocks, shape.block_size, hkv, d, generator=gen).to(dt),
        "tables": tables,
        "cos_sin": reference.rotary_cos_sin_cache(shape.max_blocks * shape.block_size, d),
        "seq_lens": torch.zeros(rows, dtype=torch.int32),
        "positions": torch.zeros(rows, dtype=torch.int64),
        "slots": torch.zeros(rows, dtype=torch.int64),
    }
    t = {name: value.to(device) for name, value in t.items()}
    set_step(t, shape, list(shape.seq_lens))
    ws = 0
    if device == "cuda":
        ws = kernels.decode_workspace_size(rows, hq, hkv, d, shape.max_blocks * shape.block_size, shape.num_splits)
    t["workspace"] = torch.zeros(max((ws + 3) // 4, 1), dtype=torch.float32, device=device)
    return t


def set_step(t: dict[str, torch.Tensor], shape: Shape, lens: list[int]) -> None:
    """Point the step's inputs at context lengths `lens` (in place: graph replays read these buffers):
    the new token of row r sits at position lens[r] - 1 in the slot its block table gives."""
    tables = t["tables"].cpu()
    slots, positions = [], []
    for r, n in enumerate(lens):
        if n == 0:
            slots.append(-1)
            positions.append(0)
        else:
            p = n - 1
            slots.append(int(tables[r, p // shape.block_size]) * shape.block_size + p % shape.block_size)
            positions.append(p)
    t["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
    t["positions"].copy_(torch.tensor(positions, dtype=torch.int64))
    t["slots"].copy_(torch.tensor(slots, dtype=torch.int64))


def decode_layer(t: dict[str, torch.Tensor], shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer's kernels on t's buffers (the caches and residual are updated in place).
    Returns (mlp output via act_and_mul + gemv, mlp output via gemv with the fused activation)."""
    rows = t["x"].shape[0]
    hq, hkv, d = shape.heads, shape.kv_heads, shape.head_size
    h = kernels.rms_norm(t["x"], t["w_in"], EPS)
    qkv = kernels.gemv(h, t["w_qkv"], t["b_qkv"])
    q = qkv[:, : hq * d].view(rows, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(rows, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(rows, hkv, d)
    kernels.rotary_and_cache(t["positions"], q, k, v, t["k_cache"], t["v_cache"], t["slots"], t["cos_sin"], True)
    attn = kernels.paged_decode_attention(q, t["k_cache"], t["v_cache"], t["tables"], t["seq_lens"], d**-0.5,
                                          max_seq_len=shape.max_blocks * shape.block_size,
                                          num_splits=shape.num_splits, workspace=t["workspace"])
    o = kernels.gemv(attn.reshape(rows, hq * d), t["w_o"])
    kernels.fused_add_rms_norm(o, t["residual"], t["w_post"], EPS)
    gate_up = kernels.gemv(o, t["w_gate_up"])
    down = kernels.gemv(kernels.silu_and_mul(gate_up), t["w_down"])
    down_fused = kernels.gemv(gate_up, t["w_down"], activation="silu")
    return down, down_fused


def clone_state(t: dict[str, torch.Tensor], device: str = "cuda") -> dict[str, torch.Tensor]:
    """A copy of t whose mutable buffers are independent (weights shared), on `device`."""
    out = {name: (value.clone() if name in STATE else value).to(device) for name, value in t.items()}
    if device == "cuda":
        out["workspace"] = torch.zeros_like(t["workspace"])
    return out


def run_eager_without_pdl(t: dict[str, torch.Tensor], shape: Shape) -> tuple[torch.Tensor, ...]:
    """decode_layer with PDL off; returns its outputs and the state it leaves."""
    previous = kernels.set_pdl(False)
    try:
        down, down_fused = decode_layer(t, shape)
        torch.cuda.synchronize()
    finally:
        kernels.set_pdl(previous)
    return down, down_fused, t["residual"], t["k_cache"], t["v_cache"]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s.hidden}-d{s.head_size}-rows{len(s.seq_lens)}")
def test_pdl_graph_matches_eager_without_pdl(shape: Shape, pdl_on: None) -> None:
    """The chain captured with PDL and replayed over several decode steps gives bit-identical outputs,
    residual and caches to the same chain run eagerly without PDL, and matches the CPU references."""
    t = make_layer(shape, seed=3)
    lens = list(shape.seq_lens)
    graph, (down, down_fused) = capture_graph(lambda: decode_layer(t, shape))
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        lens = [n + 1 if n else 0 for n in lens]
        set_step(t, shape, lens)
        t["x"].copy_(torch.randn(t["x"].shape, generator=gen).to(t["x"].dtype))
        before = clone_state(t)
        before_cpu = clone_state(t, "cpu") if step == 0 else None
        graph.replay()
        torch.cuda.synchronize()
        want = run_eager_without_pdl(before, shape)
        got = (down, down_fused, t["residual"], t["k_cache"], t["v_cache"])
        for name, g, w in zip(("down", "down_fused", "residual", "k_cache", "v_cache"), got, want, strict=True):
            assert torch.equal(g, w), f"step {step}: {name} differs with PDL (max diff {(g - w).abs().max()})"
        if before_cpu is not None:
            ref_down, ref_fused = decode_layer(before_cpu, shape)
            torch.testing.assert_close(down.cpu(), ref_down, rtol=6e-2, atol=6e-2)
            torch.testing.assert_close(down_fused.cpu(), ref_fused, rtol=6e-2, atol=6e-2)
            torch.testing.assert_close(t["residual"].cpu(), before_cpu["residual"], rtol=2e-2, atol=2e-2)
            assert down.abs().max() > 0.1  # a chain that collapsed to zeros would match itself


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: f"h{s.hidden}-d{s.head_size}")
def test_pdl_eager_bit_identical(shape: Shape, pdl_on: None) -> None:
    """Eager launches on one stream, PDL on versus off, from the same state: identical bits."""
    t = make_layer(shape, seed=9)
    off = run_eager_without_pdl(clone_state(t), shape)
    down, down_fused = decode_layer(t, shape)
    torch.cuda.synchronize()
    on = (down, down_fused, t["residual"], t["k_cache"], t["v_cache"])
    for g, w in zip(on, off, strict=True):
        assert torch.equal(g, w)


@pytest.mark.cuda
def test_set_pdl_returns_previous_setting(pdl_on: None) -> None:
    assert kernels.set_pdl(False) is True
    assert kernels.set_pdl(False) is False
    assert kernels.set_pdl(True) is False
    assert kernels.set_pdl(True) is True


@pytest.mark.cuda
def test_pdl_starts_on_whatever_the_environment_says() -> None:
    """The library reads no environment: PDL starts on in a fresh process, even with the old WLLM_PDL=0."""
    code = "from wllm import kernels; print(int(kernels.set_pdl(True)))"
    env = dict(os.environ, WLLM_PDL="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1", out.stderr
