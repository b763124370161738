"""Batch-1 decode tok/s (128-token prompt, 256 new tokens, EOS ignored) for the qwen2.5-0.5b
and llama-3.1-8b shapes in bf16: wLLM, HF transformers eager generate, the bandwidth floor.

A thin wrapper of `wllm bench latency`; every option of that command works here. When the
environment variable OUT names a folder (the GPU machine's result folder) and --json is not
given, the results are also written to $OUT/bench_latency.json; WLLM_COMMIT (set by
build_tools/device_run.sh, whose copy of the tree has no .git) becomes --commit.

    python benchmarks/gpu_latency.py [--skip-hf] [--json FILE] [--chart FILE.png] [--help]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from wllm.entrypoints.bench_cli import main  # noqa: E402

if __name__ == "__main__":
    argv = ["latency", *sys.argv[1:]]
    if os.environ.get("OUT") and "--json" not in argv:
        argv += ["--json", str(Path(os.environ["OUT"]) / "bench_latency.json")]
    if os.environ.get("WLLM_COMMIT") and "--commit" not in argv:
        argv += ["--commit", os.environ["WLLM_COMMIT"]]
    sys.exit(main(argv))
