"""A real `wllm serve` process on 127.0.0.1 driven by the official `openai` client.

One server runs the embedded SmolLM2-135M-Instruct (greedy outputs are checked for content);
a second one runs random weights in SmolLM2's shape to test rate limits and the SIGTERM drain
without paying for a second GGUF load.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from wllm.model.default_model import DEFAULT_MODEL_NAME, default_model_path

pytestmark = pytest.mark.slow

KEY = "sk-e2e-main"
READY = re.compile(r"wLLM ready: serving (\S+) at (http://\S+/v1)")


class ServerProcess:
    def __init__(self, args: list[str], log: Path) -> None:
        flags = subprocess.CREATE_NEW_PROCESS_GROUP if sys.platform == "win32" else 0  # for CTRL_BREAK
        self.log = log
        self._log_file = log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen([sys.executable, "-m", "wllm.cli", "serve", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=self._log_file, text=True,
                                     creationflags=flags)
        self.base_url = ""
        self.ready = threading.Event()
        self.stdout: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(timeout=600) or not self.base_url:
            self.stop()
            raise RuntimeError(f"server did not start: {self.stdout} {log.read_text(encoding='utf-8')[-3000:]}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout.append(line)
            m = READY.search(line)
            if m:
                self.base_url = m.group(2)
                self.ready.set()
        self.ready.set()  # the process ended

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    def terminate(self) -> None:
        if sys.platform == "win32":
            self.proc.send_signal(signal.CTRL_BREAK_EVENT)  # type: ignore[attr-defined]
        else:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


@pytest.fixture(scope="module", params=["engine-thread", "engine-process"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Every test of the main server runs twice: engine in a thread (the CPU's default), then in its own
    process (CUDA's default)."""
    default_model_path()  # fetch outside the server's start-up deadline
    extra = ["--engine-process"] if request.param == "engine-process" else ["--no-engine-process"]
    s = ServerProcess(["--api-key", KEY, "--max-model-len", "512", "--kv-cache-memory", "0.25",
                       "--log-format", "json", *extra], tmp_path_factory.mktemp("srv") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess(["smollm2-135m", "--load-format", "dummy", "--tokenizer", str(default_model_path()),
                       "--served-model-name", "limited", "--max-model-len", "256", "--kv-cache-memory", "0.1",
                       "--api-key", "k-limited", "--api-key", "k-drain", "--api-key", "k-interval",
                       "--rate-limit-rpm", "2", "--stream-interval", "4",
                       "--shutdown-timeout", "60"], tmp_path_factory.mktemp("lim") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.root}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.labels:
                out[s.name] = s.value
            else:
                out[s.name + str(sorted(s.labels.items()))] = s.value
    return out


def test_chat_greedy_answer(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=ask("What is the capital of France?"),
                                       max_tokens=16, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    # the same prompt again hits the prefix cache
    again = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=ask("What is the capital of France?"),
                                           max_tokens=16, temperature=0)
    assert again.choices[0].message.content == r.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    full = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="The capital of France is", max_tokens=6,
                                     temperature=0)
    assert full.choices[0].text.startswith(" Paris")
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 6
    parts = list(client.completions.create(model=DEFAULT_MODEL_NAME, prompt="The capital of France is",
                                           max_tokens=6, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length" and parts[-1].choices[0].text == ""
    assert all(p.choices[0].finish_reason is None for p in parts[:-1])


def test_chat_stream_matches_and_include_usage(client: openai.OpenAI) -> None:
    kwargs = dict(model=DEFAULT_MODEL_NAME, messages=ask("Name three colors."), max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # OpenAI's ending: an empty delta with the finish_reason, after content chunks with none
    final = chunks[-2].choices[0]
    assert final.finish_reason == full.choices[0].finish_reason and final.delta.content is None
    assert final.delta.role is None
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])


def test_n2_logprobs_and_seed(client: openai.OpenAI) -> None:
    kwargs = dict(model=DEFAULT_MODEL_NAME, messages=ask("Tell me a word."), max_tokens=6, temperature=1.0,
                  seed=1234, n=2, logprobs=True, top_logprobs=3)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    for choice in a.choices:
        content = choice.logprobs.content
        assert "".join(t.token for t in content) == choice.message.content
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 3
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
            assert t.top_logprobs[0].logprob >= t.logprob - 1e-4


def test_stop_string(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=ask("What is the capital of France?"),
                                       max_tokens=16, temperature=0, stop=["Paris"])
    assert "Paris" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"


def test_16_concurrent_streams_are_correct(server: ServerProcess, client: openai.OpenAI) -> None:
    prompts = ["Count to five.", "Name a fruit.", "Say hello.", "What is 2+2?"]
    refs = {p: client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=ask(p), max_tokens=8,
                                              temperature=0).choices[0].message.content for p in prompts}

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=ask(prompt),
                                                       max_tokens=8, temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=300) as ac:
            return await asyncio.gather(*(one(ac, prompts[i % 4]) for i in range(16)))

    results = asyncio.run(main())
    assert results == [refs[prompts[i % 4]] for i in range(16)]


def test_disconnect_mid_stream_frees_blocks(server: ServerProcess) -> None:
    body = {"model": DEFAULT_MODEL_NAME, "messages": ask("Write a long story."), "max_tokens": 300,
            "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, headers=headers, timeout=60) as r:
        events: list[str] = []
        running = None
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) >= 3:
                # Read the gauge while the stream is still being read: leaving iter_lines() closes the
                # connection, and the server may already have dropped the request by the next line.
                running = metrics(server)["wllm_num_requests_running"]
                break
        assert running == 1.0
    # The connection is closed: the engine must drop the request and free its KV blocks. Engine
    # stats are refreshed by engine steps, so run one short request through before looking.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        httpx.post(f"{server.base_url}/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=headers,
                   timeout=60).raise_for_status()
        m = metrics(server)
        if not m["wllm_num_requests_running"]:
            break
    assert m["wllm_num_requests_running"] == 0.0 and m["wllm_kv_cache_usage_ratio"] == 0.0
    assert '"error":"client disconnected"' in server.log.read_text(encoding="utf-8")


def test_soak_with_disconnects_returns_kv_and_gauges_to_zero(server: ServerProcess,
                                                             request: pytest.FixtureRequest) -> None:
    """16 concurrent streams, every fifth one dropped by its client mid-stream (issue 32): the others end
    with [DONE], nothing is a 5xx, and the KV cache and the running / waiting gauges come back to 0.

    On the engine thread only (the CPU's default): on a loaded 2-core CI machine the engine process
    shares the cores with the server and took minutes for the same streams."""
    if request.node.callspec.params.get("server") == "engine-process":
        pytest.skip("minutes on a 2-core CPU; the engine process's disconnect path is covered by "
                    "test_disconnect_mid_stream_frees_blocks")
    headers = {"Authorization": f"Bearer {KEY}"}

    async def one(ac: httpx.AsyncClient, i: int) -> str:
        body = {"model": DEFAULT_MODEL_NAME, "messages": ask(f"Tell story number {i}."), "max_tokens": 24,
                "ignore_eos": True, "stream": True}
        async with ac.stream("POST", f"{server.base_url}/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                assert '"error"' not in line, line
                if i % 5 == 4 and events >= 2 + i % 3:
                    return "cancelled"  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    return "done"
        return "cut short"

    async def main() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(16)))

    results = asyncio.run(main())
    assert results.count("cancelled") == 3 and results.count("done") == 13, results
    deadline = time.monotonic() + 60
    while True:  # engine stats are refreshed by engine steps: run a short request through before looking
        httpx.post(f"{server.base_url}/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=headers,
                   timeout=60).raise_for_status()
        m = metrics(server)
        idle = (m["wllm_num_requests_running"], m["wllm_num_requests_waiting"], m["wllm_kv_cache_usage_ratio"])
        if idle == (0.0, 0.0, 0.0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle == (0.0, 0.0, 0.0)
    assert not [k for k, v in m.items() if "('status', '5" in k and v], m


def test_metrics_move_and_small_endpoints(server: ServerProcess, client: openai.OpenAI) -> None:
    key = "wllm_requests_total[('endpoint', '/v1/completions'), ('status', '200')]"
    before = metrics(server)
    client.completions.create(model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=2)
    after = metrics(server)
    assert after[key] == before.get(key, 0.0) + 1
    assert after["wllm_generation_tokens_total"] >= before["wllm_generation_tokens_total"] + 2
    assert after["wllm_time_to_first_token_seconds_count"] > before["wllm_time_to_first_token_seconds_count"]
    assert httpx.get(f"{server.root}/health").status_code == 200
    assert httpx.get(f"{server.root}/version").json()["version"]
    assert [m.id for m in client.models.list()] == [DEFAULT_MODEL_NAME]
    tok = httpx.post(f"{server.root}/tokenize", json={"prompt": "Hello world"}, headers={
        "Authorization": f"Bearer {KEY}"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0


def test_errors_map_to_openai_exceptions(server: ServerProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=DEFAULT_MODEL_NAME, prompt="word " * 600, max_tokens=4)
    assert info.value.code == "context_length_exceeded" and "512" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=ask("hi"))
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="sk-wrong", max_retries=0).models.list()


def test_json_log_has_no_key(server: ServerProcess) -> None:
    log = server.log.read_text(encoding="utf-8")
    assert KEY not in log and '"status":200' in log and '"key_id":"key-' in log


def test_stream_interval_sends_fewer_larger_frames(limited: ServerProcess) -> None:
    """`--stream-interval 4`: 10 tokens come in at most 4 text frames (the first token at once, then every
    4, then the last), and they add up to the non-streamed text."""
    c = openai.OpenAI(base_url=limited.base_url, api_key="k-interval", max_retries=0, timeout=120)
    kwargs = dict(model="limited", prompt="Once upon a time", max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    full = c.completions.create(**kwargs)
    frames = [p.choices[0].text for p in c.completions.create(**kwargs, stream=True) if p.choices]
    assert "".join(frames) == full.choices[0].text and full.usage.completion_tokens == 10
    assert 1 <= len([f for f in frames if f]) <= 4


def test_rate_limit_429_with_retry_after(limited: ServerProcess) -> None:
    c = openai.OpenAI(base_url=limited.base_url, api_key="k-limited", max_retries=0)
    c.models.list()
    c.models.list()
    with pytest.raises(openai.RateLimitError) as info:
        c.models.list()
    assert int(info.value.response.headers["retry-after"]) >= 1


def test_sigterm_drains_in_flight_stream_and_exits_0(limited: ServerProcess) -> None:
    c = openai.OpenAI(base_url=limited.base_url, api_key="k-drain", max_retries=0, timeout=120)
    stream = c.completions.create(model="limited", prompt="Hello", max_tokens=24, stream=True,
                                  extra_body={"ignore_eos": True})
    it = iter(stream)
    first = next(it)
    limited.terminate()  # the server stops accepting, but lets this request finish
    rest = list(it)
    chunks = [first, *rest]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert limited.proc.wait(timeout=120) == 0
    assert "server stopped" in limited.log.read_text(encoding="utf-8")
