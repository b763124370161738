"""Prefill tok/s of one 512-token prompt (max_tokens=1), llama-3.1-8b shape in bf16: wLLM,
HF transformers, the compute floor.

A thin wrapper of `wllm bench prefill`; every option of that command works here. When the
environment variable OUT names a folder (the GPU machine's result folder) and --json is not
given, the results are also written to $OUT/bench_prefill.json; WLLM_COMMIT (set by
build_tools/device_run.sh, whose copy of the tree has no .git) becomes --commit.

    python benchmarks/gpu_prefill.py [--skip-hf] [--json FILE] [--chart FILE.png] [--help]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from wllm.entrypoints.bench_cli import main  # noqa: E402

if __name__ == "__main__":
    argv = ["prefill", *sys.argv[1:]]
    if os.environ.get("OUT") and "--json" not in argv:
        argv += ["--json", str(Path(os.environ["OUT"]) / "bench_prefill.json")]
    if os.environ.get("WLLM_COMMIT") and "--commit" not in argv:
        argv += ["--commit", os.environ["WLLM_COMMIT"]]
    sys.exit(main(argv))
