"""Does the offline batch's speed depend on the random weights' distribution? (H200: the big GEMMs run
power-capped, and tensor-core power depends on the operands' bits.)

Our dummy loader fills matrices with normal(0, 0.02) (close to trained Llama weights); vLLM's fills
every parameter with uniform(-1e-3, 1e-3). This builds the engine once, re-initialises its matrices in
place with each distribution in turn (CUDA graphs keep the same pointers) and times the issue's offline
batch (256 x (512 + 128), greedy, EOS ignored) and one large GEMM, while nvidia-smi samples the SM clock
and the board power.

    python benchmarks/weight_init_effect.py [--shape llama-3.1-8b] [--runs 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from wllm.bench.shapes import resolve_shape  # noqa: E402
from wllm.bench.wllm_runs import EngineOptions, PromptSource, build_llm, timed_generate  # noqa: E402

INITS = {
    "normal(0, 0.02)": lambda p, g: p.normal_(0.0, 0.02, generator=g),
    "uniform(-1e-3, 1e-3)": lambda p, g: p.uniform_(-1e-3, 1e-3, generator=g),
}


@torch.no_grad()
def reinit(model: torch.nn.Module, init: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for param in model.parameters():
        if param.ndim >= 2:
            INITS[init](param, gen)


def gemm_ms(dtype: torch.dtype, init: str) -> float:
    """One prefill-sized gate_up GEMM (8,192 x 28,672 x 4,096) with operands of `init`, ms per call."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = INITS[init](torch.empty(28672, 4096, device="cuda", dtype=dtype), gen)
    x = torch.randn(8192, 4096, device="cuda", dtype=dtype, generator=gen)
    for _ in range(5):
        torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 50 * 1e3


def smi_window(samples: list[tuple[float, float, float]], t0: float, t1: float) -> str:
    inside = [(c, p) for t, c, p in samples if t0 <= t <= t1]
    if not inside:
        return "no nvidia-smi samples"
    return (f"SM clock {statistics.mean(c for c, _ in inside):.0f} MHz, "
            f"power {statistics.mean(p for _, p in inside):.0f} W ({len(inside)} samples)")


def read_smi(path: Path) -> list[tuple[float, float, float]]:
    rows = []
    for line in path.read_text().splitlines():
        parts = [s.strip() for s in line.split(",")]
        try:
            stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((stamp, float(parts[1].split()[0]), float(parts[2].split()[0])))
        except (ValueError, IndexError):
            continue
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--smi-log", type=Path, default=Path("/tmp/weight_init_smi.csv"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    shape = resolve_shape(args.shape)
    llm = build_llm(shape, EngineOptions(), 512 + 128)
    # Fresh prompts for every batch: a repeated prompt would hit the prefix cache and skip its prefill.
    source = PromptSource(shape.hf_config["vocab_size"], 0)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader",
                            "-lms", "100"], stdout=args.smi_log.open("w"), stderr=subprocess.DEVNULL)
    windows = []
    try:
        for init in (*INITS, next(iter(INITS))):  # the first again: drift between rounds
            reinit(llm.engine.model, init)
            timed_generate(llm, source.take(256, 512), 128)  # warm-up
            t0 = time.time()
            runs = [timed_generate(llm, source.take(256, 512), 128) for _ in range(args.runs)]
            t1 = time.time()
            ms = gemm_ms(torch.bfloat16, init)
            t2 = time.time()
            windows.append((init, runs, t0, t1, ms, t2))
    finally:
        smi.terminate()
        smi.wait()
    samples = read_smi(args.smi_log)
    print(f"{args.shape}: 256 x (512 + 128), bf16")
    for init, runs, t0, t1, ms, t2 in windows:
        tflops = 2 * 8192 * 28672 * 4096 / ms / 1e9
        print(f"{init:22s} batch {' / '.join(f'{r:.3f}' for r in runs)} s ({smi_window(samples, t0, t1)}); "
              f"gate_up GEMM {ms:.3f} ms = {tflops:.0f} TFLOP/s ({smi_window(samples, t1, t2)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
