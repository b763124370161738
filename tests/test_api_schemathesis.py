"""A schemathesis run against the server's own OpenAPI schema: no generated request may get a 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from fake_engine import ScriptedEngine  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from wllm.entrypoints.openai.app import create_app  # noqa: E402
from wllm.entrypoints.openai.config import ServerConfig  # noqa: E402

app = create_app(ScriptedEngine(max_model_len=64), ServerConfig(served_model_names=["tiny"]))
schema = schemathesis.openapi.from_asgi("/openapi.json", app)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case) -> None:
    response = case.call()
    case.validate_response(response, checks=(not_a_server_error,))
    if response.status_code >= 400:
        body = response.json()
        if case.path.startswith("/v1/messages"):  # Anthropic's routes answer in Anthropic's error shape
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
            return
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
