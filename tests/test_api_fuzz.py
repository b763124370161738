"""Schema-driven fuzzing: every operation in the generated OpenAPI schema, fed hostile values, never 5xx.

A small stand-in for a schemathesis run: for each JSON body field of each POST operation we send
wrong types, extreme numbers, empty and huge values; plus broken JSON, wrong body shapes and odd
path parameters. Every response must be a 2xx/4xx with an OpenAI error body for the 4xx.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import ScriptedEngine
from litestar.testing import TestClient

from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.config import ServerConfig

HOSTILE: list[Any] = [None, -1, 0, 2**70, -(2**70), 1e308, -0.5, "x", "", [], {}, [1, "a", None], True,
                      "\u0000\ud7ff" * 3, "y" * 5000, {"type": "text", "text": None}]

VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 3},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [104, 105]},
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 3},
    "/v1/messages": {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    # The scripted model generates: these answer 400 model_task_mismatch, then every field is still parsed.
    "/v1/embeddings": {"model": "tiny", "input": "hi"},
    "/v1/rerank": {"model": "tiny", "query": "q", "documents": ["a", "b"]},
    "/v1/score": {"model": "tiny", "text_1": "a", "text_2": "b"},
}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = create_app(ScriptedEngine(max_model_len=64), ServerConfig(served_model_names=["tiny"]))
    with TestClient(app) as c:
        yield c


def body_fields(schema: dict[str, Any], path: str) -> list[str]:
    op = schema["paths"][path]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    component = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    return sorted(component["properties"])


def check(r: Any, case: str) -> None:
    assert r.status_code < 500, f"{case}: {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        body = r.json()
        if case.startswith("/v1/messages"):  # Anthropic's error shape
            assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"], case
            return
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], case


def test_schema_lists_every_post_operation(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    posts = {p for p, ops in schema["paths"].items() if "post" in ops}
    assert posts == set(VALID)


@pytest.mark.parametrize("path", sorted(VALID))
def test_hostile_field_values_never_5xx(client: TestClient, path: str) -> None:
    schema = client.get("/openapi.json").json()
    fields = body_fields(schema, path)
    assert fields
    check(client.post(path, json=VALID[path]), f"{path} valid")
    for field in fields + ["unknown_field"]:
        for value in HOSTILE:
            body = {**VALID[path], field: value}
            check(client.post(path, json=body), f"{path} {field}={value!r:.40}")
        body = {k: v for k, v in VALID[path].items() if k != field}
        check(client.post(path, json=body), f"{path} without {field}")


@pytest.mark.parametrize("path", sorted(VALID))
def test_broken_bodies_never_5xx(client: TestClient, path: str) -> None:
    for raw in (b"", b"{", b"null", b"[]", b'"text"', b"123", b"\xff\xfe", b'{"a":' * 200, b"{}"):
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        check(r, f"{path} raw={raw[:20]!r}")
        assert r.status_code == 400
    check(client.post(path, content=b"model=tiny", headers={"content-type": "application/x-www-form-urlencoded"}),
          f"{path} form body")


def test_nested_message_values_never_5xx(client: TestClient) -> None:
    for bad in HOSTILE:
        for key in ("role", "content", "name", "tool_calls", "tool_call_id"):
            message = {"role": "user", "content": "hi", key: bad}
            check(client.post("/v1/chat/completions", json={"model": "tiny", "messages": [message]}),
                  f"message {key}={bad!r:.40}")
        check(client.post("/v1/chat/completions", json={"model": "tiny", "messages": [bad]}), f"message={bad!r:.40}")


def test_get_operations_and_path_params_never_5xx(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    for path, ops in schema["paths"].items():
        if "get" in ops:
            concrete = path.replace("{model_id}", "tiny")
            check(client.get(concrete), path)
    for model_id in ("x", "%00", "a/b/c", "..%2F..", "ü" * 300, "tiny/"):
        check(client.get(f"/v1/models/{model_id}"), model_id)
