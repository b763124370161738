"""How much a per-shape choice among cuBLASLt's algorithms would gain over torch's default GEMM.

For each projection of a model shape and each M, asks cuBLASLt's heuristic for up to --algos algorithms
(y = x @ W.T, bf16 in and out, fp32 accumulation), times every one that runs and torch's F.linear from a
CUDA graph (weights rotated past L2, as gemm_shapes.py does), checks each against F.linear, and prints
the default, the best algorithm (its tile, split-K and waves) and the gain. Calls cuBLASLt through ctypes
on the library torch itself loaded.

    python benchmarks/cublaslt_algos.py [--shape llama-3.1-8b] [--m 240,256] [--algos 32]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from wllm.bench.timing import graph_us

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_shapes import L2_BYTES, projections  # noqa: E402

CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF = 68, 0, 14
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE = 1
CONFIG_ID, CONFIG_TILE_ID, CONFIG_SPLITK, CONFIG_STAGES = 0, 1, 2, 6
WORKSPACE = 32 << 20


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_cublaslt() -> ctypes.CDLL:
    roots = [Path(torch.__file__).parent / "lib"] + [Path(p) / "nvidia" for p in sys.path if p]
    for root in roots:
        for path in sorted(glob.glob(str(root / "**" / "libcublasLt.so*"), recursive=True)):
            return ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    return ctypes.CDLL("libcublasLt.so")


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: cublas status {status}")


class Lt:
    def __init__(self) -> None:
        self.lib = load_cublaslt()
        self.handle = ctypes.c_void_p()
        check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")

    def problem(self, m: int, n: int, k: int):
        """Descriptors of y[M, N] = x[M, K] @ W[N, K].T in column-major terms: y^T = W^T(op T) x^T."""
        lib = self.lib
        op = ctypes.c_void_p()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(op), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        t, nn = ctypes.c_int(1), ctypes.c_int(0)
        check(lib.cublasLtMatmulDescSetAttribute(op, DESC_TRANSA, ctypes.byref(t), 4), "transa")
        check(lib.cublasLtMatmulDescSetAttribute(op, DESC_TRANSB, ctypes.byref(nn), 4), "transb")
        a, b, c = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        u64, i64 = ctypes.c_uint64, ctypes.c_int64
        check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(a), CUDA_R_16BF, u64(k), u64(n), i64(k)), "A")
        check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(b), CUDA_R_16BF, u64(k), u64(m), i64(k)), "B")
        check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(c), CUDA_R_16BF, u64(n), u64(m), i64(n)), "C")
        return op, a, b, c

    def heuristics(self, prob, count: int) -> list[Heuristic]:
        op, a, b, c = prob
        pref = ctypes.c_void_p()
        check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(WORKSPACE)
        check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(ws), 8), "ws")
        results = (Heuristic * count)()
        got = ctypes.c_int(0)
        check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, op, a, b, c, c, pref, count, results,
                                                       ctypes.byref(got)), "heuristic")
        return [results[i] for i in range(got.value) if results[i].state == 0]

    def config(self, algo: Algo) -> str:
        vals = []
        for attr in (CONFIG_ID, CONFIG_TILE_ID, CONFIG_SPLITK, CONFIG_STAGES):
            v, written = ctypes.c_int32(0), ctypes.c_size_t(0)
            self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), 4,
                                                          ctypes.byref(written))
            vals.append(v.value)
        return "id{} tile{} sk{} st{}".format(*vals)

    def matmul(self, prob, h: Heuristic, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        op, a, b, c = prob
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(self.lib.cublasLtMatmul(self.handle, op, ctypes.byref(one), ctypes.c_void_p(w.data_ptr()), a,
                                      ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(zero),
                                      ctypes.c_void_p(y.data_ptr()), c, ctypes.c_void_p(y.data_ptr()), c,
                                      ctypes.byref(h.algo), ctypes.c_void_p(self.workspace.data_ptr()),
                                      ctypes.c_size_t(WORKSPACE), stream), "matmul")


def tune_one(lt: Lt, ws: list[torch.Tensor], m: int, algos: int) -> tuple[float, list]:
    """F.linear's us and [(us, index, heuristic)] of every algorithm that runs and is right, at M = m."""
    n, k = ws[0].shape
    x = torch.randn(m, k, device="cuda", dtype=ws[0].dtype)
    ys = [torch.empty(m, n, device="cuda", dtype=x.dtype) for _ in ws]
    want = F.linear(x, ws[0]).float()
    base = graph_us(lambda: [F.linear(x, w) for w in ws], len(ws))
    prob = lt.problem(m, n, k)
    timed = []
    for i, h in enumerate(lt.heuristics(prob, algos)):
        try:
            lt.matmul(prob, h, x, ws[0], ys[0])
            torch.cuda.synchronize()
            err = (ys[0].float() - want).abs().max().item()
            if not err <= 0.05 * want.abs().max().item():
                print(f"      algo {i} wrong: max err {err:.3g}")
                continue
            us = graph_us(lambda h=h: [lt.matmul(prob, h, x, w, y) for w, y in zip(ws, ys)], len(ws))
        except RuntimeError as exc:
            print(f"      algo {i}: {exc}")
            continue
        timed.append((us, i, h))
    return base, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--m", default="240,256")
    parser.add_argument("--algos", type=int, default=32)
    parser.add_argument("--skip", default="lm_head", help="projections to leave out (comma list)")
    args = parser.parse_args()
    lt = Lt()
    dtype = torch.bfloat16
    skip = set(args.skip.split(","))
    projs = {k: v for k, v in projections(args.shape).items() if k not in skip}
    print(f"{args.shape}, bf16, up to {args.algos} cuBLASLt heuristic algorithms per shape; us per call (graph)")
    print(f"{'M':>5} {'proj':>8} {'F.linear':>9} {'lt #0':>8} {'best':>8} {'gain':>6}  best config (waves)  #ok")
    totals: dict[int, list[float]] = {}
    for name, (n, k) in projs.items():
        copies = max(1, -(-2 * L2_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
        for m in (int(v) for v in args.m.split(",")):
            base, timed = tune_one(lt, ws, m, args.algos)
            if not timed:
                print(f"{m:>5} {name:>8} {base:>9.1f}  no cuBLASLt algorithm ran")
                continue
            first = next((us for us, i, _ in timed if i == 0), float("nan"))
            best_us, best_i, best_h = min(timed, key=lambda t: t[0])
            print(f"{m:>5} {name:>8} {base:>9.1f} {first:>8.1f} {best_us:>8.1f} {base / best_us:>5.2f}x  "
                  f"#{best_i} {lt.config(best_h.algo)} ({best_h.waves:.2f})  {len(timed)}")
            tot = totals.setdefault(m, [0.0, 0.0])
            tot[0] += base
            tot[1] += best_us
    for m, (base, best) in totals.items():
        print(f"M = {m}: layer {base:.1f} us with F.linear, {best:.1f} us with the best algorithms "
              f"({base / best:.2f}x)")


if __name__ == "__main__":
    main()
