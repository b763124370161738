"""Load check for a running wLLM (or any OpenAI-compatible) server.

Ramps the number of concurrent streaming clients (default 1, 2, 4, ... 64); at each level every
client sends requests back to back until the level's request count is done. Reports, per level:
time to first token (p50/p95/p99), inter-token latency (p50/p95/p99 over all token gaps),
end-to-end latency, output tokens/s and requests/s, as the client processes see them; and, from a
wLLM server's `/metrics` read before and after the level, the server's own TTFT (from the request
reaching it to its first token) and inter-token p50/p95, as the upper bounds of their histogram
buckets. Where the two part, the time goes to the connection or to the client: one asyncio process
reading dozens of streams is the bottleneck itself (it sees a far longer TTFT and a fraction of the
tokens/s that several processes see against the same server; benchmarks/RESULTS.md), so a level's
clients are spread over `--procs N` processes, by default half this machine's CPUs (at most 8).

    python benchmarks/serve_load.py --base-url http://127.0.0.1:8000/v1
    python benchmarks/serve_load.py --spawn "--load-format dummy qwen2.5-0.5b --tokenizer ..." --levels 1,8,64
    python benchmarks/serve_load.py --base-url http://127.0.0.1:8000/v1 --levels 64 --procs 8

`--spawn ARGS` starts `wllm serve --port 0 ARGS` itself and stops it at the end. Requests use
`ignore_eos` so every request produces exactly `--max-tokens` tokens (a fixed, comparable load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPT = ("You are a helpful assistant. Summarise the history of the printing press in Europe, its effect on "
          "literacy, science and religion, and compare it with the spread of the internet. ")


@dataclass
class RequestResult:
    ttft: float
    e2e: float
    gaps: list[float]
    tokens: int
    error: str | None = None


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    wall: float
    results: list[RequestResult] = field(default_factory=list)
    # The engine's histograms over the level (bucket bound -> count, cumulative); None: not a wLLM server.
    server: dict[str, dict[float, float]] | None = None

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.error is None]
        ttft = [r.ttft for r in ok]
        gaps = [g for r in ok for g in r.gaps]
        tokens = sum(r.tokens for r in ok)
        return {
            "concurrency": self.concurrency,
            "requests": len(self.results),
            "errors": len(self.results) - len(ok),
            "ttft_p50_ms": pct(ttft, 50) * 1e3,
            "ttft_p95_ms": pct(ttft, 95) * 1e3,
            "ttft_p99_ms": pct(ttft, 99) * 1e3,
            "itl_p50_ms": pct(gaps, 50) * 1e3,
            "itl_p95_ms": pct(gaps, 95) * 1e3,
            "itl_p99_ms": pct(gaps, 99) * 1e3,
            "e2e_p50_s": pct([r.e2e for r in ok], 50),
            "output_tok_s": tokens / self.wall if self.wall else 0.0,
            "req_s": len(ok) / self.wall if self.wall else 0.0,
            **{f"server_{name}_{q}_ms": bucket_pct((self.server or {}).get(metric), q)
               for name, metric in (("ttft", TTFT_METRIC), ("itl", ITL_METRIC)) for q in ("p50", "p95")},
        }


TTFT_METRIC = "wllm_time_to_first_token_seconds"
ITL_METRIC = "wllm_inter_token_latency_seconds"


def bucket_pct(buckets: dict[float, float] | None, q: str) -> float | None:
    """The upper bound (ms) of the histogram bucket holding the q-th percentile ("p50"), from cumulative
    counts by bound; None without counts, inf past the last finite bound."""
    if not buckets or not buckets.get(math.inf):
        return None
    rank = max(1, math.ceil(float(q[1:]) / 100 * buckets[math.inf]))
    return next(bound * 1e3 for bound, count in sorted(buckets.items()) if count >= rank)


def server_histograms(root_url: str, headers: dict[str, str]) -> dict[str, dict[float, float]] | None:
    """Cumulative bucket counts of the server's TTFT and inter-token histograms, summed over their label
    sets (None: no such metrics there)."""
    try:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(root_url + "/metrics", headers=headers, timeout=10).text
        families = list(text_string_to_metric_families(text))
    except Exception:  # no prometheus_client, no /metrics, not Prometheus text: client-side numbers only
        return None
    out: dict[str, dict[float, float]] = {}
    for family in families:
        if family.name in (TTFT_METRIC, ITL_METRIC):
            counts = out.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    counts[bound] = counts.get(bound, 0.0) + sample.value
    return out or None


def histogram_delta(before: dict[str, dict[float, float]] | None,
                    after: dict[str, dict[float, float]] | None) -> dict[str, dict[float, float]] | None:
    """What was observed between two `server_histograms` reads."""
    if before is None or after is None:
        return None
    return {name: {bound: count - before.get(name, {}).get(bound, 0.0) for bound, count in counts.items()}
            for name, counts in after.items()}


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


async def one_request(client: httpx.AsyncClient, url: str, model: str, max_tokens: int, headers: dict[str, str],
                      prompt: str) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first: float | None = None
    last = start
    gaps: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return RequestResult(0.0, 0.0, [], 0, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return RequestResult(0.0, 0.0, [], 0, str(event["error"]))
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0].get("text"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        return RequestResult(0.0, 0.0, [], 0, f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    return RequestResult((first or end) - start, end - start, gaps, tokens)


async def run_level(base_url: str, model: str, concurrency: int, n_requests: int, max_tokens: int,
                    api_key: str | None = None, prompt: str = PROMPT, *, tag: int | None = None,
                    first_index: int = 0) -> LevelResult:
    """Run `n_requests` streaming completions with `concurrency` clients sending back to back (prompts
    numbered from `first_index` under `tag`, default the concurrency)."""
    url = base_url.rstrip("/") + "/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    tag = concurrency if tag is None else tag
    todo = list(range(first_index, first_index + n_requests))
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def worker() -> None:
            while todo:
                i = todo.pop()
                # A prefix unique per level and request keeps this from turning into a prefix-cache test.
                results.append(await one_request(client, url, model, max_tokens, headers,
                                                 f"[{tag}.{i}] {prompt}"))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return LevelResult(concurrency, n_requests, wall, results)


def _run_share(base_url: str, model: str, clients: int, n_requests: int, max_tokens: int, api_key: str | None,
               tag: int, first_index: int, start_at: float) -> tuple[list[RequestResult], float, float]:
    """One load process's share of a level (--procs): starts at `start_at` (time.time()), returns its
    results and when it started and ended."""
    time.sleep(max(0.0, start_at - time.time()))
    began = time.time()
    result = asyncio.run(run_level(base_url, model, clients, n_requests, max_tokens, api_key, tag=tag,
                                   first_index=first_index))
    return result.results, began, time.time()


def default_procs(cpus: int | None) -> int:
    """Client processes when --procs is not given: half the CPUs (the rest for a server on the same host), 1-8."""
    return max(1, min(8, (cpus or 2) // 2))


def _ready(_: int) -> int:
    """A no-op task: mapping enough of them starts every pool process before the first level."""
    return os.getpid()


def run_level_procs(pool: ProcessPoolExecutor, procs: int, base_url: str, model: str, concurrency: int,
                    n_requests: int, max_tokens: int, api_key: str | None = None) -> LevelResult:
    """`run_level` with the clients spread over `procs` processes of `pool` (one asyncio process reading
    dozens of streams can be slower than the server it measures); requests split with the clients."""
    k = max(1, min(procs, concurrency))
    clients = [concurrency // k + (i < concurrency % k) for i in range(k)]
    requests = [n_requests * c // concurrency for c in clients]
    for i in range(n_requests - sum(requests)):
        requests[i % k] += 1
    start_at = time.time() + 0.2
    futures = [pool.submit(_run_share, base_url, model, c, r, max_tokens, api_key, concurrency, sum(requests[:i]),
                           start_at) for i, (c, r) in enumerate(zip(clients, requests))]
    shares = [f.result() for f in futures]
    wall = max(end for _, _, end in shares) - min(began for _, began, _ in shares)
    return LevelResult(concurrency, n_requests, wall, [r for results, _, _ in shares for r in results])


def spawn_server(args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "wllm.cli", "serve", "--port", "0", *shlex.split(args)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"wLLM ready: serving \S+ at (http://\S+/v1)", line)
        if m:
            return proc, m.group(1)
    raise SystemExit(f"the server exited before it was ready (status {proc.wait()})")


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ("| clients | requests | errors | TTFT p50/p95/p99 (ms) | ITL p50/p95/p99 (ms) | e2e p50 (s) "
            "| output tok/s | req/s | server TTFT p50/p95 (ms, <=) | server ITL p50/p95 (ms, <=) |")
    lines = [head, "|" + "---|" * 10]

    def bound(v: float | None) -> str:
        return "-" if v is None else f"{v:g}"

    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {r['errors']} "
            f"| {r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
            f"| {r['itl_p50_ms']:.1f} / {r['itl_p95_ms']:.1f} / {r['itl_p99_ms']:.1f} "
            f"| {r['e2e_p50_s']:.2f} | {r['output_tok_s']:.1f} | {r['req_s']:.2f} "
            f"| {bound(r['server_ttft_p50_ms'])} / {bound(r['server_ttft_p95_ms'])} "
            f"| {bound(r['server_itl_p50_ms'])} / {bound(r['server_itl_p95_ms'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--spawn", default=None, metavar="ARGS", help="start `wllm serve --port 0 ARGS` and use it")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--levels", default="1,2,4,8,16,32,64", help="comma-separated client counts")
    p.add_argument("--requests-per-client", type=int, default=2, help="requests per client at each level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--procs", type=int, default=0,
                   help="client processes (the clients of a level are spread over them; 1: this process; 0, the "
                        "default: half this machine's CPUs, at most 8 -- one asyncio process cannot read 64 streams "
                        "as fast as the server sends them)")
    args = p.parse_args(argv)
    procs = args.procs if args.procs > 0 else default_procs(os.cpu_count())

    proc = None
    pool = None
    base_url = args.base_url
    if args.spawn is not None:
        proc, base_url = spawn_server(args.spawn)
    try:
        if procs > 1:  # spawn: the same on Windows and Linux; started before the first level
            pool = ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"))
            list(pool.map(_ready, range(4 * procs)))
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.model or httpx.get(base_url.rstrip("/") + "/models", headers=headers).json()["data"][0]["id"]
        version = httpx.get(base_url.removesuffix("/v1").rstrip("/") + "/version").json().get("version", "?")
        print(f"server {base_url} (wllm {version}), model {model}, {args.max_tokens} output tokens per request, "
              f"{procs} client process{'es' if procs > 1 else ''}")
        root = base_url.removesuffix("/v1").rstrip("/")
        rows = []
        for level in (int(x) for x in args.levels.split(",")):
            before = server_histograms(root, headers)
            n_requests = level * args.requests_per_client
            if pool is not None:
                result = run_level_procs(pool, procs, base_url, model, level, n_requests, args.max_tokens,
                                         args.api_key)
            else:
                result = asyncio.run(run_level(base_url, model, level, n_requests, args.max_tokens, args.api_key))
            result.server = histogram_delta(before, server_histograms(root, headers))
            row = result.summary()
            rows.append(row)
            print(format_table([row]).splitlines()[-1], flush=True)
            errors = [r.error for r in result.results if r.error]
            if errors:
                print(f"  first error: {errors[0]}", flush=True)
        print()
        print(format_table(rows))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"base_url": base_url, "model": model, "max_tokens": args.max_tokens, "levels": rows}, f,
                          indent=2)
    finally:
        if pool is not None:
            pool.shutdown()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
