"""What does a read-only stream reach on this GPU? The decode-attention kernel reads the KV cache and
writes little, so its ceiling is the read bandwidth, not the copy bandwidth (4,232 GB/s on the H200).
4 GiB of bf16, each variant a CUDA graph of one call: a Triton streaming read (several tile shapes, if
Triton is installed), torch.sum, torch.amax, a row-wise sum, and a graph-captured copy_ (a memcpy node:
the copy engines, slower than a copy kernel; shown only so that it is not mistaken for a ceiling)."""

import torch

from wllm.bench.timing import graph_us

x = torch.randn((2 << 30) // 1024, 1024, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
nbytes = x.numel() * x.element_size()
rows = [
    ("copy_ (graph memcpy node)", lambda: y.copy_(x), 2 * nbytes),
    ("torch.sum, fp32", lambda: torch.sum(x, dtype=torch.float32), nbytes),
    ("torch.amax", lambda: torch.amax(x), nbytes),
    ("sum over rows", lambda: x.sum(dim=1), nbytes),
]
try:
    import triton
    import triton.language as tl

    @triton.jit
    def _read(x_ptr, o_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        base = pid.to(tl.int64) * BLOCK * ITERS
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(o_ptr + pid, tl.sum(acc))

    flat = x.view(-1)
    for block, iters in [(4096, 16), (8192, 8), (2048, 32)]:
        grid = triton.cdiv(flat.numel(), block * iters)
        part = torch.empty(grid, device="cuda")

        def call(block=block, iters=iters, grid=grid, part=part):
            _read[(grid,)](flat, part, flat.numel(), BLOCK=block, ITERS=iters)

        call()  # compile outside the graph
        rows.append((f"triton read {block} x {iters}", call, nbytes))
except ImportError:
    print("no triton: the streaming-read rows are left out")
for label, fn, moved in rows:
    us = graph_us(fn, calls=1)
    print(f"{label:28} {us:10.1f} us {moved / us / 1e3:8.0f} GB/s")
