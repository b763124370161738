"""Timeline of a batch-1 decode layer's kernels on the GPU, per CTA, from a trace build of the library.

Per-kernel profiler durations overlap under PDL and do not say what waits for what. A library built with
`-DWLLM_TRACE` records, for thread 0 of every CTA of a PDL kernel, %globaltimer when the CTA starts and
when its pdl_wait() returns. This script replays the Llama-3.1-8B decode layer chain (kernels_pdl.py's
`build_chain`: the engine's kernels, with the engine's split-KV sizing for `--max-seq-len`) in a CUDA graph,
reads the records and prints, per kernel of a layer averaged over the middle layers: the first and last
CTA start and the first and last wait release (us from the layer's first CTA). A kernel's work after
its wait ends roughly where the next kernel's wait releases.

    NVCC_APPEND_FLAGS=-DWLLM_TRACE python build_tools/kernel_build.py --archs 9.0 --out /tmp/trace
    WLLM_KERNEL_LIBRARY=/tmp/trace/libwllm_kernels.so python benchmarks/trace_decode_layer.py --context 256
    python benchmarks/trace_decode_layer.py --analyze trace.npy   # a saved trace, no GPU needed

The records' atomic slot counter serialises the CTAs of a wide grid by up to ~2 us, so "last" columns
overstate; "first" columns are exact to the timer's resolution.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

import numpy as np

FAMILIES = {1: "rope", 2: "norm", 4: "gemv", 8: "attn"}
LAYER = ("norm_in", "qkv", "rope", "attention", "o", "norm_post", "gate_up", "down")
TRANSLATION_UNITS = ("gemv", "attn", "norm", "rope")
MAX_RECORDS = 1 << 21


def record(layers: int, context: int, max_seq_len: int) -> np.ndarray:
    """Replay the chain once in a graph (after warm-up) and return the raw records [n, 2] (tag, time)."""
    import torch

    from wllm.engine.cuda_graphs import capture_graph

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernels_pdl import build_chain

    torch.manual_seed(0)
    step, _ = build_chain("llama-3.1-8b", context, layers, max_seq_len=max_seq_len)
    graph, _ = capture_graph(step)
    lib = ctypes.CDLL(os.environ["WLLM_KERNEL_LIBRARY"])
    if not hasattr(lib, "wllm_trace_dump_gemv"):
        raise SystemExit("WLLM_KERNEL_LIBRARY is not a trace build (-DWLLM_TRACE); see the module docstring")
    buf = np.zeros(2 * MAX_RECORDS, dtype=np.uint64)

    def dump() -> np.ndarray:
        parts = []
        for tu in TRANSLATION_UNITS:
            n = getattr(lib, f"wllm_trace_dump_{tu}")(buf.ctypes.data_as(ctypes.c_void_p), MAX_RECORDS)
            parts.append(buf[: 2 * n].reshape(n, 2).copy())
        return np.concatenate(parts)

    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    dump()  # drop the warm-up's records
    graph.replay()
    torch.cuda.synchronize()
    return dump()


def launches(recs: np.ndarray) -> list[dict]:
    """One entry per kernel launch: CTAs of one (family, grid) kind, chunked in time order."""
    tag, t = recs[:, 0], recs[:, 1].astype(np.int64)
    t = t - t.min()
    fam = (tag & 0xFF).astype(int)
    event = ((tag >> 8) & 0xF).astype(int)
    grid = ((tag >> 12) & 0xFFFFF).astype(int)
    block = ((tag >> 32) & 0xFFFF).astype(int)
    split = ((tag >> 48) & 0xFF).astype(int)
    sm = ((tag >> 56) & 0xFF).astype(int)
    out = []
    for f, g in sorted(set(zip(fam.tolist(), grid.tolist()))):
        kind = (fam == f) & (grid == g)
        ctas = len(set(zip(block[kind].tolist(), split[kind].tolist())))
        by_event = []
        for e in (0, 1):
            sel = np.where(kind & (event == e))[0]
            sel = sel[np.argsort(t[sel], kind="stable")]
            by_event.append([sel[i * ctas:(i + 1) * ctas] for i in range(len(sel) // ctas)])
        for starts, waits in zip(*by_event):
            out.append({"family": FAMILIES.get(f, str(f)), "grid": g, "ctas": ctas,
                        "sms": len(set(sm[starts].tolist())),
                        "times": (t[starts].min(), t[starts].max(), t[waits].min(), t[waits].max())})
    return sorted(out, key=lambda r: r["times"][0])


def report(recs: np.ndarray) -> None:
    rows = launches(recs)
    per = len(LAYER)
    layers = len(rows) // per
    if layers < 4:
        raise SystemExit(f"{len(rows)} launches: not a trace of >= 4 layers of {per} kernels")
    mean = np.zeros((per, 4))
    lengths = []
    for li in range(1, layers - 1):
        part = rows[per * li: per * (li + 1)]
        base = part[0]["times"][0]
        mean += np.array([[v - base for v in r["times"]] for r in part])
        lengths.append(rows[per * (li + 1)]["times"][0] - base)
    mean /= (layers - 2) * 1e3
    print(f"{len(recs)} records, {layers} layers; layer length {np.mean(lengths) / 1e3:.2f} us "
          "(mean of the middle layers)")
    print(f"{'kernel':11}{'grid':>6}{'CTAs':>6}{'SMs':>5}" +
          "".join(f"{h:>11}" for h in ("1st start", "last start", "1st wait", "last wait")))
    for name, r, m in zip(LAYER, rows[per: 2 * per], mean):
        print(f"{name:11}{r['grid']:>6}{r['ctas']:>6}{r['sms']:>5}" + "".join(f"{v:11.2f}" for v in m))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=256, help="tokens of context, the new one included")
    parser.add_argument("--max-seq-len", type=int, default=4096, help="sizes the split-KV grid, as the engine's "
                        "max_model_len does")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--save", help="also write the raw records to this .npy file")
    parser.add_argument("--analyze", help="report a saved .npy trace instead of recording one")
    args = parser.parse_args()
    recs = np.load(args.analyze) if args.analyze else record(args.layers, args.context, args.max_seq_len)
    if args.save:
        np.save(args.save, recs)
    report(recs)


if __name__ == "__main__":
    main()
