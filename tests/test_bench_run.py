"""Tiny end-to-end runs of `wllm bench latency|prefill|throughput` on the CPU.

A 2-layer Llama-shaped folder (config.json plus a word-level tokenizer.json) stands in for the
real shapes; each run must finish, report numbers consistent with its own raw timings, and
write a JSON file that `wllm bench report` reads back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wllm.bench import floors
from wllm.bench.report import read_json
from wllm.bench.shapes import resolve_shape, shape_stats
from wllm.entrypoints import bench_cli

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128


@pytest.fixture(scope="module")
def tiny_shape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config))
    # Every model id is a token, so any sampled id detokenizes.
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(
        str(folder / "tokenizer.json"))
    return folder


def _common(folder: Path, out: Path) -> list[str]:
    return ["--shape", str(folder), "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", str(8 << 20),
            "--json", str(out)]


def test_latency_skip_hf(tiny_shape: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    out = tmp_path / "latency.json"
    argv = ["latency", "--prompt-len", "12", "--output-len", "10", "--runs", "2", "--skip-hf"]
    assert bench_cli.main(argv + _common(tiny_shape, out)) == 0
    printed = capsys.readouterr().out
    meta, (r,) = read_json(out)
    assert meta["benchmark"] == "latency" and meta["device"].startswith("CPU")
    assert meta["workload"]["prompt_len"] == 12 and meta["workload"]["output_len"] == 10
    assert r.shape == tiny_shape.name and r.metric == "decode tok/s" and r.hf is None
    d = r.details
    assert len(d["runs_total_s"]) == 2 and len(d["runs_first_token_s"]) == 2
    assert d["end_to_end_s"] > d["first_token_s"] > 0
    # The rate is what the raw timings say: 9 tokens after the first over the extra time.
    assert r.wllm == pytest.approx(9 / (d["end_to_end_s"] - d["first_token_s"]))
    assert 1 < r.wllm < 1e6
    stats = shape_stats(resolve_shape(str(tiny_shape)), "float32")
    assert r.floor == pytest.approx(floors.decode_floor_tok_s(stats, 12, 10))
    assert "target" not in printed and "PASS" not in printed
    assert "| latency" in printed.splitlines()[-2]  # the table comes last (then "wrote ...")


def test_prefill_skip_hf(tiny_shape: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    out = tmp_path / "prefill.json"
    assert bench_cli.main(["prefill", "--prompt-len", "40", "--runs", "3", "--skip-hf"]
                          + _common(tiny_shape, out)) == 0
    _, (r,) = read_json(out)
    times = sorted(r.details["runs_s"])
    assert len(times) == 3 and r.wllm == pytest.approx(40 / times[1])  # the median run
    assert r.floor_note == "compute" and 0 < r.floor_fraction < 1


def test_throughput_skip_hf(tiny_shape: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    out = tmp_path / "throughput.json"
    argv = ["throughput", "--num-requests", "6", "--prompt-len", "10", "--output-len", "5", "--skip-hf",
            "--engine-arg", "max_num_seqs=4"]  # fewer slots than requests: queueing is exercised
    assert bench_cli.main(argv + _common(tiny_shape, out)) == 0
    meta, (r,) = read_json(out)
    assert meta["engine_args"] == {"max_num_seqs": 4}
    assert r.metric == "wall s" and not r.higher_is_better and 0 < r.wllm < 60
    assert r.details["output_tok_s"] == pytest.approx(6 * 5 / r.wllm)
    assert r.floor == pytest.approx(max(r.details["floor_compute_s"], r.details["floor_bandwidth_s"]))
    assert r.details["hf_requests"] is None
    assert r.details["step_budget_tokens"] == 2048  # the engine's resolved default on the CPU
    runs = r.details["runs_s"]  # one batch per run, the median reported
    assert len(runs) == meta["workload"]["runs"] and r.wllm == pytest.approx(sorted(runs)[len(runs) // 2])


def test_latency_with_hf_baseline(tiny_shape: Path, tmp_path: Path) -> None:
    """The HF eager-generate baseline runs on the same device and is labelled when capped."""
    torch.manual_seed(0)
    out = tmp_path / "latency_hf.json"
    argv = ["latency", "--prompt-len", "8", "--output-len", "12", "--runs", "1", "--hf-max-tokens", "6"]
    assert bench_cli.main(argv + _common(tiny_shape, out)) == 0
    meta, (r,) = read_json(out)
    assert "transformers" in meta
    assert r.hf is not None and 1 < r.hf < 1e6
    assert r.hf_note == "eager generate, decode rate over 6 of 12 tokens"
    assert r.vs_hf == pytest.approx(r.wllm / r.hf)


def test_gpu_wrapper_writes_json_to_out(tiny_shape: Path, tmp_path: Path) -> None:
    """benchmarks/gpu_prefill.py passes its options through, writes $OUT/bench_prefill.json and records
    $WLLM_COMMIT (the GPU machine's tree has no .git) as the commit."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "WLLM_COMMIT": "feedbee"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_prefill.py"), "--shape", str(tiny_shape), "--device", "cpu",
         "--dtype", "float32", "--prompt-len", "16", "--runs", "1", "--skip-hf", "--kv-cache-memory", str(8 << 20)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    meta, (r,) = read_json(tmp_path / "bench_prefill.json")
    assert r.bench == "prefill" and r.wllm > 0 and meta["commit"] == "feedbee"
    assert "| prefill" in proc.stdout


def test_wllm_engine_is_freed_before_the_next_model(tiny_shape: Path) -> None:
    """The HF baseline (and the next shape) get the memory back: nothing keeps the engine alive."""
    import weakref

    from wllm.bench.suite import BenchConfig, _with_llm
    from wllm.bench.wllm_runs import EngineOptions

    cfg = BenchConfig(shapes=[], prompt_len=4, output_len=2,
                      engine=EngineOptions(device="cpu", dtype="float32", kv_cache_memory=8 << 20))
    ref, _ = _with_llm(cfg, resolve_shape(str(tiny_shape)), 8, lambda llm: weakref.ref(llm.engine.model))
    assert ref() is None


def test_failing_hf_baseline_keeps_the_wllm_numbers(tiny_shape: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from wllm.bench import hf_runs
    from wllm.bench.suite import BenchConfig, run_latency
    from wllm.bench.wllm_runs import EngineOptions

    def broken(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(hf_runs, "hf_latency", broken)
    lines: list[str] = []
    cfg = BenchConfig(shapes=[str(tiny_shape)], prompt_len=6, output_len=4, runs=1, warmup=0,
                      engine=EngineOptions(device="cpu", dtype="float32", kv_cache_memory=8 << 20), log=lines.append)
    (r,) = run_latency(cfg)
    assert r.wllm > 0 and r.hf is None and r.vs_hf is None
    assert any("HF baseline failed: OutOfMemoryError: CUDA out of memory (simulated)" in ln for ln in lines)
    assert lines[-1].startswith(f"[latency] {tiny_shape.name}: wLLM ")
    assert "HF - (baseline failed: OutOfMemoryError" in lines[-1]
    assert r.hf_note.startswith("baseline failed: OutOfMemoryError")
