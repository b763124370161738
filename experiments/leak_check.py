"""What an engine leaves allocated on the GPU after it is dropped (session 18).

Builds a Qwen2.5-0.5B-shaped engine (random weights, CUDA graphs), runs one request, drops it, and prints
whether the engine was collected, the CUDA graphs' capture memory, and torch's allocated / reserved bytes;
twice, so a per-engine leak shows as growth. Then lists the CUDA tensors still alive. Session 18 measured
1.07 GiB allocated after the first engine (not growing), matching torch's cuBLAS workspaces for the ~32
pooled streams the per-graph warm-ups had used; 1cccaff gives every warm-up one stream.

    python experiments/leak_check.py
"""

import gc
import sys
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from wllm import LLM, SamplingParams  # noqa: E402

GIB = 2**30

for i in range(2):
    llm = LLM("qwen2.5-0.5b", load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=2048)
    llm.generate([[5, 6, 7] * 20], SamplingParams(max_tokens=8))
    runner = llm.engine.worker.runner
    print(f"round {i}: capture MiB prefill {runner.prefill_graphs.capture_bytes / 2**20:.0f}, "
          f"decode {runner.graphs.capture_bytes / 2**20:.0f}")
    engine = weakref.ref(llm.engine)
    del llm, runner
    gc.collect()
    print(f"round {i}: engine alive after del: {engine() is not None}; allocated "
          f"{torch.cuda.memory_allocated() / GIB:.2f} GiB, reserved {torch.cuda.memory_reserved() / GIB:.2f} GiB")

gc.unfreeze()
gc.collect()
live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
print(f"{len(live)} CUDA tensors alive, {sum(t.numel() * t.element_size() for t in live) / GIB:.2f} GiB")
