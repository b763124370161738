"""A maximal prompt must not stall the server, and the memory it took must come back (issue 32, item 2).

A `wllm serve`-like subprocess runs the scripted engine with the embedded model's real tokenizer (Rust,
the one that took seconds per 16 MB prompt on the event loop). Latencies are compared with a baseline
measured in the same test, so a loaded CI machine shifts both alike.
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from wllm.entrypoints.openai.offload import release_memory
from wllm.model.default_model import default_model_path

MAX_MODEL_LEN = 32768
MAX_PROMPT_CHARS = 2_000_000  # raised from the default (16 per token: 524,288) so tokenizing takes seconds
BOUND_S = 0.1  # the bound on the extra latency of other requests

SERVE = """
import argparse, sys
sys.path.insert(0, {tests!r})
from fake_engine import ScriptedEngine
from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.config import ServerConfig
from wllm.entrypoints.serve_cli import _make_server
from wllm.model.tokenizer.tokenizer import Tokenizer
engine = ScriptedEngine(max_model_len={max_model_len}, step_delay=0.002)
engine.tokenizer = Tokenizer.from_path({model!r})
app = create_app(engine, ServerConfig(served_model_names=["tiny"], max_prompt_chars={max_prompt_chars}))
args = argparse.Namespace(host="127.0.0.1", port=0, shutdown_timeout=5)
server = _make_server(app, args, lambda h, p: print(f"READY {{p}}", flush=True))
server.run()
"""


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    script = SERVE.format(
        tests=str(Path(__file__).resolve().parent),
        model=str(default_model_path()),
        max_model_len=MAX_MODEL_LEN,
        max_prompt_chars=MAX_PROMPT_CHARS,
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        yield f"http://127.0.0.1:{int(line.split()[1])}", proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def prose(chars: int) -> str:
    words = ["hello", "world", "the", "quick", "brown", "fox", "jumps", "über", "naïve", "日本語", "over", "42", "."]
    rng = random.Random(0)
    text = " ".join(rng.choice(words) for _ in range(chars // 5 + 1))
    return text[:chars]


def completion_body(chars: int) -> bytes:
    return msgspec.json.encode({"model": "tiny", "prompt": prose(chars), "max_tokens": 4})


def health_latency(client: httpx.Client, url: str) -> float:
    start = time.perf_counter()
    assert client.get(f"{url}/health").status_code == 200
    return time.perf_counter() - start


def ttft(client: httpx.Client, url: str) -> float:
    start = time.perf_counter()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:  # the first token
                return time.perf_counter() - start
    raise AssertionError("no token came")


def p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


@pytest.mark.slow
def test_a_maximal_prompt_does_not_delay_other_requests(server: tuple[str, int]) -> None:
    url, _ = server
    big = completion_body(MAX_PROMPT_CHARS)  # the longest prompt it will tokenize: seconds of work
    at_body_limit = msgspec.json.encode(
        {"model": "tiny", "messages": [{"role": "user", "content": "a" * ((16 << 20) - 100)}]}
    )
    with httpx.Client(timeout=120) as client:
        ttft(client, url)  # warm-up
        base_health = [health_latency(client, url) for _ in range(30)]
        base_ttft = [ttft(client, url) for _ in range(8)]

        answers: list[httpx.Response] = []
        busy = threading.Event()

        def send_big() -> None:
            with httpx.Client(timeout=300) as c:
                busy.set()
                for raw in (big, at_body_limit, big):
                    answers.append(
                        c.post(
                            f"{url}/v1/completions" if raw is big else f"{url}/v1/chat/completions",
                            content=raw,
                            headers={"content-type": "application/json"},
                        )
                    )

        sender = threading.Thread(target=send_big)
        sender.start()
        busy.wait()
        time.sleep(0.05)
        loaded_health: list[float] = []
        loaded_ttft: list[float] = []
        while sender.is_alive():
            loaded_health.append(health_latency(client, url))
            if len(loaded_health) % 4 == 1:  # from the first round on
                loaded_ttft.append(ttft(client, url))
            time.sleep(0.01)
        sender.join()

    codes = [r.json()["error"]["code"] for r in answers]
    assert codes == ["context_length_exceeded", "prompt_too_long", "context_length_exceeded"], codes
    base_med, loaded_med = statistics.median(base_health), statistics.median(loaded_health)
    assert loaded_med <= base_med + BOUND_S, (base_med, loaded_med)
    # The slowest tenth may meet a GIL-holding moment or the loaded machine's scheduler; before the fix
    # every request made while a prompt was tokenized waited for all of it (seconds).
    assert p90(loaded_health) <= p90(base_health) + 2.5 * BOUND_S, (p90(base_health), p90(loaded_health))
    assert statistics.median(loaded_ttft) <= statistics.median(base_ttft) + BOUND_S, (base_ttft, loaded_ttft)
    assert len(loaded_health) >= 10, "the big requests ended too soon to measure anything"


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the release is glibc's malloc_trim")
def test_memory_of_huge_requests_is_given_back(server: tuple[str, int]) -> None:
    url, pid = server
    big = completion_body(MAX_PROMPT_CHARS)
    with httpx.Client(timeout=300) as client:

        def post() -> None:
            r = client.post(f"{url}/v1/completions", content=big, headers={"content-type": "application/json"})
            assert r.json()["error"]["code"] == "context_length_exceeded"

        # The baseline comes before any large request: glibc reuses the arenas it kept for the next large
        # request, so a baseline taken after one would hide that they were never given back.
        for _ in range(3):
            assert client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        time.sleep(0.5)
        base = rss_bytes(pid)
        peak = base
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, rss_bytes(pid))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            post()
            post()
        finally:
            stop.set()
            sampler.join()
        grown = peak - base
        assert grown > 100 << 20, f"tokenizing took only {grown >> 20} MiB: nothing to measure"
        deadline = time.monotonic() + 10
        while (now := rss_bytes(pid)) > base + max(0.25 * grown, 48 << 20):
            assert time.monotonic() < deadline, (
                f"RSS {now >> 20} MiB stays above the {base >> 20} MiB before (peak {peak >> 20} MiB)"
            )
            time.sleep(0.1)


def test_release_memory_is_available_on_this_platform() -> None:
    # glibc (Linux CI) and the UCRT (Windows) have the call; elsewhere it is a documented no-op.
    assert release_memory() is (sys.platform.startswith("linux") or sys.platform == "win32")
