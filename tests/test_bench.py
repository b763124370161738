"""`wllm bench` arithmetic and plumbing: shape sizes, hardware floors, table, JSON, CLI.

The floors are checked against figures worked out by hand from the published model sizes
(Llama-3.1-8B bf16 weights 16.06 GB -> 263 tok/s at 4,232 GB/s; Qwen2.5-0.5B 0.99 GB -> 4,280
tok/s; about 3.4 s of compute for 256 x (512 + 128) tokens of the 8B shape at 758 TFLOP/s).
"""

from __future__ import annotations

import json

import pytest

from wllm.bench import floors
from wllm.bench.floors import H200, Hardware
from wllm.bench.report import BenchResult, format_table, format_value, read_json, write_json
from wllm.bench.shapes import ShapeStats, resolve_shape, shape_stats
from wllm.entrypoints import bench_cli
from wllm.model.loader.errors import ModelLoadError


@pytest.fixture(scope="module")
def llama8b() -> ShapeStats:
    return shape_stats(resolve_shape("llama-3.1-8b"), "bfloat16")


@pytest.fixture(scope="module")
def qwen05b() -> ShapeStats:
    return shape_stats(resolve_shape("Qwen2.5-0.5B"), "bfloat16")


def _stats(**kw: int) -> ShapeStats:
    base = {"name": "toy", "num_params": 1000, "dtype_bytes": 2, "num_layers": 2, "num_q_heads": 4,
            "num_kv_heads": 2, "head_dim": 8, "vocab_size": 100}
    base.update(kw)
    return ShapeStats(**base)  # type: ignore[arg-type]


def test_shape_sizes_match_the_published_models(llama8b: ShapeStats, qwen05b: ShapeStats) -> None:
    assert llama8b.num_params == 8_030_261_248  # Llama-3.1-8B, untied LM head
    assert round(llama8b.weight_bytes / 1e9, 2) == 16.06
    assert llama8b.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert qwen05b.num_params == 494_032_768  # tied embeddings counted once, q/k/v biases included
    assert round(qwen05b.weight_bytes / 1e9, 2) == 0.99
    assert qwen05b.kv_bytes_per_token == 2 * 24 * 2 * 64 * 2
    assert shape_stats(resolve_shape("llama-3.1-8b"), "float32").weight_bytes == 2 * llama8b.weight_bytes


def test_unknown_shape_names_the_supported_ones(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="llama-3.1-8b") as err:
        resolve_shape(str(tmp_path / "nowhere"))
    assert "config.json" in str(err.value)


def test_decode_floor(llama8b: ShapeStats, qwen05b: ShapeStats) -> None:
    # Weights only (one token of context): 263 and 4,280 tok/s.
    assert int(floors.decode_floor_tok_s(_weights_only(llama8b), 0, 2)) == 263
    assert round(floors.decode_floor_tok_s(_weights_only(qwen05b), 0, 2), -1) == 4280
    # The standard run adds the KV of 129..383 context tokens per step: slightly lower.
    with_kv = floors.decode_floor_tok_s(llama8b, 128, 256)
    steps = 255
    kv = sum(range(129, 384)) * llama8b.kv_bytes_per_token
    assert with_kv == pytest.approx(steps / ((steps * llama8b.weight_bytes + kv) / 4232e9))
    assert 262 < with_kv < 263.5
    # Twice the bandwidth, twice the floor.
    fast = Hardware("x", bandwidth=2 * H200.bandwidth, flops=H200.flops)
    assert floors.decode_floor_tok_s(llama8b, 128, 256, fast) == pytest.approx(2 * with_kv)


def _weights_only(s: ShapeStats) -> ShapeStats:
    return ShapeStats(s.name, s.num_params, s.dtype_bytes, s.num_layers, s.num_q_heads, 0, s.head_dim, s.vocab_size)


def test_prefill_floor(llama8b: ShapeStats) -> None:
    flops = 2 * 8_030_261_248 * 512 + 4 * (512 * 513 // 2) * 4096 * 32
    assert floors.prefill_flops(llama8b, 512) == pytest.approx(flops)
    floor = floors.prefill_floor_tok_s(llama8b, 512)
    assert floor == pytest.approx(512 / (flops / 758e12))
    assert 46_000 < floor < 47_000


def test_throughput_floor(llama8b: ShapeStats, qwen05b: ShapeStats) -> None:
    big = floors.throughput_floor(llama8b, 256, 512, 128)
    assert big.bound == "compute"
    assert 3.4 <= big.seconds <= 3.6
    small = floors.throughput_floor(qwen05b, 256, 512, 128)
    assert small.bound == "compute" and 0.2 < small.seconds < 0.25
    # By hand on a toy shape: 3 requests, 4 prompt tokens, 3 outputs (2 decode steps).
    s = _stats()
    f = floors.throughput_floor(s, 3, 4, 3, Hardware("unit", bandwidth=1.0, flops=1.0))
    width_layers = 4 * 8 * 2
    attn = 4 * width_layers * ((1 + 2 + 3 + 4) + (5 + 6))
    assert f.compute_s == pytest.approx(3 * (2 * 1000 * 6 + attn))
    kv = 2 * 2 * 2 * 8 * 2
    assert f.bandwidth_s == pytest.approx(3 * 2000 + 3 * (5 + 6) * kv + 3 * 6 * kv)


def _rate(wllm: float, hf: float | None = 15.0, note: str = "") -> BenchResult:
    return BenchResult(bench="latency", shape="llama-3.1-8b", metric="decode tok/s", higher_is_better=True,
                       wllm=wllm, floor=263.0, hf=hf, hf_note=note, floor_note="bandwidth")


def _time(wllm: float) -> BenchResult:
    return BenchResult(bench="throughput", shape="qwen2.5-0.5b", metric="wall s", higher_is_better=False,
                       wllm=wllm, floor=0.22, hf=28.0, floor_note="compute")


def test_result_fraction_and_speedup() -> None:
    assert _rate(131.5).floor_fraction == pytest.approx(0.5)
    assert _rate(150).vs_hf == pytest.approx(10.0)
    assert _rate(150, hf=None).vs_hf is None
    assert _time(0.44).floor_fraction == pytest.approx(0.5)  # floor / time for times
    assert _time(1.4).vs_hf == pytest.approx(20.0)


def test_format_value() -> None:
    assert format_value(262.96, "decode tok/s") == "263"
    assert format_value(46_912.4, "prefill tok/s") == "46,912"
    assert format_value(17.04, "decode tok/s") == "17.0"
    assert format_value(4.789, "wall s") == "4.79"
    assert format_value(0.2171, "wall s") == "0.217"
    assert format_value(0.0000012, "wall s") == "1.20e-06"
    assert format_value(None, "wall s") == "-"


def test_table_rows_columns_and_footnotes() -> None:
    rows = [_rate(231.4, note="decode rate over 64 of 256 tokens"), _rate(90.0, hf=None), _time(1.23),
            _rate(50.0, hf=None, note="baseline failed: OutOfMemoryError")]
    table = format_table(rows)
    lines = table.splitlines()
    assert lines[0].split("|")[1].strip() == "benchmark"
    body = [ln for ln in lines if ln.startswith("|")]
    assert len(body) == 2 + len(rows)
    assert len({len(ln) for ln in body}) == 1  # aligned
    first = [c.strip() for c in body[2].split("|")[1:-1]]
    assert first == ["latency", "llama-3.1-8b", "decode tok/s", "231", "15.0*", "15.43x", "263 (bandwidth)",
                     "88.0%"]
    second = [c.strip() for c in body[3].split("|")[1:-1]]
    assert second[4] == "-" and second[5] == "-" and second[-1] == "34.2%"
    third = [c.strip() for c in body[4].split("|")[1:-1]]
    assert third[3] == "1.23" and third[7] == "17.9%" and len(third) == 8
    assert "target" not in table and "PASS" not in table and "MISS" not in table
    fourth = [c.strip() for c in body[5].split("|")[1:-1]]
    assert fourth[4] == "-**"
    assert lines[-2:] == ["* HF decode rate over 64 of 256 tokens", "** HF baseline failed: OutOfMemoryError"]


def test_json_round_trip_and_report_command(tmp_path, capsys) -> None:
    path = tmp_path / "r.json"
    meta = {"device": "NVIDIA H200", "dtype": "bfloat16", "commit": "abc1234",
            "hardware_floor": {"name": "NVIDIA H200", "bandwidth_bytes_s": 4232e9, "flops": 758e12}}
    write_json(path, [_rate(231.4), _time(0.9)], meta)
    data = json.loads(path.read_text())
    assert data["results"][1]["floor_fraction"] == pytest.approx(0.22 / 0.9)
    assert set(data["results"][0]) == {"bench", "shape", "metric", "higher_is_better", "wllm", "floor", "hf",
                                       "hf_note", "floor_note", "details", "floor_fraction", "vs_hf"}
    meta2, rows = read_json(path)
    assert meta2 == meta and rows[0] == _rate(231.4) and rows[1] == _time(0.9)
    # Files written before the targets left still read (their extra keys are ignored).
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"meta": meta, "results": [{**data["results"][0], "target": 225.0, "status": "PASS"}]}))
    assert read_json(old)[1] == [_rate(231.4)]

    assert bench_cli.main(["report", str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200, bfloat16, commit abc1234" in out and out.count("| throughput") == 2

    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert bench_cli.main(["report", str(bad)]) == 1
    assert "bad.json: not a wllm bench JSON file" in capsys.readouterr().err


def test_cli_parses_each_benchmark() -> None:
    parser = bench_cli.build_parser()
    a = parser.parse_args(["bench", "latency"])
    cfg = bench_cli.build_config(a)
    assert cfg.shapes == ["qwen2.5-0.5b", "llama-3.1-8b"]
    assert (cfg.prompt_len, cfg.output_len, cfg.runs, cfg.hf_max_tokens) == (128, 256, 3, 64)
    assert cfg.engine.dtype == "bfloat16" and cfg.hardware == H200
    a = parser.parse_args(["bench", "prefill", "--skip-hf", "--runs", "7"])
    cfg = bench_cli.build_config(a)
    assert cfg.shapes == ["llama-3.1-8b"] and (cfg.prompt_len, cfg.output_len, cfg.runs) == (512, 1, 7)
    assert cfg.skip_hf
    a = parser.parse_args(["bench", "throughput", "--shape", "qwen3-8b", "--hf-max-requests", "32",
                           "--engine-arg", "max_num_batched_tokens=8192", "--engine-arg", "enable_prefix_caching=false",
                           "--bandwidth-gbs", "3350", "--json", "t.json", "--chart", "t.png", "--commit", "abc1234"])
    cfg = bench_cli.build_config(a)
    assert cfg.shapes == ["qwen3-8b"] and cfg.hf_max_requests == 32
    assert (cfg.num_requests, cfg.prompt_len, cfg.output_len) == (256, 512, 128)
    assert cfg.engine.engine_args == {"max_num_batched_tokens": 8192, "enable_prefix_caching": False}
    assert cfg.hardware.bandwidth == 3350e9 and cfg.hardware.flops == H200.flops
    assert a.json == "t.json" and a.chart == "t.png" and cfg.commit == "abc1234"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "latency", "--runs", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "latency", "--engine-arg", "novalue"])


def test_cli_rejects_bad_input_before_loading(capsys) -> None:
    assert bench_cli.main(["latency", "--skip-hf", "--engine-arg", "warp_speed=9"]) == 1
    err = capsys.readouterr().err
    assert "warp_speed" in err and "max_num_seqs" in err
    assert bench_cli.main(["latency", "--skip-hf", "--shape", "no-such-shape", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "no-such-shape" in err and "qwen2.5-0.5b" in err


def test_chart_needs_matplotlib_or_draws(tmp_path, capsys) -> None:
    png = tmp_path / "c.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        # Fails at once (before minutes of benchmarking) with the install hint.
        assert bench_cli.main(["latency", "--shape", "llama-3.1-8b", "--chart", str(png)]) == 1
        assert "pip install 'wllm-server[bench]'" in capsys.readouterr().err
        assert not png.exists()
        return
    from wllm.bench.report import draw_chart

    draw_chart(png, [_rate(231.4, note="capped"), _rate(90.0, hf=None), _time(1.23)], title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
