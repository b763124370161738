"""Offline throughput: 256 requests of 512 random prompt tokens and 128 output tokens (EOS
ignored), total wall time, for the qwen2.5-0.5b and llama-3.1-8b shapes in bf16: wLLM, HF
transformers generate_batch (capped by --hf-max-requests and extrapolated), the floor.

A thin wrapper of `wllm bench throughput`; every option of that command works here. When the
environment variable OUT names a folder (the GPU machine's result folder) and --json is not
given, the results are also written to $OUT/bench_throughput.json; WLLM_COMMIT (set by
build_tools/device_run.sh, whose copy of the tree has no .git) becomes --commit.

    python benchmarks/gpu_throughput.py [--skip-hf] [--json FILE] [--chart FILE.png] [--help]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from wllm.entrypoints.bench_cli import main  # noqa: E402

if __name__ == "__main__":
    argv = ["throughput", *sys.argv[1:]]
    if os.environ.get("OUT") and "--json" not in argv:
        argv += ["--json", str(Path(os.environ["OUT"]) / "bench_throughput.json")]
    if os.environ.get("WLLM_COMMIT") and "--commit" not in argv:
        argv += ["--commit", os.environ["WLLM_COMMIT"]]
    sys.exit(main(argv))
