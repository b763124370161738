"""The three benchmarks, each over a list of shapes: wLLM, then HF, then the floor.

Models are built one at a time and freed before the next (an 8B model and its KV cache leave
little room for a second copy), so wLLM runs first and HF gets the memory afterwards.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wllm.bench import floors
from wllm.bench.floors import H200, Hardware
from wllm.bench.report import BenchResult, format_percent, format_value
from wllm.bench.shapes import Shape, ShapeStats, resolve_shape, shape_stats
from wllm.bench.wllm_runs import (
    EngineOptions,
    PromptSource,
    build_llm,
    release_memory,
    resolve_device,
    wllm_latency,
    wllm_prefill,
    wllm_throughput,
)
from wllm.model.config import parse_dtype


@dataclass
class BenchConfig:
    """One benchmark invocation. `hf_max_tokens` caps HF's batch-1 decode length (its rate is
    measured over fewer tokens); `hf_max_requests` caps HF's throughput run (its time is then
    extrapolated linearly and labelled so)."""

    shapes: list[str]
    prompt_len: int
    output_len: int
    num_requests: int = 1
    runs: int = 3
    warmup: int = 1
    skip_hf: bool = False
    hf_max_requests: int = 64
    hf_max_tokens: int = 64
    hardware: Hardware = H200
    engine: EngineOptions = field(default_factory=EngineOptions)
    commit: str | None = None  # recorded in the JSON; None: asked of git
    log: Callable[[str], None] = field(default=lambda line: print(line, flush=True))


def _prepare(cfg: BenchConfig, name: str) -> tuple[Shape, ShapeStats, PromptSource]:
    shape = resolve_shape(name)
    stats = shape_stats(shape, cfg.engine.dtype)
    return shape, stats, PromptSource(stats.vocab_size, cfg.engine.seed)


def _with_llm(cfg: BenchConfig, shape: Shape, workload_len: int, body: Callable[[Any], Any]) -> tuple[Any, float]:
    """Build wLLM, run `body(llm)`, free it; returns (body's result, build seconds)."""
    start = time.perf_counter()
    llm = build_llm(shape, cfg.engine, workload_len)
    load_s = time.perf_counter() - start
    cfg.log(f"[wllm] {shape.name}: engine built in {load_s:.1f} s on {llm.engine.worker.device}; timing")
    try:
        return body(llm), load_s
    finally:
        del llm
        release_memory()


def _with_hf(cfg: BenchConfig, shape: Shape, attn: str,
             body: Callable[[Any, torch.device], Any]) -> tuple[Any, str]:
    """Build the HF baseline model, run `body(model, device)`, free it; returns (result, "") or
    (None, why). A failing baseline is logged and never throws away the wLLM numbers before it."""
    from wllm.bench.hf_runs import build_hf_model

    device = resolve_device(cfg.engine.device)
    dtype = parse_dtype(cfg.engine.dtype)
    assert dtype is not None
    model = None
    try:
        start = time.perf_counter()
        model = build_hf_model(shape, device, dtype, attn)
        cfg.log(f"[hf] {shape.name}: transformers model ({attn}) built in {time.perf_counter() - start:.1f} s; "
                "timing")
        result = body(model, device)
        cfg.log(f"[hf] {shape.name}: done in {time.perf_counter() - start:.1f} s")
        return result, ""
    except Exception as e:  # noqa: BLE001 -- any HF failure (OOM, API change) only loses the baseline
        why = f"baseline failed: {type(e).__name__}: {e}"
        cfg.log(f"[hf] {shape.name}: the HF {why}")
        return None, why
    finally:
        del model
        release_memory()


def _report(cfg: BenchConfig, r: BenchResult) -> BenchResult:
    hf = ("skipped" if r.hf is None and not r.hf_note else format_value(r.hf, r.metric)) + (
        f" ({r.hf_note})" if r.hf_note else "")
    vs = f", {r.vs_hf:.2f}x HF" if r.vs_hf is not None else ""
    floor = f"floor {format_value(r.floor, r.metric)} {r.metric} -> {format_percent(r.floor_fraction)} of floor"
    cfg.log(f"[{r.bench}] {r.shape}: wLLM {format_value(r.wllm, r.metric)} {r.metric}{vs} | HF {hf} | {floor}")
    return r


def _latency_one(cfg: BenchConfig, name: str) -> BenchResult:
    shape, stats, prompts = _prepare(cfg, name)
    plen, olen = cfg.prompt_len, cfg.output_len
    timing, load_s = _with_llm(cfg, shape, plen + olen,
                               lambda llm: wllm_latency(llm, prompts, plen, olen, cfg.runs, cfg.warmup))
    hf, note, hf_details = None, "", {}
    if not cfg.skip_hf:
        from wllm.bench.hf_runs import hf_latency

        hf_len = min(olen, max(cfg.hf_max_tokens, 2))
        # One timed pair after one warm-up: HF eager decode is steady and slow.
        hf_timing, note = _with_hf(cfg, shape, "sdpa",
                                   lambda m, dev: hf_latency(m, dev, prompts, plen, hf_len, 1, 1))
        if hf_timing is not None:
            hf = hf_timing.decode_tok_s
            hf_details = {"hf_first_token_s": hf_timing.first_token_s, "hf_end_to_end_s": hf_timing.total_s,
                          "hf_output_len": hf_len}
            if hf_len < olen:
                note = f"eager generate, decode rate over {hf_len} of {olen} tokens"
    return BenchResult(
        bench="latency", shape=shape.name, metric="decode tok/s", higher_is_better=True,
        wllm=timing.decode_tok_s, hf=hf, hf_note=note,
        floor=floors.decode_floor_tok_s(stats, plen, olen, cfg.hardware), floor_note="bandwidth",
        details={"end_to_end_s": timing.total_s, "first_token_s": timing.first_token_s,
                 "runs_total_s": timing.runs_total_s, "runs_first_token_s": timing.runs_first_s,
                 "load_s": load_s, "weight_bytes": stats.weight_bytes, "num_params": stats.num_params,
                 **hf_details},
    )


def _prefill_one(cfg: BenchConfig, name: str) -> BenchResult:
    shape, stats, prompts = _prepare(cfg, name)
    plen, warmup = cfg.prompt_len, max(cfg.warmup, 1)
    times, load_s = _with_llm(cfg, shape, plen + 1, lambda llm: wllm_prefill(llm, prompts, plen, cfg.runs, warmup))
    hf, note = None, ""
    if not cfg.skip_hf:
        from wllm.bench.hf_runs import hf_prefill

        hf_times, note = _with_hf(cfg, shape, "sdpa",
                                  lambda m, dev: hf_prefill(m, dev, prompts, plen, cfg.runs, warmup))
        hf = plen / statistics.median(hf_times) if hf_times else None
    return BenchResult(
        bench="prefill", shape=shape.name, metric="prefill tok/s", higher_is_better=True,
        wllm=plen / statistics.median(times), hf=hf, hf_note=note,
        floor=floors.prefill_floor_tok_s(stats, plen, cfg.hardware), floor_note="compute",
        details={"runs_s": times, "load_s": load_s, "flops": floors.prefill_flops(stats, plen),
                 "num_params": stats.num_params},
    )


def _throughput_one(cfg: BenchConfig, name: str) -> BenchResult:
    shape, stats, prompts = _prepare(cfg, name)
    nreq, plen, olen = cfg.num_requests, cfg.prompt_len, cfg.output_len
    # The median of `runs` batches: one batch's wall time varies by tens of percent on a shared host.
    (walls, budget), load_s = _with_llm(
        cfg, shape, plen + olen,
        lambda llm: (wllm_throughput(llm, prompts, nreq, plen, olen, cfg.warmup, cfg.runs),
                     llm.engine.config.scheduler.max_num_batched_tokens))
    wall = statistics.median(walls)
    hf, note, hf_raw, hf_wall, n_hf = None, "", None, None, None
    if not cfg.skip_hf:
        from wllm.bench.hf_runs import hf_throughput

        n_hf = min(nreq, max(cfg.hf_max_requests, 1))
        # No warm-up call: generate_batch warms up inside every call, before the span that counts.
        hf_times, note = _with_hf(cfg, shape, "paged|sdpa",
                                  lambda m, dev: hf_throughput(m, prompts, n_hf, plen, olen, warmup=0))
        if hf_times is not None:
            hf_raw, hf_wall = hf_times
            hf = hf_raw * nreq / n_hf
            note = f"generate_batch, {hf_wall - hf_raw:.1f} s of its cache and graph set-up excluded"
            if n_hf < nreq:
                note += f"; {hf_raw:.2f} s for {n_hf} of {nreq} requests, extrapolated linearly x{nreq / n_hf:g}"
    floor = floors.throughput_floor(stats, nreq, plen, olen, cfg.hardware)
    return BenchResult(
        bench="throughput", shape=shape.name, metric="wall s", higher_is_better=False,
        wllm=wall, hf=hf, hf_note=note, floor=floor.seconds, floor_note=floor.bound,
        details={"output_tok_s": nreq * olen / wall, "total_tok_s": nreq * (plen + olen) / wall,
                 "runs_s": walls, "load_s": load_s, "hf_measured_s": hf_raw, "hf_wall_with_setup_s": hf_wall,
                 "hf_requests": n_hf, "step_budget_tokens": budget,
                 "floor_compute_s": floor.compute_s, "floor_bandwidth_s": floor.bandwidth_s},
    )


def run_latency(cfg: BenchConfig) -> list[BenchResult]:
    """Batch-1 decode tok/s after a `prompt_len` prompt, `output_len` new tokens, EOS ignored."""
    return [_report(cfg, _latency_one(cfg, name)) for name in cfg.shapes]


def run_prefill(cfg: BenchConfig) -> list[BenchResult]:
    """Prompt tok/s for one `prompt_len` prompt with max_tokens=1 (median of runs)."""
    return [_report(cfg, _prefill_one(cfg, name)) for name in cfg.shapes]


def run_throughput(cfg: BenchConfig) -> list[BenchResult]:
    """Wall seconds for `num_requests` random prompts, `output_len` tokens each, submitted at once."""
    return [_report(cfg, _throughput_one(cfg, name)) for name in cfg.shapes]


BENCHMARKS: dict[str, Callable[[BenchConfig], list[BenchResult]]] = {
    "latency": run_latency,
    "prefill": run_prefill,
    "throughput": run_throughput,
}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def git_commit() -> str:
    """The short commit of the source tree wllm runs from, or 'unknown' (an installed wheel, or a
    copy of the tree without .git: pass `--commit` there)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def run_meta(cfg: BenchConfig, bench: str) -> dict[str, Any]:
    """What the JSON file records next to the numbers: when, where, which code, which workload."""
    from wllm.version import __version__

    device = resolve_device(cfg.engine.device)
    meta: dict[str, Any] = {
        "benchmark": bench,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "commit": cfg.commit or git_commit(),
        "wllm": __version__,
        "torch": torch.__version__,
        "dtype": cfg.engine.dtype,
        "workload": {"prompt_len": cfg.prompt_len, "output_len": cfg.output_len,
                     "num_requests": cfg.num_requests, "runs": cfg.runs, "warmup": cfg.warmup},
        "hardware_floor": {"name": cfg.hardware.name, "bandwidth_bytes_s": cfg.hardware.bandwidth,
                           "flops": cfg.hardware.flops},
        "engine_args": dict(cfg.engine.engine_args),
    }
    if not cfg.skip_hf:
        try:
            import transformers

            meta["transformers"] = transformers.__version__
        except ImportError:
            pass
    return meta
