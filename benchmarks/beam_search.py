"""Beam search throughput against plain greedy decoding (n = 1) on the same model, prompts and lengths.

Workload: N random prompts of P tokens, each generating exactly O tokens (EOS ignored, so every beam runs to the
end). Greedy runs them through `LLM.generate`; beam search through `LLM.beam_search` with width W. Reported per
mode: wall time, requests/s, and tokens/s counted two ways: tokens decoded (N x O for greedy, N x W x O for the
beams, what the GPU computes) and tokens returned (N x O both: the best beam only).

    # GPU, random weights in real shapes (the lead's run):
    python benchmarks/beam_search.py --shape qwen2.5-0.5b --shape llama-3.1-8b
    # CPU, the embedded SmolLM2-135M-Instruct:
    python benchmarks/beam_search.py --model default --device cpu --dtype float32 --threads 1 --num-prompts 4 \\
        --prompt-len 64 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def bench(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from wllm.entrypoints.llm import LLM
    from wllm.sampling_params import BeamSearchParams, SamplingParams

    engine_args: dict[str, Any] = {"device": args.device, "dtype": args.dtype}
    if args.kv_cache_memory:
        engine_args["kv_cache_memory"] = args.kv_cache_memory
    if name == "default":
        llm = LLM(**engine_args)
    else:
        llm = LLM(name, load_format=args.load_format, **engine_args)
    vocab = llm.engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    beams = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    llm.beam_search(prompts[:1], BeamSearchParams(beam_width=args.beam_width, max_tokens=2, ignore_eos=True))
    times: dict[str, list[float]] = {"greedy": [], "beam": []}
    for _ in range(args.repeats):  # alternating, so that drift on a shared machine hits both alike
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy)
        times["greedy"].append(time.perf_counter() - start)
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        start = time.perf_counter()
        found = llm.beam_search(prompts, beams)
        times["beam"].append(time.perf_counter() - start)
        assert all(len(o.sequences) == args.beam_width for o in found)
    stats = llm.engine.stats()
    llm.close()
    n, o, w = args.num_prompts, args.output_len, args.beam_width
    result: dict[str, Any] = {"model": name, "num_prompts": n, "prompt_len": args.prompt_len, "output_len": o,
                              "beam_width": w, "preemptions": stats["num_preemptions"]}
    for mode, decoded in (("greedy", n * o), ("beam", n * w * o)):
        t = sorted(times[mode])[len(times[mode]) // 2]
        result[mode] = {"seconds": t, "requests_per_s": n / t, "decoded_tokens_per_s": decoded / t,
                        "returned_tokens_per_s": n * o / t}
    result["beam_time_over_greedy"] = result["beam"]["seconds"] / result["greedy"]["seconds"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", default=[], help="a named shape (random weights) or an HF folder")
    ap.add_argument("--model", action="append", default=[], help="a real model: a path, or 'default' (SmolLM2)")
    ap.add_argument("--load-format", default="dummy", help="for --shape (default: dummy)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-memory", type=int, default=0, help="bytes of KV cache (0: the engine's default)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.shape + args.model or ["qwen2.5-0.5b", "llama-3.1-8b"]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else platform.processor()
    print(f"commit {_commit()}, {gpu}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    results = []
    for name in names:
        if name in args.model:
            saved, args.load_format = args.load_format, "auto"
            r = bench(name, args)
            args.load_format = saved
        else:
            r = bench(name, args)
        results.append(r)
        print(f"\n{name}: {r['num_prompts']} prompts x {r['prompt_len']} + {r['output_len']} tokens, "
              f"beam width {r['beam_width']} ({r['preemptions']} preemptions)")
        print(f"{'mode':<8}{'seconds':>10}{'req/s':>10}{'decoded tok/s':>16}{'returned tok/s':>16}")
        for mode in ("greedy", "beam"):
            m = r[mode]
            print(f"{mode:<8}{m['seconds']:>10.3f}{m['requests_per_s']:>10.2f}{m['decoded_tokens_per_s']:>16.1f}"
                  f"{m['returned_tokens_per_s']:>16.1f}")
        print(f"beam search takes {r['beam_time_over_greedy']:.2f}x the greedy time")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
