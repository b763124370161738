"""Access logs, Prometheus metrics, OpenTelemetry spans, API keys and token buckets."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
from pathlib import Path

import pytest
from fake_engine import ScriptedEngine
from litestar.testing import TestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.auth import APIKeyChecker, APIKeyError, bearer_token, collect_api_keys, key_id
from wllm.entrypoints.openai.config import ServerConfig
from wllm.entrypoints.openai.rate_limit import RateLimited, RateLimiter
from wllm.observability.logs import JSONFormatter, setup_logging
from wllm.observability.tracing import TracingSetupError, otlp_tracer_provider

MSGS = [{"role": "user", "content": "hi"}]


def metric_values(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_json_access_log_has_request_fields_and_never_the_key() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JSONFormatter())
    log = logging.getLogger("wllm.access")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        app = create_app(ScriptedEngine(), ServerConfig(served_model_names=["tiny"], api_keys=["sk-secret-123"]))
        with TestClient(app) as c:
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 4},
                       headers={"Authorization": "Bearer sk-secret-123"})
            assert r.status_code == 200
            c.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS},
                   headers={"Authorization": "Bearer sk-wrong-456"})
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    text = stream.getvalue()
    assert "sk-secret-123" not in text and "sk-wrong-456" not in text
    ok, denied = (json.loads(line) for line in text.splitlines())
    assert ok["status"] == 200 and ok["request_id"] == r.json()["id"]
    assert ok["key_id"] == key_id("sk-secret-123") and ok["level"] == "info" and ok["logger"] == "wllm.access"
    assert ok["prompt_tokens"] == r.json()["usage"]["prompt_tokens"] and ok["completion_tokens"] == 4
    assert ok["cached_tokens"] == 0
    assert 0 <= ok["queue_time_s"] <= ok["ttft_s"] <= ok["total_time_s"]
    assert denied["status"] == 401 and "key_id" not in denied


def test_setup_logging_rejects_unknown_format() -> None:
    with pytest.raises(ValueError, match="'json' or 'text'"):
        setup_logging("xml")  # type: ignore[arg-type]


def test_metrics_parse_and_move() -> None:
    engine = ScriptedEngine()
    app = create_app(engine, ServerConfig(served_model_names=["tiny"]))
    with TestClient(app) as c:
        before = metric_values(c.get("/metrics").text)
        assert before[("wllm_engine_healthy", ())] == 1.0
        assert before[("wllm_num_requests_running", ())] == 0.0
        for _ in range(2):
            c.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 5})
        c.post("/v1/chat/completions", json={"model": "nope", "messages": MSGS})
        r = c.get("/metrics")
        assert r.headers["content-type"].startswith("text/plain")
        after = metric_values(r.text)
    chat = (("endpoint", "/v1/chat/completions"), ("status", "200"))
    assert after[("wllm_requests_total", chat)] == 2.0
    assert after[("wllm_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "404")))] == 1.0
    assert after[("wllm_generation_tokens_total", ())] == 10.0
    assert after[("wllm_time_to_first_token_seconds_count", ())] == 2.0
    assert after[("wllm_e2e_request_latency_seconds_count", ())] == 2.0
    assert after[("wllm_inter_token_latency_seconds_count", ())] == 8.0  # 4 gaps per 5-token request
    assert after[("wllm_generation_tokens_per_second", ())] > 0
    assert after[("wllm_prompt_tokens_total", ())] > 0
    for name in ("wllm_kv_cache_usage_ratio", "wllm_prefix_cache_hit_rate", "wllm_num_preemptions_total",
                 "wllm_num_requests_waiting"):
        assert any(k[0] == name for k in after), name


def test_spans_have_request_parent_and_phase_children() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(ScriptedEngine(), ServerConfig(served_model_names=["tiny"]), tracer_provider=provider)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    caller_span = "00f067aa0ba902b7"
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 3},
                   headers={"traceparent": f"00-{trace_id}-{caller_span}-01"})
        assert r.status_code == 200
        c.get("/health")  # probes are not traced
    spans = exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"POST /v1/chat/completions", "wllm.queue", "wllm.prefill", "wllm.decode"}
    root = by_name["POST /v1/chat/completions"]
    assert root.kind == SpanKind.SERVER
    assert format(root.context.trace_id, "032x") == trace_id
    assert format(root.parent.span_id, "016x") == caller_span
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["wllm.request_id"] == r.json()["id"]
    assert root.attributes["wllm.completion_tokens"] == 3
    for name in ("wllm.queue", "wllm.prefill", "wllm.decode"):
        child = by_name[name]
        assert child.parent.span_id == root.context.span_id and child.context.trace_id == root.context.trace_id
        assert child.start_time <= child.end_time
    assert by_name["wllm.queue"].end_time <= by_name["wllm.prefill"].start_time + 1_000
    assert by_name["wllm.prefill"].end_time <= by_name["wllm.decode"].start_time + 1_000


def _otlp_installed() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.exporter.otlp") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(_otlp_installed(), reason="the OTLP exporter is installed here")
def test_otlp_without_exporter_package_gives_clear_error() -> None:
    with pytest.raises(TracingSetupError, match="pip install opentelemetry-exporter-otlp"):
        otlp_tracer_provider("http://127.0.0.1:4318")


# ------------------------------------------------------------------ keys


def test_collect_api_keys_from_flags_env_and_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# team keys\nsk-file-1\n\n  sk-file-2  \nsk-flag\n", encoding="utf-8")
    env = {"WLLM_API_KEY": "sk-env", "WLLM_API_KEYS": "sk-a, sk-b,,"}
    keys = collect_api_keys(["sk-flag"], key_file, environ=env)
    assert keys == ["sk-flag", "sk-env", "sk-a", "sk-b", "sk-file-1", "sk-file-2"]
    assert collect_api_keys([], None, environ={}) == []
    with pytest.raises(APIKeyError, match="cannot read API key file"):
        collect_api_keys([], tmp_path / "missing.txt", environ={})
    (tmp_path / "empty.txt").write_text("# nothing\n", encoding="utf-8")
    with pytest.raises(APIKeyError, match="holds no keys"):
        collect_api_keys([], tmp_path / "empty.txt", environ={})


def test_key_checker_and_bearer_parsing() -> None:
    checker = APIKeyChecker(["alpha", "beta"])
    assert checker.enabled and not APIKeyChecker([]).enabled
    assert checker.check("beta") == key_id("beta") != key_id("alpha")
    assert checker.check("bet") is None and checker.check("") is None and checker.check(None) is None
    assert bearer_token("Bearer  tok ") == "tok" and bearer_token("bearer tok") == "tok"
    assert bearer_token("Basic abc") is None and bearer_token(None, "xk") == "xk"
    assert "alpha" not in repr(ServerConfig(api_keys=["alpha"]))


# ------------------------------------------------------------------ token buckets


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_request_bucket_refills_continuously() -> None:
    clock = Clock()
    limiter = RateLimiter(requests_per_minute=3, clock=clock)
    for _ in range(3):
        limiter.acquire("a")
    with pytest.raises(RateLimited) as info:
        limiter.acquire("a")
    assert info.value.retry_after == 20  # one request refills every 60/3 s
    limiter.acquire("b")  # other clients are unaffected
    clock.t += 19.0
    with pytest.raises(RateLimited) as info:
        limiter.acquire("a")
    assert info.value.retry_after == 1
    clock.t += 1.0
    limiter.acquire("a")


def test_token_bucket_charges_after_the_fact() -> None:
    clock = Clock()
    limiter = RateLimiter(tokens_per_minute=600, clock=clock)  # 10 tokens/s
    limiter.acquire("k")
    limiter.charge_tokens("k", 900)  # over budget: the bucket goes to -300
    with pytest.raises(RateLimited, match="600 tokens per minute") as info:
        limiter.acquire("k")
    assert info.value.retry_after == 30
    clock.t += 30.5
    limiter.acquire("k")
    with pytest.raises(ValueError, match="must be positive"):
        RateLimiter(requests_per_minute=0)


def test_client_table_is_bounded() -> None:
    limiter = RateLimiter(requests_per_minute=1, max_clients=2, clock=Clock())
    for name in ("a", "b", "c"):
        limiter.acquire(name)
    limiter.acquire("a")  # "a" was evicted as least recently seen, so it starts with a full bucket
    with pytest.raises(RateLimited):
        limiter.acquire("c")


def test_ttft_and_e2e_count_from_the_servers_arrival_queue_time_from_the_engines() -> None:
    """Time the request spent in the HTTP layer before the engine took it (parsing, tokenization, the
    hand-off to the engine thread) is in TTFT and end-to-end latency, not in queue time."""
    from wllm.entrypoints.openai.serving_common import EngineRun, RequestRecord, ServerContext
    from wllm.observability.metrics import ServerMetrics
    from wllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from wllm.sampling_params import SamplingParams

    metrics = ServerMetrics()
    ctx = ServerContext(ScriptedEngine(), ServerConfig(served_model_names=["tiny"]), metrics, None)
    record = RequestRecord()
    record.arrival = 100.0  # reached the server; the engine took it 0.5 s later
    run = EngineRun(ctx, record, [1, 2], SamplingParams(max_tokens=1), "r1")
    m = RequestMetrics(arrival_time=100.5, first_scheduled_time=100.6, first_token_time=100.8, finished_time=101.0)
    run.last = RequestOutput("r1", [1, 2], [CompletionOutput(0, "a", [3], finish_reason="length")], finished=True,
                             metrics=m)
    run._finish()
    assert record.queue_time == pytest.approx(0.1) and record.ttft == pytest.approx(0.8)
    assert metrics.ttft._sum.get() == pytest.approx(0.8) and metrics.e2e._sum.get() == pytest.approx(1.0)
