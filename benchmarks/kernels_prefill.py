"""Prefill attention TFLOP/s: wLLM's paged kernel next to torch SDPA's flash and cuDNN backends, same shapes.

Default: one causal sequence of 4,096 tokens with Llama-3.1-8B heads (32 query, 8 KV, head size
128) in bf16. SDPA gets contiguous [1, H, T, D] tensors; wLLM reads K/V through a block table
(block size 16; --scatter shuffles the blocks). FLOPs count only the visible (query, key) pairs:
4 * heads * head_size * pairs. The last column is the fraction of the H200's measured bf16 matmul
rate (758 TFLOP/s, DESIGN.md), prefill attention's compute floor.

    python benchmarks/kernels_prefill.py [--tokens 4096] [--heads 32] [--kv-heads 8] [--head-size 128]
        [--dtype bf16|fp16] [--block-size 16] [--prefix 0] [--seqs 1] [--scatter] [--json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from wllm import kernels
from wllm.bench.floors import H200
from wllm.bench.timing import bench_dtype, cuda_time_ms, kernel_bench_args

MATMUL_FLOOR_TFLOPS = H200.flops / 1e12  # measured ceiling (wllm.bench.floors)


def time_ms(fn, warmup: int = 5, iters: int = 20) -> float:
    return cuda_time_ms(fn, warmup, iters)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "FLASH_ATTENTION"):
    """A callable running an SDPA backend (flash by default) on [B, H, T, D] tensors, and how GQA was
    handled."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)

    def native() -> torch.Tensor:
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    try:
        native()
        return native, "enable_gqa"
    except (RuntimeError, TypeError):
        group = q.shape[1] // k.shape[1]
        k2, v2 = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

        def expanded() -> torch.Tensor:
            with sdpa_kernel(chosen):
                return F.scaled_dot_product_attention(q, k2, v2, is_causal=True)

        return expanded, "K/V repeated per query head"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="new tokens per sequence")
    parser.add_argument("--prefix", type=int, default=0, help="cached tokens before them (prefix hit)")
    parser.add_argument("--seqs", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--scatter", action="store_true", help="shuffle the block table")
    args = kernel_bench_args(parser)

    dtype = bench_dtype(args.dtype)
    dev = "cuda"
    n, pre, s, hq, hkv, d, bs = args.tokens, args.prefix, args.seqs, args.heads, args.kv_heads, args.head_size, \
        args.block_size
    ctx = pre + n
    blocks_per_seq = (ctx + bs - 1) // bs
    scale = d**-0.5

    # Contiguous [B, H, T, D] tensors for SDPA; the paged cache holds the same keys and values.
    q4 = torch.randn(s, hq, n, d, device=dev, dtype=dtype)
    k4 = torch.randn(s, hkv, ctx, d, device=dev, dtype=dtype)
    v4 = torch.randn(s, hkv, ctx, d, device=dev, dtype=dtype)
    num_blocks = s * blocks_per_seq
    order = torch.randperm(num_blocks, device=dev) if args.scatter else torch.arange(num_blocks, device=dev)
    tables = order.view(s, blocks_per_seq).to(torch.int32)
    padded = blocks_per_seq * bs
    k_cache = torch.zeros(num_blocks, bs, hkv, d, device=dev, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    for i in range(s):
        kk = torch.zeros(padded, hkv, d, device=dev, dtype=dtype)
        vv = torch.zeros_like(kk)
        kk[:ctx], vv[:ctx] = k4[i].transpose(0, 1), v4[i].transpose(0, 1)
        k_cache[tables[i].long()] = kk.view(blocks_per_seq, bs, hkv, d)
        v_cache[tables[i].long()] = vv.view(blocks_per_seq, bs, hkv, d)
    q = q4.transpose(1, 2).reshape(s * n, hq, d).contiguous()
    seq_lens = torch.full((s,), ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, (s + 1) * n, n, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)

    def ours() -> torch.Tensor:
        return kernels.paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale, out=out)

    pairs = s * (n * pre + n * (n + 1) // 2)
    flops = 4 * hq * d * pairs
    rows = []
    ms = time_ms(ours)
    hopper = torch.cuda.get_device_capability() == (9, 0) and d in (64, 128)
    rows.append(("wllm paged_prefill_attention" + (" (wgmma)" if hopper else ""), ms, flops / ms / 1e9))
    if hopper:  # the mma.sync kernel other tensor-core GPUs run, for comparison
        wgmma_out = ours().clone()
        previous = kernels.set_prefill_sm90(False)
        try:
            ms_old = time_ms(ours)
            print(f"max |wgmma - mma.sync kernel| = {(ours().float() - wgmma_out.float()).abs().max().item():.3g}")
        finally:
            kernels.set_prefill_sm90(previous)
        rows.append(("wllm paged_prefill_attention (mma.sync)", ms_old, flops / ms_old / 1e9))
    gqa_note = ""
    max_err = None
    if pre == 0:
        fn, gqa_note = sdpa_attention(q4, k4, v4)
        ms_ref = time_ms(fn)
        rows.append((f"torch SDPA flash ({gqa_note})", ms_ref, flops / ms_ref / 1e9))
        ref = fn().transpose(1, 2).reshape(s * n, hq, d)
        max_err = (ours().float() - ref.float()).abs().max().item()
        # cuDNN's attention (Hopper: a wgmma kernel, the bar for a next kernel of ours), where torch has it.
        try:
            fn_cudnn, note = sdpa_attention(q4, k4, v4, "CUDNN_ATTENTION")
            ms_cudnn = time_ms(fn_cudnn)
            rows.append((f"torch SDPA cuDNN ({note})", ms_cudnn, flops / ms_cudnn / 1e9))
        except (RuntimeError, AttributeError) as exc:
            print(f"(torch SDPA cuDNN: not available here: {str(exc).splitlines()[0][:80]})")

    print(f"prefill attention: {s} x {n} new tokens (+{pre} cached), heads {hq}/{hkv}, head size {d}, "
          f"{args.dtype}, block size {bs}{' scattered' if args.scatter else ''}, causal; "
          f"{torch.cuda.get_device_name()}")
    print(f"{'kernel':44s} {'ms':>9s} {'TFLOP/s':>9s} {'of floor':>9s}")
    for name, ms_, tflops in rows:
        print(f"{name:44s} {ms_:9.3f} {tflops:9.1f} {tflops / MATMUL_FLOOR_TFLOPS:9.1%}")
    flash = next((r for r in rows if r[0].startswith("torch SDPA flash")), None)
    if flash is not None:
        print(f"wllm / SDPA flash: {rows[0][2] / flash[2]:.2f}x; max |wllm - SDPA| = {max_err:.3g}")
    if args.json:
        print(json.dumps({"tokens": n, "prefix": pre, "seqs": s, "heads": hq, "kv_heads": hkv, "head_size": d,
                          "dtype": args.dtype, "results": [{"kernel": r[0], "ms": r[1], "tflops": r[2]} for r in rows],
                          "max_abs_diff_vs_sdpa": max_err}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
