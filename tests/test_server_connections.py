"""Slow clients against the connection watchdog (issue 32, item 3): trickled headers and bodies, idle and
oversized connections, the connection cap, abandoned uploads; each over httptools and over h11.

A `wllm serve`-like subprocess (`_make_server` around the scripted engine) runs with timeouts of about a
second; raw sockets play the slow clients while httpx checks that normal requests keep working.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

KEEP_ALIVE, HEADER, BODY, CAP = 2.0, 1.0, 1.0, 8
SLACK = 3.0  # scheduling on a loaded 2-core CI machine; a missing timeout would hold the socket forever

SERVE = """
import argparse, sys
sys.path.insert(0, {tests!r})
from fake_engine import ScriptedEngine
from wllm.entrypoints.openai import connections
from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.config import ServerConfig
from wllm.entrypoints.serve_cli import _make_server
from wllm.observability.logs import setup_logging
if {http!r} == "h11":
    from uvicorn.protocols.http.h11_impl import H11Protocol
    connections.default_http_protocol = lambda: H11Protocol
setup_logging("json", "INFO")
app = create_app(ScriptedEngine(max_model_len=4096, step_delay=0.02, replies=("tick " * 100,)),
                 ServerConfig(served_model_names=["tiny"]))
args = argparse.Namespace(host="127.0.0.1", port=0, shutdown_timeout=5, timeout_keep_alive={keep_alive},
                          timeout_header={header}, timeout_body={body}, max_header_size=8, max_connections={cap})
server = _make_server(app, args, lambda h, p: print(f"READY {{p}}", flush=True))
server.run()
"""


class Server:
    def __init__(self, http: str) -> None:
        script = SERVE.format(
            tests=str(Path(__file__).resolve().parent),
            http=http,
            keep_alive=KEEP_ALIVE,
            header=HEADER,
            body=BODY,
            cap=CAP,
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()  # type: ignore
        line = self.proc.stdout.readline()
        assert line.startswith("READY"), (line, self.log)
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=HEADER + BODY + KEEP_ALIVE + SLACK)

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    s = Server(request.param)
    yield s
    s.stop()


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def error_of(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    assert b"connection: close" in head.lower(), head
    return status, json.loads(body)["error"]


def assert_healthy(server: Server) -> None:
    r = httpx.get(f"{server.url}/health", timeout=5)
    assert r.status_code == 200


def test_idle_connection_is_closed_after_the_keep_alive_timeout(server: Server) -> None:
    with server.connect() as sock:
        start = time.monotonic()
        assert read_all(sock) == b""  # closed without a word: it never asked anything
        assert KEEP_ALIVE - 0.2 <= time.monotonic() - start <= KEEP_ALIVE + SLACK


def test_trickled_headers_get_a_408_within_the_header_timeout(server: Server) -> None:
    with server.connect() as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        stop = threading.Event()

        def trickle() -> None:
            for i in range(100):  # one header line per 0.1 s, never the blank line that ends them
                if stop.wait(0.1):
                    return
                try:
                    sock.sendall(b"x-slow-%d: 1\r\n" % i)
                except OSError:
                    return

        t = threading.Thread(target=trickle)
        t.start()
        try:
            assert_healthy(server)  # everyone else is served meanwhile
            raw = read_all(sock)
        finally:
            stop.set()
            t.join()
        elapsed = time.monotonic() - start
    status, err = error_of(raw)
    assert status == 408 and err["code"] == "request_timeout" and "--timeout-header" in err["message"]
    assert HEADER - 0.2 <= elapsed <= HEADER + SLACK
    assert server.metric("wllm_connections_closed_total", reason="header_timeout") >= 1


def test_oversized_headers_get_a_431(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(20):  # 20 KiB of headers against an 8 KiB limit
                sock.sendall(b"x-big: " + b"a" * 1024 + b"\r\n")
        except OSError:
            pass  # closed by the server mid-way
        status, err = error_of(read_all(sock))
    assert status == 431 and err["code"] == "headers_too_large"
    assert_healthy(server)


def test_trickled_body_is_a_408_in_the_response_the_log_and_the_metrics(server: Server) -> None:
    before = server.metric("wllm_requests_total", endpoint="/v1/completions", status="408")
    with server.connect() as sock:
        start = time.monotonic()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n" + b'{"model": "tiny", "prompt": "'
        )
        time.sleep(0.3)
        sock.sendall(b"a" * 10)  # a little, then nothing more
        assert_healthy(server)
        status, err = error_of(read_all(sock))
        elapsed = time.monotonic() - start
    assert status == 408 and err["code"] == "request_timeout" and "--timeout-body" in err["message"]
    assert BODY - 0.2 <= elapsed <= BODY + SLACK
    deadline = time.monotonic() + 10
    while server.metric("wllm_requests_total", endpoint="/v1/completions", status="408") == before:
        assert time.monotonic() < deadline, "the timed-out upload was not counted as a 408"
        time.sleep(0.1)
    assert server.metric("wllm_connections_closed_total", reason="body_timeout") >= 1
    assert server.metric("wllm_requests_total", endpoint="/v1/completions", status="500") == 0
    lines = [json.loads(x) for x in server.log if x.startswith("{")]
    assert any(x.get("status") == 408 and x.get("path") == "/v1/completions" for x in lines), server.log[-5:]
    assert not any("Traceback" in x for x in server.log)


def test_abandoned_upload_is_a_499_never_a_500(server: Server) -> None:
    before = server.metric("wllm_requests_total", endpoint="/v1/chat/completions", status="499")
    with server.connect() as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100000\r\n\r\n" + b'{"model": "tiny", "messages": [' + b" " * 5000
        )
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while server.metric("wllm_requests_total", endpoint="/v1/chat/completions", status="499") == before:
        assert time.monotonic() < deadline, "the abandoned upload was not counted as a 499"
        time.sleep(0.1)
    assert server.metric("wllm_requests_total", endpoint="/v1/chat/completions", status="500") == 0
    assert not any("Traceback" in x for x in server.log)


def test_idle_sockets_beyond_the_cap_do_not_lock_out_real_clients(server: Server) -> None:
    idle = [server.connect() for _ in range(CAP + 4)]
    try:
        time.sleep(0.2)
        start = time.monotonic()
        for _ in range(3):  # each new connection makes room by closing the longest-idle one
            r = httpx.post(
                f"{server.url}/v1/completions",
                json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                timeout=KEEP_ALIVE + SLACK,
            )
            assert r.status_code == 200
        assert time.monotonic() - start < KEEP_ALIVE  # served by eviction, not by waiting out the idle timeout
        closed = 0
        for sock in idle:
            sock.settimeout(0.05)
            try:
                closed += sock.recv(1) == b""
            except TimeoutError:
                pass
        assert closed >= 4
    finally:
        for sock in idle:
            sock.close()
    assert server.metric("wllm_connections_closed_total", reason="evicted_idle") >= 4


def test_at_the_cap_with_every_connection_busy_a_new_one_gets_503(server: Server) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 100, "stream": True}
    streams: list[tuple[httpx.Response, Iterator[str]]] = []
    clients = [httpx.Client(timeout=30) for _ in range(CAP)]
    try:
        for c in clients:  # CAP streams in progress: no connection is idle
            r = c.send(c.build_request("POST", f"{server.url}/v1/completions", json=body), stream=True)
            lines = r.iter_lines()  # kept: dropping the iterator would close the stream
            next(lines)
            streams.append((r, lines))
        with server.connect() as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = read_all(sock)
        status, err = error_of(raw)
        assert status == 503 and err["code"] == "too_many_connections"
        assert b"retry-after: 1" in raw.lower()
    finally:
        for r, _ in streams:
            r.close()
        for c in clients:
            c.close()
    deadline = time.monotonic() + 10
    while True:  # the streams' connections are gone: served again
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)
