"""benchmarks/serve_load.py against an in-process uvicorn server running the scripted engine."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fake_engine import ScriptedEngine

from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.config import ServerConfig

ROOT = Path(__file__).resolve().parents[1]


def load_bench() -> Any:
    """Import benchmarks/serve_load.py (benchmarks/ is not a package)."""
    if "serve_load" in sys.modules:
        return sys.modules["serve_load"]
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "benchmarks" / "serve_load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


class _ThreadServer(uvicorn.Server):
    ready = threading.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        self.ready.set()


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    app = create_app(ScriptedEngine(max_model_len=512), ServerConfig(served_model_names=["tiny"]))
    server = _ThreadServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False,
                                          loop="asyncio", http="h11"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert server.ready.wait(timeout=30)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=30)


def test_run_level_measures_every_request(base_url: str) -> None:
    bench = load_bench()
    result = asyncio.run(bench.run_level(base_url, "tiny", concurrency=4, n_requests=8, max_tokens=12))
    assert len(result.results) == 8 and all(r.error is None for r in result.results)
    assert all(r.tokens == 12 and len(r.gaps) == 11 for r in result.results)  # ignore_eos: exactly max_tokens
    summary = result.summary()
    assert summary["errors"] == 0 and summary["output_tok_s"] > 0
    assert 0 < summary["ttft_p50_ms"] <= summary["ttft_p95_ms"] <= summary["ttft_p99_ms"]
    assert "| 4 | 8 | 0 |" in bench.format_table([summary])


def test_errors_are_counted_not_raised(base_url: str) -> None:
    bench = load_bench()
    result = asyncio.run(bench.run_level(base_url, "no-such-model", concurrency=2, n_requests=2, max_tokens=4))
    assert [r.error.startswith("HTTP 404") for r in result.results] == [True, True]
    assert result.summary()["errors"] == 2


def test_percentile_nearest_rank() -> None:
    bench = load_bench()
    assert bench.pct([], 50) == 0.0
    assert bench.pct([3.0, 1.0, 2.0], 50) == 2.0
    assert bench.pct(list(range(1, 101)), 99) == 99
    assert bench.pct([5.0], 99) == 5.0


def test_server_side_percentiles_come_from_the_servers_histograms(base_url: str, tmp_path: Path) -> None:
    """Each level also reports the server's own TTFT and inter-token percentiles, from its /metrics
    histograms read before and after the level (bucket upper bounds)."""
    import json

    bench = load_bench()
    out = tmp_path / "load.json"
    assert bench.main(["--base-url", base_url, "--levels", "2,3", "--requests-per-client", "2", "--max-tokens", "6",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["levels"]
    assert [r["requests"] for r in rows] == [4, 6]
    for r in rows:
        assert r["server_ttft_p50_ms"] is not None and 0 < r["server_ttft_p50_ms"] <= r["server_ttft_p95_ms"]
        assert r["server_itl_p95_ms"] is not None
    root = base_url.removesuffix("/v1")
    before = bench.server_histograms(root, {})
    delta = bench.histogram_delta(before, bench.server_histograms(root, {}))
    assert delta is not None and delta[bench.TTFT_METRIC][float("inf")] == 0  # nothing ran in between


def test_bucket_percentiles() -> None:
    bench = load_bench()
    buckets = {0.005: 2.0, 0.05: 9.0, 0.5: 10.0, float("inf"): 10.0}
    assert bench.bucket_pct(buckets, "p50") == 50.0 and bench.bucket_pct(buckets, "p95") == 500.0
    assert bench.bucket_pct({0.1: 1.0, float("inf"): 2.0}, "p95") == float("inf")
    assert bench.bucket_pct({}, "p50") is None and bench.bucket_pct({float("inf"): 0.0}, "p50") is None
    assert bench.server_histograms("http://127.0.0.1:9", {}) is None  # nothing listening: no engine numbers


def test_clients_spread_over_processes(base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """--procs: a level's clients and requests split over spawned processes, every request measured once,
    the wall from the first start to the last end; the command line path too."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    bench = load_bench()
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the spawned workers import serve_load by name
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        result = bench.run_level_procs(pool, 2, base_url, "tiny", concurrency=3, n_requests=7, max_tokens=5)
    assert result.requests == 7 and len(result.results) == 7
    assert all(r.error is None and r.tokens == 5 for r in result.results)
    assert result.wall > 0 and result.summary()["output_tok_s"] > 0
    assert bench.main(["--base-url", base_url, "--levels", "2", "--requests-per-client", "1", "--max-tokens", "3",
                       "--procs", "2"]) == 0
    assert [bench.default_procs(n) for n in (None, 1, 2, 3, 8, 16, 64)] == [1, 1, 1, 1, 4, 8, 8]


@pytest.mark.parametrize("mode", [[], ["--engine-process"]])
def test_frontend_cpu_reports_the_servers_cpu_per_token(mode: list[str]) -> None:
    """benchmarks/frontend_cpu.py end to end, in a fresh interpreter (it spawns its clients and, with
    --engine-process, the stand-in engine's process): one row per level, every request served."""
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "frontend_cpu.py"), "--levels", "2,3",
                           "--requests-per-client", "2", "--max-tokens", "5", "--procs", "1", *mode],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[0].strip() for r in rows[1:]] == ["2", "3"]
    for r in rows[1:]:
        requests, errors, tok_s, cpu_us = int(r[1]), int(r[2]), float(r[3]), float(r[4])
        assert requests == int(r[0]) * 2 and errors == 0 and tok_s > 0 and cpu_us > 0
