"""The pooling routes and several models behind one app: `/v1/embeddings` through the official `openai`
client (float and base64), `/v1/rerank` (`/rerank`, `/v2/rerank`) and `/v1/score`, routing by `model`,
`/v1/models` with each model's task, and the 400 / 404 answers to bad input. In-process: a real all-MiniLM-
L6-v2 engine and a real tiny BERT cross-encoder beside a scripted chat engine (tests/fake_engine.py); the
end-to-end `wllm serve SmolLM2 MiniLM` run is tests/test_server_e2e_multi.py."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import transformers as tf
from fake_engine import ScriptedEngine
from litestar.testing import TestClient
from model_utils import one_thread, randomize
from test_embeddings import minilm_path

from wllm.engine.async_engine import AsyncEngine
from wllm.engine.llm_engine import LLMEngine
from wllm.entrypoints.llm import LLM
from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.config import ServerConfig


def _cross_encoder(folder: Path) -> None:
    config = tf.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        num_labels=1,
        architectures=["BertForSequenceClassification"],
    )
    torch.manual_seed(0)
    hf = tf.BertForSequenceClassification(config).eval()
    randomize(hf)
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_path() / name, folder / name)


@pytest.fixture(scope="module")
def app_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    ce = tmp_path_factory.mktemp("ce")
    _cross_encoder(ce)
    with one_thread():
        embed = AsyncEngine(LLMEngine.from_pretrained(str(minilm_path()), device="cpu"))
        rerank = AsyncEngine(LLMEngine.from_pretrained(str(ce), device="cpu"))
    chat = ScriptedEngine()
    base = ServerConfig(served_model_names=["chat"])
    app = create_app(
        chat,
        base,
        extra_models=[
            (embed, ServerConfig(served_model_names=["minilm"])),
            (rerank, ServerConfig(served_model_names=["ce"])),
        ],
    )
    with TestClient(app) as client:
        yield client
    embed.shutdown(close_engine=True)
    rerank.shutdown(close_engine=True)


@pytest.fixture(scope="module")
def oracle() -> Iterator[LLM]:
    with one_thread():
        llm = LLM(str(minilm_path()), device="cpu")
    yield llm
    llm.close()


def _client(app_client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=app_client, max_retries=0)


def test_openai_client_embeddings_float_and_base64(app_client: TestClient, oracle: LLM) -> None:
    client = _client(app_client)
    texts = ["hello world", "東京タワー 🗼", "def f(): pass"]
    want = oracle.embed(texts)
    got = client.embeddings.create(model="minilm", input=texts, encoding_format="float")
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == "minilm"
    for d, w in zip(got.data, want):
        assert len(d.embedding) == 384 and max(abs(a - b) for a, b in zip(d.embedding, w)) < 1e-5
    assert (
        got.usage.prompt_tokens == got.usage.total_tokens == sum(len(oracle.engine.tokenizer.encode(t)) for t in texts)
    )
    # The client's default asks for base64 and decodes it (little-endian float32).
    b64 = client.embeddings.create(model="minilm", input="hello world")
    assert max(abs(a - b) for a, b in zip(b64.data[0].embedding, want[0])) < 1e-6
    raw = app_client.post("/v1/embeddings", json={"model": "minilm", "input": "x", "encoding_format": "base64"})
    assert isinstance(raw.json()["data"][0]["embedding"], str)
    # Token ids, one list and a list of lists; and the unprefixed route.
    ids = oracle.engine.tokenizer.encode("hello world")
    one = app_client.post("/embeddings", json={"model": "minilm", "input": ids}).json()
    many = app_client.post("/v1/embeddings", json={"model": "minilm", "input": [ids, ids[:2]]}).json()
    assert max(abs(a - b) for a, b in zip(one["data"][0]["embedding"], want[0])) < 1e-5
    assert len(many["data"]) == 2 and many["usage"]["prompt_tokens"] == len(ids) + 2


def _error(response, status: int, param: str | None = None, code: str | None = None) -> str:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1.5, 2]}, "input"),
        ({"input": [["a"], [1]]}, "input"),
        ({"input": [{"text": "a"}]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": 5}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "x", "unknown": 1}, "unknown"),
    ],
)
def test_embeddings_bad_input(app_client: TestClient, body: dict, param: str) -> None:
    _error(app_client.post("/v1/embeddings", json={"model": "minilm", **body}), 400, param)


def test_too_long_and_truncation(app_client: TestClient, oracle: LLM) -> None:
    text = "word " * 300
    msg = _error(
        app_client.post("/v1/embeddings", json={"model": "minilm", "input": text}),
        400,
        "input",
        "context_length_exceeded",
    )
    assert "256" in msg and "302" in msg
    ok = app_client.post("/v1/embeddings", json={"model": "minilm", "input": text, "truncate_prompt_tokens": -1})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 256
    [want] = oracle.embed(text, truncate_prompt_tokens=-1)
    assert max(abs(a - b) for a, b in zip(ok.json()["data"][0]["embedding"], want)) < 1e-5


def test_routing_and_tasks(app_client: TestClient) -> None:
    models = app_client.get("/v1/models").json()["data"]
    assert [(m["id"], m["task"]) for m in models] == [("chat", "generate"), ("minilm", "embed"), ("ce", "rerank")]
    assert app_client.get("/v1/models/ce").json()["task"] == "rerank"
    msgs = [{"role": "user", "content": "hi"}]
    assert app_client.post("/v1/chat/completions", json={"model": "chat", "messages": msgs}).status_code == 200
    # No model named: each route takes the first model that can serve it.
    assert app_client.post("/v1/embeddings", json={"input": "x"}).json()["model"] == "minilm"
    assert app_client.post("/v1/chat/completions", json={"messages": msgs}).status_code == 200
    msg = _error(
        app_client.post("/v1/chat/completions", json={"model": "minilm", "messages": msgs}),
        400,
        "model",
        "model_task_mismatch",
    )
    assert "`minilm` is an embed model" in msg
    _error(app_client.post("/v1/embeddings", json={"model": "chat", "input": "x"}), 400, "model")
    assert "rerank model" in _error(app_client.post("/v1/embeddings", json={"model": "ce", "input": "x"}), 400)
    _error(app_client.post("/v1/rerank", json={"model": "chat", "query": "q", "documents": ["d"]}), 400, "model")
    _error(app_client.post("/v1/embeddings", json={"model": "nope", "input": "x"}), 404, "model", "model_not_found")
    _error(app_client.post("/v1/rerank", json={"model": "nope", "query": "q", "documents": ["d"]}), 404)
    tok = app_client.post("/tokenize", json={"model": "minilm", "prompt": "hello"}).json()
    assert tok["tokens"] == [101, 7592, 102] and tok["max_model_len"] == 256
    assert app_client.get("/health").status_code == 200


DOCS = [
    "The Eiffel Tower is in Paris, the capital of France.",
    "Bananas are rich in potassium.",
    "Paris is the capital and largest city of France.",
    "The stock market fell on Tuesday.",
]
QUERY = "What is the capital of France?"


@pytest.mark.parametrize("route", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_with_embed_model_orders_a_hand_made_set(app_client: TestClient, route: str) -> None:
    body = {"model": "minilm", "query": QUERY, "documents": [DOCS[0], {"text": DOCS[1]}, DOCS[2], DOCS[3]]}
    r = app_client.post(route, json=body).json()
    order = [x["index"] for x in r["results"]]
    assert set(order[:2]) == {0, 2} and set(order[2:]) == {1, 3}, r
    scores = [x["relevance_score"] for x in r["results"]]
    assert scores == sorted(scores, reverse=True)
    assert r["results"][0]["document"]["text"] == DOCS[order[0]] and r["usage"]["total_tokens"] > 0
    top = app_client.post(route, json={**body, "top_n": 1, "return_documents": False}).json()["results"]
    assert len(top) == 1 and top[0]["index"] == order[0] and "document" not in top[0]


def test_rerank_and_score_with_cross_encoder(app_client: TestClient, tmp_path: Path) -> None:
    folder = tmp_path / "ce"
    folder.mkdir()
    _cross_encoder(folder)
    with one_thread(), LLM(str(folder), device="cpu") as llm:
        want = llm.score(QUERY, DOCS)
    r = app_client.post("/v1/rerank", json={"model": "ce", "query": QUERY, "documents": DOCS}).json()
    got = {x["index"]: x["relevance_score"] for x in r["results"]}
    assert all(abs(got[i] - w) < 1e-6 for i, w in enumerate(want))
    assert [x["index"] for x in r["results"]] == sorted(range(4), key=lambda i: -want[i])
    s = app_client.post("/v1/score", json={"model": "ce", "text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in s["data"]] == [0, 1, 2, 3]
    assert all(abs(d["score"] - w) < 1e-6 for d, w in zip(s["data"], want))
    pairwise = app_client.post("/score", json={"model": "ce", "text_1": [QUERY, QUERY], "text_2": DOCS[:2]}).json()
    assert [round(d["score"], 6) for d in pairwise["data"]] == [round(w, 6) for w in want[:2]]


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "", "documents": ["d"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": ["d", 3]}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": [{"text": "d", "title": "t"}]}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": ["word " * 600]}, "documents"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": 5}, "text_2"),
    ],
)
def test_rerank_score_bad_input(app_client: TestClient, route: str, body: dict, param: str) -> None:
    for model in ("minilm", "ce"):
        _error(app_client.post(route, json={"model": model, **body}), 400, param)
