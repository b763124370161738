"""The serving front end's own cost: server CPU time per streamed token, with no model.

Runs the real HTTP app (Litestar on uvicorn, auth guard, metrics, SSE) and the real `AsyncEngine` hand-off in
this process over `StepEngine`, which gives every running request one token per step and sleeps `--step-ms`
per step (no GIL held, like a GPU step). `serve_load.py`'s streaming clients run in `--procs` spawned
processes, so this process's CPU time over a level (`time.process_time()`: event loop + engine thread) is
the front end's alone; with `--engine-process` the stand-in runs in a spawned child, as the real engine
does on CUDA, and the number is the server process's share. On a busy serving host that CPU time, not the
GPU, bounds throughput at high concurrency (RESULTS.md, sessions 20-22): the number to watch when the
request path changes.

    python benchmarks/frontend_cpu.py --levels 16,64 --requests-per-client 16
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import uvicorn
from serve_load import run_level_procs

from wllm.engine.async_engine import AsyncEngine
from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.config import ServerConfig
from wllm.entrypoints.openai.fake_engine import CharTokenizer
from wllm.outputs import CompletionOutput, RequestMetrics, RequestOutput


class StepEngine:
    """An `LLMEngine` stand-in: one token (" tok") per running request per step, `delay` s per step."""

    model_source = "step-engine"

    def __init__(self, delay: float) -> None:
        self.tokenizer = CharTokenizer()
        self.max_model_len = 8192
        self.num_failed_steps = 0
        self.delay = delay
        self.running: dict[str, tuple[list[int], list[int], int, float]] = {}

    @classmethod
    def create(cls, model: str, delay: float) -> StepEngine:
        """`EngineProcess`'s engine factory (runs in the child)."""
        return cls(delay)

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.running), "num_waiting": 0, "kv_cache_usage": 0.0}

    def add_request(self, request_id: str, prompt: list[int], params: Any, **_: Any) -> None:
        self.running[request_id] = (list(prompt), [], params.max_tokens, time.monotonic())

    def abort(self, request_id: str) -> RequestOutput | None:
        entry = self.running.pop(request_id, None)
        return None if entry is None else self._output(request_id, entry, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.delay)
        outs = []
        for rid, entry in list(self.running.items()):
            entry[1].append(100)
            done = len(entry[1]) >= entry[2]
            outs.append(self._output(rid, entry, "length" if done else None))
            if done:
                del self.running[rid]
        return outs

    @staticmethod
    def _output(rid: str, entry: tuple[list[int], list[int], int, float], reason: str | None) -> RequestOutput:
        prompt, tokens, _, arrival = entry
        return RequestOutput(request_id=rid, prompt_token_ids=prompt,
                             outputs=[CompletionOutput(0, " tok" * len(tokens), list(tokens), finish_reason=reason)],
                             finished=reason is not None, metrics=RequestMetrics(arrival_time=arrival))

    def close(self) -> None:
        pass


def start_server(step_ms: float, process: bool) -> tuple[uvicorn.Server, threading.Thread, AsyncEngine, str]:
    if process:  # the stand-in engine in a spawned child, as `wllm serve` runs the real one on CUDA
        from wllm.engine.engine_process import EngineProcess

        engine = AsyncEngine(EngineProcess("step-engine", {"delay": step_ms / 1000}, engine_factory=StepEngine.create))
    else:
        engine = AsyncEngine(StepEngine(step_ms / 1000))
    engine.start()
    app = create_app(engine, ServerConfig(served_model_names=["step-engine"]))
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False, loop="asyncio",
                            http="h11", lifespan="on")
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
    args = p.parse_args(argv)

    server, thread, engine, base_url = start_server(args.step_ms, args.engine_process)
    pool = ProcessPoolExecutor(max(1, args.procs), mp_context=multiprocessing.get_context("spawn"))
    try:
        run_level_procs(pool, args.procs, base_url, "step-engine", 4, 8, args.max_tokens)  # warm-up
        print("| clients | requests | errors | output tok/s | server CPU us / token | server CPU ms / request |")
        print("|---:|---:|---:|---:|---:|---:|")
        for level in (int(x) for x in args.levels.split(",")):
            n = level * args.requests_per_client
            cpu = time.process_time()
            result = run_level_procs(pool, args.procs, base_url, "step-engine", level, n, args.max_tokens)
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
