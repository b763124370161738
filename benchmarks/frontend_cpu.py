"""The serving front end's own cost: server CPU time per streamed token, with no model.

Runs the real HTTP app (Litestar on uvicorn, auth guard, metrics, SSE) and the real `AsyncEngine` hand-off in
this process over `FloodEngine`, which gives every running request one token per step ("t") and sleeps `--step-ms`
per step (no GIL held, like a GPU step). `serve_load.py`'s streaming clients run in `--procs` spawned
processes, so this process's CPU time over a level (`time.process_time()`: event loop + engine thread) is
the front end's alone; with `--engine-process` the stand-in runs in a spawned child, as the real engine
does on CUDA, and the number is the server process's share. On a busy serving host that CPU time, not the
GPU, bounds throughput at high concurrency (benchmarks/RESULTS.md): the number to watch when the
request path changes.

    python benchmarks/frontend_cpu.py --levels 16,64 --requests-per-client 16
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import uvicorn
from serve_load import run_level_procs

from wllm.engine.async_engine import AsyncEngine
from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.config import ServerConfig

# The model-free stand-in engine is a test double: it lives in the repository's tests/, not in the package.
# The spawned engine process inherits this sys.path, so it finds the factory there too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fake_engine import FloodEngine  # noqa: E402


def start_server(step_ms: float, process: bool, http: str) -> tuple[uvicorn.Server, threading.Thread, AsyncEngine, str]:
    if process:  # the stand-in engine in a spawned child, as `wllm serve` runs the real one on CUDA
        from wllm.engine.engine_process import EngineProcess

        engine = AsyncEngine(EngineProcess("flood", {"step_delay": step_ms / 1000}, engine_factory=FloodEngine.create))
    else:
        engine = AsyncEngine(FloodEngine(step_delay=step_ms / 1000))
    engine.start()
    app = create_app(engine, ServerConfig(served_model_names=["flood"]))
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False, loop="asyncio",
                            http=http, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit("the server thread exited before it was ready")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, engine, f"http://127.0.0.1:{port}/v1"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="16,64", help="comma-separated client counts")
    p.add_argument("--requests-per-client", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=5.0, help="the stand-in engine's step time")
    p.add_argument("--procs", type=int, default=2, help="client processes (never this one)")
    p.add_argument("--engine-process", action="store_true",
                   help="run the stand-in engine in its own process (its CPU time is then not counted)")
    p.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"],
                   help="uvicorn's HTTP implementation (auto, as `wllm serve`: httptools when installed)")
    args = p.parse_args(argv)

    server, thread, engine, base_url = start_server(args.step_ms, args.engine_process, args.http)
    pool = ProcessPoolExecutor(max(1, args.procs), mp_context=multiprocessing.get_context("spawn"))
    try:
        run_level_procs(pool, args.procs, base_url, "flood", 4, 8, args.max_tokens)  # warm-up
        print("| clients | requests | errors | output tok/s | server CPU us / token | server CPU ms / request |")
        print("|---:|---:|---:|---:|---:|---:|")
        for level in (int(x) for x in args.levels.split(",")):
            n = level * args.requests_per_client
            cpu = time.process_time()
            result = run_level_procs(pool, args.procs, base_url, "flood", level, n, args.max_tokens)
            cpu = time.process_time() - cpu
            row = result.summary()
            tokens = max(1, sum(r.tokens for r in result.results))
            print(f"| {level} | {n} | {row['errors']} | {row['output_tok_s']:.0f} | {cpu / tokens * 1e6:.1f} "
                  f"| {cpu / n * 1e3:.2f} |", flush=True)
    finally:
        pool.shutdown()
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown(close_engine=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
