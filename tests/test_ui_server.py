"""The web UI's server side without a browser: the static routes, their security headers, --no-ui, and
GET /v1/engine/stats (shape, values, auth). The page itself runs in tests/test_ui_browser.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fake_engine import ScriptedEngine
from litestar.testing import TestClient

from wllm.cli import build_parser
from wllm.engine.config import CacheConfig, SchedulerConfig
from wllm.engine.request import RequestGroup
from wllm.engine.sampler import SampledToken
from wllm.engine.scheduler import Scheduler
from wllm.engine.step_plan import RowResult
from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.config import ServerConfig
from wllm.entrypoints.ui import load_static_files
from wllm.observability.metrics import RecentSamples
from wllm.sampling_params import SamplingParams

MSGS = [{"role": "user", "content": "hi"}]


def make_client(engine: Any = None, **config: Any) -> TestClient:
    return TestClient(create_app(engine or ScriptedEngine(), ServerConfig(served_model_names=["tiny"], **config)))


def test_page_and_its_files_are_served_with_a_strict_csp() -> None:
    with make_client() as c:
        r = c.get("/")
        assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
        csp = {d.split()[0]: d.split()[1:] for d in r.headers["content-security-policy"].split("; ")}
        assert csp["default-src"] == ["'self'"] and csp["script-src"] == ["'self'"]
        assert csp["frame-ancestors"] == ["'none'"] and csp["connect-src"] == ["'self'"]
        assert not any("unsafe" in v or "*" in v for values in csp.values() for v in values)
        assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
        html = r.text
        # No inline script or handler, no inline style: everything the CSP allows comes from /ui/ files.
        assert all(m.group(1) for m in re.finditer(r"<script([^>]*\bsrc=)?", html))
        assert not re.search(r"\son\w+=|\sstyle=|javascript:", html)
        referenced = re.findall(r'(?:src|href)="(/ui/[^"]+)"', html)
        assert "/ui/app.js" in referenced and "/ui/style.css" in referenced
        types = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
        for path in referenced:
            f = c.get(path)
            assert f.status_code == 200, path
            assert f.headers["content-type"].startswith(types[path[path.rindex(".") :]]), path
            assert "frame-ancestors 'none'" in f.headers["content-security-policy"]
        # Every module the page imports is served.
        for name, file in load_static_files().items():
            if name.endswith(".js"):
                for dep in re.findall(r'from "\./([^"]+)"', file.body.decode()):
                    assert c.get(f"/ui/{dep}").status_code == 200, (name, dep)
        # Revalidation is cheap: the same ETag is a 304 with no body.
        etag = c.get("/ui/app.js").headers["etag"]
        again = c.get("/ui/app.js", headers={"If-None-Match": etag})
        assert again.status_code == 304 and again.content == b""


@pytest.mark.parametrize(
    "path",
    [
        "/ui/../app.py",
        "/ui/..%2F..%2Fapp.py",
        "/ui/%2e%2e%2fconfig.py",
        "/ui/__init__.py",
        "/ui/static",
        "/ui/..%5C__init__.py",
        "/ui/C:%5Cwindows%5Cwin.ini",
        "/ui/",
        "/ui/x/app.js",
        "/index.html",
        "/ui/%2Fetc%2Fpasswd",
    ],
)
def test_static_routes_reach_nothing_outside_the_ui_folder(path: str) -> None:
    with make_client() as c:
        r = c.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


def test_static_routes_are_read_only() -> None:
    with make_client() as c:
        for method in ("post", "put", "delete", "patch"):
            assert getattr(c, method)("/").status_code == 405
            assert getattr(c, method)("/ui/app.js").status_code == 405


def test_no_ui_flag_turns_the_page_off() -> None:
    args = build_parser().parse_args(["serve", "--no-ui"])
    assert args.ui is False and build_parser().parse_args(["serve"]).ui is True
    with make_client(ui=False) as c:
        r = c.get("/")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert c.get("/ui/app.js").status_code == 404
        assert c.get("/v1/engine/stats").status_code == 200  # the API stays


def test_the_page_is_public_and_holds_no_key_the_api_asks_for_one() -> None:
    with make_client(api_keys=["sk-secret-ui"]) as c:
        for path in ["/", *(f"/ui/{name}" for name in load_static_files())]:
            r = c.get(path)
            assert r.status_code == 200 and b"sk-secret-ui" not in r.content, path
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "Bearer sk-secret-ui"}).status_code == 200


class BlockEngine(ScriptedEngine):
    """The scripted engine with the block counts and counters of the real one."""

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s.update(
            num_gpu_blocks=100,
            num_free_blocks=60,
            num_cached_blocks=25,
            num_swapped=1,
            prefix_cache_queries=40,
            prefix_cache_hits=10,
            prefix_cache_hit_rate=0.25,
            num_preemptions_swap=2,
            num_preemptions_recompute=3,
            num_preemptions=5,
        )
        return s


def test_engine_stats_shape_and_values() -> None:
    with make_client(BlockEngine()) as c:
        first = c.get("/v1/engine/stats").json()
        assert first["ttft_s"] == {"count": 0, "p50": None, "p90": None, "p99": None}
        for _ in range(2):
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "stream": True})
            assert r.status_code == 200
        s = c.get("/v1/engine/stats").json()
    assert set(s) == {
        "time",
        "healthy",
        "requests",
        "tokens_per_second",
        "generation_tokens",
        "kv_cache",
        "prefix_cache",
        "preemptions",
        "window_s",
        "ttft_s",
        "itl_s",
    }
    assert s["healthy"] is True and s["time"] > first["time"]
    assert s["requests"] == {"running": 0, "waiting": 0, "swapped": 1}
    assert s["kv_cache"] == {"usage": 0.0, "blocks_total": 100, "blocks_used": 40, "blocks_cached": 25}
    assert s["prefix_cache"] == {"hit_rate": 0.25, "queries": 40, "hits": 10}
    assert s["preemptions"] == {"total": 5, "swap": 2, "recompute": 3}
    reply_tokens = s["generation_tokens"] - first["generation_tokens"]
    assert reply_tokens >= 2 and s["tokens_per_second"] == pytest.approx(reply_tokens / 10.0)
    assert s["ttft_s"]["count"] == 2 and 0 <= s["ttft_s"]["p50"] <= s["ttft_s"]["p90"] <= s["ttft_s"]["p99"]
    assert s["itl_s"]["count"] >= reply_tokens - 2 and s["itl_s"]["p99"] >= s["itl_s"]["p50"] >= 0
    assert s["window_s"] == 60.0


def test_engine_stats_survive_an_engine_without_block_counts_or_a_failed_one() -> None:
    engine = ScriptedEngine()
    with make_client(engine) as c:
        s = c.get("/v1/engine/stats").json()
        assert s["kv_cache"]["blocks_total"] is None and s["kv_cache"]["blocks_used"] is None
        engine.stats = lambda: (_ for _ in ()).throw(RuntimeError("engine gone"))  # type: ignore[method-assign]
        r = c.get("/v1/engine/stats")
        assert r.status_code == 200 and r.json()["requests"]["running"] == 0


def test_engine_stats_auth_follows_metrics_auth() -> None:
    with make_client(api_keys=["sk-one"]) as c:  # default: open like /metrics
        assert c.get("/v1/engine/stats").status_code == 200
    with make_client(api_keys=["sk-one"], metrics_auth=True, rate_limit_rpm=1) as c:
        r = c.get("/v1/engine/stats")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/engine/stats", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        for _ in range(3):  # polled every second by the UI: checked, never rate limited
            assert c.get("/v1/engine/stats", headers={"X-API-Key": "sk-one"}).status_code == 200


def test_recent_samples_window_and_nearest_rank() -> None:
    samples = RecentSamples(window_s=10.0, max_samples=1000)
    assert samples.percentiles(now=0.0) == (0, [None, None, None])
    for i in range(1, 101):
        samples.add(float(i), now=0.0)
    assert samples.percentiles((0.5, 0.9, 0.99, 1.0), now=5.0) == (100, [50.0, 90.0, 99.0, 100.0])
    samples.add(1000.0, now=8.0)
    assert samples.percentiles((0.5,), now=10.5) == (1, [1000.0])  # the first hundred left the window
    capped = RecentSamples(window_s=10.0, max_samples=3)
    for v in (1.0, 2.0, 3.0, 4.0):
        capped.add(v, now=0.0)
    assert capped.percentiles((0.0, 1.0), now=0.0) == (3, [2.0, 4.0])


def test_scheduler_reports_cached_blocks() -> None:
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), CacheConfig(block_size=4), 16, 0, 256, [0]
    )
    assert s.stats()["num_cached_blocks"] == 0
    s.add_group(RequestGroup("r", list(range(100, 110)), SamplingParams(temperature=0, max_tokens=4)))
    out = s.schedule()
    s.update_from_output(out, {x.seq_id: RowResult([SampledToken(7, -0.5)]) for x in out.rows})
    assert s.stats()["num_cached_blocks"] == 2  # the prompt's two full blocks of 4 tokens
