"""`wllm bench latency|prefill|throughput|report`: wLLM against HF transformers and the hardware floor.

Random weights in real model shapes (`load_format="dummy"`), so nothing is downloaded. Each run
prints, per shape, wLLM's number, HF transformers' number measured in the same process, the
hardware floor (H200: 4,232 GB/s, 758 bf16 TFLOP/s unless overridden) and the fraction of the
floor reached, then a table. `report` merges JSON files from earlier runs into one table and
chart (e.g. on a machine that has matplotlib).

    wllm bench latency                       # batch-1 decode, qwen2.5-0.5b and llama-3.1-8b
    wllm bench prefill                       # one 512-token prompt, llama-3.1-8b
    wllm bench throughput --json t.json      # 256 x (512 prompt + 128 output) tokens
    wllm bench report l.json p.json t.json --chart bench.png
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from wllm.model.loader.presets import DUMMY_QUANTIZATIONS

_DEFAULTS: dict[str, dict[str, Any]] = {
    "latency": {"shapes": ["qwen2.5-0.5b", "llama-3.1-8b"], "prompt_len": 128, "output_len": 256,
                "num_requests": 1, "runs": 3, "warmup": 1},
    "prefill": {"shapes": ["llama-3.1-8b"], "prompt_len": 512, "output_len": 1, "num_requests": 1,
                "runs": 5, "warmup": 2},
    "throughput": {"shapes": ["qwen2.5-0.5b", "llama-3.1-8b"], "prompt_len": 512, "output_len": 128,
                   "num_requests": 256, "runs": 3, "warmup": 1},
}
_HELP = {
    "latency": "batch-1 decode tok/s (128-token prompt, 256 new tokens, EOS ignored)",
    "prefill": "prefill tok/s of one 512-token prompt (max_tokens=1)",
    "throughput": "offline wall time: 256 requests x (512 prompt + 128 output tokens)",
}


def parse_engine_arg(text: str) -> tuple[str, Any]:
    """`--engine-arg KEY=VALUE` -> (key, value): the value as JSON where it parses (numbers,
    true/false, null), else the string; dashes in the key become underscores."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--engine-arg wants KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)  # numbers, true/false, null
    except ValueError:
        value = raw
    return key.strip().replace("-", "_"), value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_bench(sub: Any, name: str) -> None:
    d = _DEFAULTS[name]
    p = sub.add_parser(name, help=_HELP[name], description=_HELP[name])
    p.add_argument("--shape", action="append", dest="shapes", default=None, metavar="NAME_OR_FOLDER",
                   help="dummy shape name or HF folder with config.json and tokenizer.json "
                        f"(repeatable; default: {', '.join(d['shapes'])})")
    p.add_argument("--prompt-len", type=_positive, default=d["prompt_len"])
    if name != "prefill":
        p.add_argument("--output-len", type=_positive, default=d["output_len"])
    if name == "throughput":
        p.add_argument("--num-requests", type=_positive, default=d["num_requests"])
        p.add_argument("--hf-max-requests", type=_positive, default=64,
                       help="run HF's generate_batch on at most this many requests and extrapolate (default 64)")
    else:
        p.add_argument("--runs", type=_positive, default=d["runs"], help="timed runs; the median is reported")
    if name == "latency":
        p.add_argument("--hf-max-tokens", type=_positive, default=64,
                       help="HF's decode rate is measured over at most this many new tokens (default 64)")
    p.add_argument("--warmup", type=int, default=d["warmup"], help="untimed warm-up calls before timing")
    p.add_argument("--skip-hf", action="store_true", help="do not run the HF transformers baseline")
    p.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto (default)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--quantization", default=None, choices=DUMMY_QUANTIZATIONS,
                   help="random GGUF blocks of this preset's per-tensor types instead of dense random weights")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                   help="fraction of the GPU wLLM may use (default 0.6; HF runs after wLLM is freed)")
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="KV cache bytes on the CPU")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="engine max_model_len (default: 4096, or the workload's length when longer)")
    p.add_argument("--engine-arg", type=parse_engine_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="any other LLM(...) engine argument, e.g. max_num_batched_tokens=8192 (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and the engine")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="floor bandwidth in GB/s (default H200 4232)")
    p.add_argument("--tflops", type=float, default=None, help="floor bf16 TFLOP/s (default H200 758)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--chart", default=None, metavar="FILE.png", help="draw a bar chart (needs matplotlib)")
    p.add_argument("--commit", default=None, metavar="REV",
                   help="source commit recorded with the results (default: asked of git, else 'unknown')")
    p.set_defaults(func=run, bench=name)


def register(subparsers: Any) -> None:
    """Add `bench` with its subcommands to the `wllm` parser."""
    p = subparsers.add_parser("bench", help="benchmarks: wLLM vs HF transformers vs the hardware floor",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name in _DEFAULTS:
        _add_bench(sub, name)
    rep = sub.add_parser("report", help="merge JSON files from earlier runs into one table (and chart)")
    rep.add_argument("files", nargs="+", metavar="FILE.json")
    rep.add_argument("--chart", default=None, metavar="FILE.png", help="draw a bar chart (needs matplotlib)")
    rep.set_defaults(func=run_report)


def build_config(args: argparse.Namespace) -> Any:
    """BenchConfig from parsed arguments."""
    from wllm.bench.floors import H200, Hardware
    from wllm.bench.suite import BenchConfig
    from wllm.bench.wllm_runs import EngineOptions

    d = _DEFAULTS[args.bench]
    hw = H200
    if args.bandwidth_gbs is not None or args.tflops is not None:
        hw = Hardware("custom",
                      bandwidth=(args.bandwidth_gbs or H200.bandwidth / 1e9) * 1e9,
                      flops=(args.tflops or H200.flops / 1e12) * 1e12)
    from wllm.engine.config import engine_config_from_kwargs

    try:  # an unknown or bad --engine-arg fails now, not after minutes of loading
        engine_config_from_kwargs(**dict(args.engine_arg))
    except TypeError as e:
        raise ValueError(str(e)) from None
    engine = EngineOptions(device=args.device, dtype=args.dtype,
                           gpu_memory_utilization=args.gpu_memory_utilization,
                           kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
                           seed=args.seed, quantization=args.quantization, engine_args=dict(args.engine_arg))
    return BenchConfig(
        shapes=args.shapes or list(d["shapes"]),
        prompt_len=args.prompt_len,
        output_len=getattr(args, "output_len", d["output_len"]),
        num_requests=getattr(args, "num_requests", d["num_requests"]),
        runs=getattr(args, "runs", d["runs"]),
        warmup=max(args.warmup, 0),
        skip_hf=args.skip_hf,
        hf_max_requests=getattr(args, "hf_max_requests", 64),
        hf_max_tokens=getattr(args, "hf_max_tokens", 64),
        hardware=hw,
        engine=engine,
        commit=args.commit,
    )


def _finish(results: list[Any], meta: dict[str, Any], args: argparse.Namespace) -> None:
    from wllm.bench.report import draw_chart, format_table, write_json

    print()
    print(f"{meta.get('device', '?')}, {meta.get('dtype', '?')}, commit {meta.get('commit', '?')}, "
          f"floors: {meta['hardware_floor']['bandwidth_bytes_s'] / 1e9:,.0f} GB/s, "
          f"{meta['hardware_floor']['flops'] / 1e12:,.0f} TFLOP/s ({meta['hardware_floor']['name']})")
    print(format_table(results))
    if getattr(args, "json", None):
        write_json(args.json, results, meta)
        print(f"wrote {args.json}")
    if args.chart:
        draw_chart(args.chart, results, title=f"wLLM vs HF transformers vs floor: {meta.get('device', '')}")
        print(f"wrote {args.chart}")


def run(args: argparse.Namespace) -> int:
    """Run one benchmark; 1 with a message for bad input, a missing model or a missing extra."""
    import torch

    from wllm.bench.report import BenchError, check_chart_support
    from wllm.bench.suite import BENCHMARKS, resolve_device, run_meta
    from wllm.model.config import ConfigError
    from wllm.model.loader import ModelLoadError

    try:
        if args.chart:
            check_chart_support()  # before a run of minutes, not after it
        cfg = build_config(args)
        if not cfg.skip_hf:
            from wllm.bench.hf_runs import require_transformers

            require_transformers()
        device = resolve_device(cfg.engine.device)
        on_h200 = device.type == "cuda" and "H200" in torch.cuda.get_device_name(device)
        if cfg.hardware.name == "NVIDIA H200" and not on_h200:
            print(f"note: the floors are the H200's; this run is on {device} "
                  "(set --bandwidth-gbs / --tflops for another device)", file=sys.stderr)
        results = BENCHMARKS[args.bench](cfg)
        _finish(results, run_meta(cfg, args.bench), args)
    except (ModelLoadError, ConfigError, BenchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def run_report(args: argparse.Namespace) -> int:
    """Print one table (and optionally draw one chart) from JSON files of earlier runs."""
    from wllm.bench.report import BenchError, check_chart_support, read_json

    try:
        if args.chart:
            check_chart_support()
        metas, results = [], []
        for path in args.files:
            meta, rows = read_json(path)
            metas.append(meta)
            results.extend(rows)
        _finish(results, metas[0], args)
    except (BenchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    """A `wllm` parser holding only `bench` (for the standalone entry and tests)."""
    parser = argparse.ArgumentParser(prog="wllm")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (benchmarks/gpu_*.py): `main(["latency", "--skip-hf"])`."""
    args = build_parser().parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
