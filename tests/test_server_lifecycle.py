"""Client disconnects abort engine requests (driven at the ASGI level, so the timing is exact)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from fake_engine import ScriptedEngine

from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.config import ServerConfig


async def call(app: Any, path: str, body: dict, disconnect: asyncio.Event) -> list[dict]:
    """Send one POST through the ASGI app; the client 'disconnects' once `disconnect` is set."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        "client": ("127.0.0.1", 5555), "server": ("testserver", 80), "state": {},
    }
    sent_body = False
    complete = asyncio.Event()
    messages: list[dict] = []

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        # Like uvicorn: `http.disconnect` once the client leaves or the response is complete.
        waits = [asyncio.ensure_future(disconnect.wait()), asyncio.ensure_future(complete.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            complete.set()

    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return messages


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_aborts_engine_request(stream: bool, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        engine = ScriptedEngine()
        engine.gate, engine.at_gate = asyncio.Event(), asyncio.Event()
        app = create_app(engine, ServerConfig(served_model_names=["tiny"]))
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        # The client leaves once the engine has produced a token and is mid-request.
        messages = await call(app, "/v1/chat/completions", body, engine.at_gate)
        assert len(engine.aborted) == 1 and engine.aborted[0].startswith("chatcmpl-")
        assert engine.active == {} and engine.finished_ids == []
        if stream:
            assert messages[0]["status"] == 200  # headers went out before the client left
            assert b"data: " in b"".join(m.get("body", b"") for m in messages[1:])

    with caplog.at_level(logging.INFO, logger="wllm.access"):
        asyncio.run(main())
    (entry,) = [r.fields for r in caplog.records if r.name == "wllm.access"]  # type: ignore[attr-defined]
    assert entry["error"] == "client disconnected" and entry["status"] == (200 if stream else 499)
    assert entry["prompt_tokens"] > 0 and entry["completion_tokens"] == 1


def test_completed_request_is_not_aborted() -> None:
    async def main() -> None:
        engine = ScriptedEngine()
        app = create_app(engine, ServerConfig(served_model_names=["tiny"]))
        never = asyncio.Event()
        for stream in (False, True):
            messages = await call(app, "/v1/completions", {"model": "tiny", "prompt": "x", "stream": stream}, never)
            assert messages[0]["status"] == 200
        assert engine.aborted == [] and len(engine.finished_ids) == 2

    asyncio.run(main())


def test_multi_prompt_stream_disconnect_aborts_all() -> None:
    async def main() -> None:
        engine = ScriptedEngine()
        engine.gate, engine.at_gate = asyncio.Event(), asyncio.Event()
        app = create_app(engine, ServerConfig(served_model_names=["tiny"]))
        await call(app, "/v1/completions", {"model": "tiny", "prompt": ["a", "b", "c"], "stream": True},
                   engine.at_gate)
        assert sorted(engine.aborted) == sorted(c[2] for c in engine.calls)
        assert len(engine.aborted) == 3 and engine.active == {}

    asyncio.run(main())


def serve_fake(step_delay: float, ticks: int, shutdown_timeout: float, json_logs: bool = False) -> str:
    """A `python -c` script serving the scripted engine through `_make_server`, as `wllm serve` does."""
    logs = 'from wllm.observability.logs import setup_logging\nsetup_logging("json", "INFO")\n' if json_logs else ""
    return f"""
import argparse, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})  # fake_engine
{logs}from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.config import ServerConfig
from fake_engine import ScriptedEngine
from wllm.entrypoints.serve_cli import _make_server
app = create_app(ScriptedEngine(max_model_len=4096, step_delay={step_delay}, replies=("tick " * {ticks},)),
                 ServerConfig(served_model_names=["tiny"]))
args = argparse.Namespace(host="127.0.0.1", port=0, shutdown_timeout={shutdown_timeout})
server = _make_server(app, args, lambda h, p: print(f"READY http://{{h}}:{{p}}", flush=True))
server.run()
print("EXITED CLEANLY", flush=True)
"""


SERVE_FAKE = serve_fake(0.005, 60, 30)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_signal_drains_in_flight_stream_and_exits_0(sig: str) -> None:
    import signal
    import subprocess
    import sys

    import httpx

    flags = subprocess.CREATE_NEW_PROCESS_GROUP if sys.platform == "win32" else 0  # type: ignore[attr-defined]
    proc = subprocess.Popen([sys.executable, "-c", SERVE_FAKE], stdout=subprocess.PIPE, text=True,
                            creationflags=flags)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[-1]
        body = {"model": "tiny", "prompt": "x", "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            if sys.platform == "win32":
                proc.send_signal(signal.CTRL_BREAK_EVENT)  # type: ignore[attr-defined]
            else:
                proc.send_signal(getattr(signal, sig))
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # the in-flight stream ran to its end
        text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in [first, *rest[:-1]])
        assert text == ("tick " * 60)
        assert proc.wait(timeout=60) == 0
        assert "EXITED CLEANLY" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


SERVE_FAKE_SHORT_DRAIN = serve_fake(0.02, 200, 0.5, json_logs=True)


def test_drain_timeout_ends_every_stream_with_an_error_event_and_done() -> None:
    """Past --shutdown-timeout, each open stream (chat, n=2, several prompts) and each plain request ends
    with an OpenAI error (an SSE error event then [DONE]; a 503 body), logged as a server-side cancel."""
    import signal
    import subprocess
    import sys
    import threading

    import httpx

    proc = subprocess.Popen([sys.executable, "-c", SERVE_FAKE_SHORT_DRAIN], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        url = proc.stdout.readline().split()[-1]
        msgs = [{"role": "user", "content": "hi"}]
        bodies = [
            ("/v1/chat/completions", {"model": "tiny", "messages": msgs, "stream": True}),
            ("/v1/chat/completions", {"model": "tiny", "messages": msgs, "stream": True, "n": 2,
                                      "stream_options": {"include_usage": True}}),
            ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 900, "stream": True}),
            ("/completions", {"model": "tiny", "prompt": "x", "max_tokens": 900, "stream": True}),
        ]
        results: list[list[str] | None] = [None] * len(bodies)
        started = threading.Barrier(len(bodies) + 1)
        plain: list[httpx.Response] = []

        def stream(k: int, path: str, body: dict) -> None:
            with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
                lines = r.iter_lines()
                got = [next(line for line in lines if line.startswith("data: "))]
                started.wait(timeout=30)
                got += [line for line in lines if line.startswith("data: ")]
            results[k] = got

        def plain_request() -> None:
            plain.append(httpx.post(f"{url}/v1/completions", timeout=60,
                                    json={"model": "tiny", "prompt": "x", "max_tokens": 900}))

        threads = [threading.Thread(target=stream, args=(k, *b)) for k, b in enumerate(bodies)]
        threads.append(threading.Thread(target=plain_request))
        for t in threads:
            t.start()
        started.wait(timeout=30)  # every stream has its first event
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        assert "EXITED CLEANLY" in proc.stdout.read()
        log = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    for got in results:
        assert got is not None and got[-1] == "data: [DONE]", got
        error = json.loads(got[-2][len("data: "):])
        assert error == {"error": {"message": error["error"]["message"], "type": "service_unavailable_error",
                                   "param": None, "code": "server_shutdown"}}
        assert "drain timeout" in error["error"]["message"]
        for line in got[:-2]:  # everything before it is a whole chunk of the stream
            assert "error" not in json.loads(line[len("data: "):])
    (r,) = plain
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown"

    assert "Traceback" not in log and "Exception in ASGI application" not in log and "exc" not in log
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert any("drain timeout" in rec["msg"] and "cancelling 5 running request(s)" in rec["msg"]
               for rec in records), log
    access = [rec for rec in records if rec.get("logger") == "wllm.access"]
    cut = [rec for rec in access if rec.get("error") == "server shutdown: cancelled at the drain timeout"]
    assert len(cut) == 5 and not [rec for rec in access if rec.get("error") == "client disconnected"], access
    assert sorted(rec["status"] for rec in cut) == [200, 200, 200, 200, 503]
