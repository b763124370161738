"""The OpenAI-compatible app against a scripted engine: wire format, validation, limits, lifecycle."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fake_engine import ScriptedEngine
from litestar.testing import TestClient

from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.config import ServerConfig
from wllm.sampling_params import SamplingParams

REPLY = "Hello! I am a scripted reply."
MSGS = [{"role": "user", "content": "hi"}]


def make_client(engine: ScriptedEngine | None = None, **config: object) -> tuple[TestClient, ScriptedEngine]:
    engine = engine or ScriptedEngine()
    cfg = ServerConfig(served_model_names=["tiny", "org/tiny-alias"], **config)  # type: ignore[arg-type]
    return TestClient(create_app(engine, cfg)), engine


@pytest.fixture
def client() -> Iterator[TestClient]:
    c, _ = make_client()
    with c:
        yield c


def sse(text: str) -> list[dict | str]:
    """Parse an SSE body strictly: every event is `data: ...` followed by a blank line."""
    assert text.endswith("\n\n")
    events: list[dict | str] = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def chat(client: TestClient, **body: object):
    return client.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, **body})


# ------------------------------------------------------------------ chat


def test_chat_non_streaming_wire_format(client: TestClient) -> None:
    r = chat(client, max_tokens=5, temperature=0)
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "tiny" and body["system_fingerprint"].startswith("wllm-")
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": REPLY[:5]}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    prompt_len = len("<s><|user|>hi\n<|assistant|>")  # the fake template, one token per character
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 5, "total_tokens": prompt_len + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_runs_to_eos_without_max_tokens(client: TestClient) -> None:
    body = chat(client, temperature=0).json()
    assert body["choices"][0]["message"]["content"] == REPLY
    assert body["choices"][0]["finish_reason"] == "stop"


def test_max_completion_tokens_wins_over_max_tokens(client: TestClient) -> None:
    body = chat(client, max_tokens=10, max_completion_tokens=3, temperature=0).json()
    assert body["choices"][0]["message"]["content"] == REPLY[:3]


def test_chat_streaming_matches_non_streaming(client: TestClient) -> None:
    r = chat(client, stream=True, temperature=0)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == REPLY
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("stop") == 1
    # As OpenAI ends a stream: content chunks carry finish_reason null, then one chunk with an empty delta
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
                                      "stop_reason": None}]
    assert chunks[-2]["choices"][0]["delta"]["content"]


def test_stream_tail_bytes(client: TestClient) -> None:
    """The last bytes of a chat stream with usage: final empty-delta chunk, usage chunk, [DONE]."""
    text = chat(client, stream=True, max_tokens=2, temperature=0, stream_options={"include_usage": True}).text
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    final, usage = json.loads(blocks[-4][len("data: "):]), json.loads(blocks[-3][len("data: "):])
    assert '"delta":{},"logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":null}' in blocks[-4]
    assert final["choices"][0]["delta"] == {} and usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2
    content = json.loads(blocks[-5][len("data: "):])
    assert content["choices"][0]["delta"] == {"content": REPLY[1]} and content["choices"][0]["finish_reason"] is None


def test_stream_include_usage(client: TestClient) -> None:
    events = sse(chat(client, stream=True, max_tokens=4, stream_options={"include_usage": True}).text)
    assert events[-1] == "[DONE]"
    *content, usage_chunk = events[:-1]
    assert all(c["usage"] is None for c in content)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 4


def test_n_choices_stream_and_non_stream(client: TestClient) -> None:
    body = chat(client, n=3, max_tokens=6).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 18
    events = sse(chat(client, n=2, max_tokens=6, stream=True).text)[:-1]
    texts: dict[int, str] = {0: "", 1: ""}
    roles = []
    for e in events:
        (ch,) = e["choices"]
        if "role" in ch["delta"]:
            roles.append(ch["index"])
        texts[ch["index"]] += ch["delta"].get("content", "")
    assert sorted(roles) == [0, 1]
    assert all(len(t) == 6 for t in texts.values())
    # each choice ends with its own empty-delta chunk carrying the finish_reason, and nothing after it
    for i in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
        assert all(ch["finish_reason"] is None for ch in mine[:-1])


def test_chat_logprobs_objects(client: TestClient) -> None:
    body = chat(client, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == list(REPLY[:3])
    assert content[0]["logprob"] == -0.25 and content[0]["bytes"] == [ord("H")]
    assert len(content[0]["top_logprobs"]) == 2
    assert content[0]["top_logprobs"][0] == {"token": "H", "logprob": -0.25, "bytes": [ord("H")]}
    # streamed logprobs carry the same tokens
    events = sse(chat(client, max_tokens=3, temperature=0, logprobs=True, top_logprobs=1, stream=True).text)[:-1]
    streamed = [t["token"] for e in events if e["choices"][0]["logprobs"]
                for t in e["choices"][0]["logprobs"]["content"]]
    assert streamed == list(REPLY[:3])


def test_stop_strings_cut_output(client: TestClient) -> None:
    body = chat(client, stop=["am"], temperature=0).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == "Hello! I "
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "am"
    streamed = sse(chat(client, stop="am", temperature=0, stream=True).text)[:-1]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in streamed) == "Hello! I "


def test_seed_reproducible_and_params_reach_engine() -> None:
    c, engine = make_client()
    with c:
        a = chat(c, seed=7, temperature=1.0).json()["choices"][0]["message"]["content"]
        b = chat(c, seed=7, temperature=1.0).json()["choices"][0]["message"]["content"]
        assert a == b
        chat(c, seed=1, top_k=5, min_p=0.1, repetition_penalty=1.2, ignore_eos=True, min_tokens=2, max_tokens=4,
             priority=3, cache_salt="salt", logit_bias={"40": 5}, stop_token_ids=[9], user="u1")
    _, params, _, priority, salt = engine.calls[-1]
    assert (params.top_k, params.min_p, params.repetition_penalty, params.ignore_eos, params.min_tokens) == (
        5, 0.1, 1.2, True, 2)
    assert params.logit_bias == {40: 5.0} and params.stop_token_ids == [9]
    assert (priority, salt) == (3, "salt")


def test_cached_tokens_reported_from_prefix_cache(client: TestClient) -> None:
    long = [{"role": "user", "content": "a long shared prefix for the cache " * 3}]
    first = client.post("/v1/chat/completions", json={"model": "tiny", "messages": long, "max_tokens": 2}).json()
    second = client.post("/v1/chat/completions", json={"model": "tiny", "messages": long, "max_tokens": 2}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"] and cached % 4 == 0


# ------------------------------------------------------------------ completions


def test_completions_prompt_shapes(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 2})
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 4  # BOS + one char, twice
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [0, 107], "max_tokens": 1,
                                             "temperature": 0})
    assert r.json()["choices"][0]["text"] == "H" and r.json()["usage"]["prompt_tokens"] == 2
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [[0, 107], [0, 108]], "max_tokens": 1})
    assert len(r.json()["choices"]) == 2


def test_completions_default_max_tokens_is_16(client: TestClient) -> None:
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "ignore_eos": True}).json()
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"


def test_completions_echo_and_logprobs(client: TestClient) -> None:
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "echo": True, "logprobs": 1,
                                                "max_tokens": 2, "temperature": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == "hiHe"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["<s>", "h", "i", "H", "e"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][3:] == [-0.25, -0.5]
    assert lp["top_logprobs"][3] == {"H": -0.25}
    assert lp["text_offset"] == [0, 3, 4, 5, 6]


def test_completions_streaming_echo_and_usage(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "echo": True, "max_tokens": 5,
                                             "temperature": 0, "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hi" + REPLY[:5]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
                                      "stop_reason": None}]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


def test_completions_stream_each_choice_gets_a_final_chunk(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 3,
                                             "stream": True})
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    by_index: dict[int, list[dict]] = {}
    for e in events[:-1]:
        (ch,) = e["choices"]
        by_index.setdefault(ch["index"], []).append(ch)
    assert sorted(by_index) == [0, 1, 2, 3]
    for chs in by_index.values():
        assert chs[-1] == {"index": chs[-1]["index"], "text": "", "logprobs": None, "finish_reason": "length",
                           "stop_reason": None}
        assert all(ch["finish_reason"] is None for ch in chs[:-1])
        assert len("".join(ch["text"] for ch in chs)) == 3


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"n": 99}, "n", "n must be between 1 and 16"),
        ({"temperature": -1}, "temperature", "temperature must be non-negative"),
        ({"temperature": 3}, "temperature", "[0, 2]"),
        ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"max_tokens": "ten"}, "max_tokens", "Expected `int | null`, got `str`"),
        ({"stop": ["x"] * 17}, "stop", "at most 16 stop sequences"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 500}}, "logit_bias", "[-100, 100]"),
        ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, "logprobs", "between 0 and 20"),
        ({"messages": []}, "messages", "at least one message"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "image_url"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "Invalid enum value"),
        ({"messages": MSGS * 2}, "messages", "roles must alternate"),
        # The scripted engine's character tokenizer is not a `tokenizers` one: refused, never unconstrained.
        ({"response_format": {"type": "json_object"}}, "response_format", "structured output needs"),
        ({"max_tokens": 250}, "messages", "maximum context length is 256 tokens"),
    ],
)
def test_chat_validation_400(client: TestClient, body: dict, param: str, fragment: str) -> None:
    r = chat(client, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert fragment in err["message"]


def test_context_length_exceeded_names_the_numbers(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 250, "max_tokens": 10})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "256" in err["message"] and "261" in err["message"] and "251 in the prompt" in err["message"]
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 300, "max_tokens": None})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"prompt": ["a", 1]}, "not a mix"),
        ({"prompt": []}, "must not be empty"),
        ({"prompt": [[]]}, "must not be empty"),
        ({"prompt": [-4]}, "out of range"),
        ({"prompt": "a", "suffix": "z"}, "suffix"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": 5}, "Expected `str | array`, got `int`"),
        ({}, "missing required field `prompt`"),
    ],
)
def test_completions_validation_400(client: TestClient, body: dict, fragment: str) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def test_malformed_json_is_400(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [', headers={
        "content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_unknown_model_and_route_are_404(client: TestClient) -> None:
    r = chat(client, model="gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.get("/v1/models/gpt-4").status_code == 404
    assert client.get("/v1/models/org/tiny-alias").json()["id"] == "org/tiny-alias"
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "org/tiny-alias"]
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    assert client.get("/v1/chat/completions").status_code == 405


def test_oversized_body_is_413() -> None:
    c, _ = make_client(max_body_bytes=1000)
    with c:
        r = chat(c, messages=[{"role": "user", "content": "x" * 2000}])
    assert r.status_code == 413 and r.json()["error"]["message"] == "Request body too large"


def test_queue_full_and_dead_engine_are_503() -> None:
    engine = ScriptedEngine(max_waiting=1)
    engine.active["someone-else"] = SamplingParams()  # the one waiting slot is taken
    c, _ = make_client(engine)
    with c:
        r = chat(c)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "queue is full" in r.json()["error"]["message"]
        r = chat(c, stream=True)
        assert r.status_code == 503
        assert c.get("/health").status_code == 200
        engine.healthy = False
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"


# ------------------------------------------------------------------ auth, limits, CORS


def test_api_keys_401_and_success() -> None:
    c, _ = make_client(api_keys=["sk-one", "sk-two"])
    with c:
        r = chat(c)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "Missing API key" in r.json()["error"]["message"]
        r = chat(c, stream=True)
        assert r.status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sk-two"}).status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": "sk-one"}).status_code == 200
        # operational endpoints stay open for probes and scrapers
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_routes_without_v1_prefix_same_handlers_same_auth() -> None:
    c, _ = make_client(api_keys=["sk-one"])
    key = {"Authorization": "Bearer sk-one"}
    with c:
        for path in ("/models", "/models/tiny", "/models/org/tiny-alias"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert c.get(path, headers=key).json() == c.get("/v1" + path, headers=key).json()
        assert c.get("/models/nope", headers=key).json()["error"]["code"] == "model_not_found"
        body = {"model": "tiny", "messages": MSGS, "max_tokens": 4, "temperature": 0}
        assert c.post("/chat/completions", json=body).status_code == 401
        r = c.post("/chat/completions", json=body, headers=key)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY[:4]
        events = sse(c.post("/chat/completions", json={**body, "stream": True}, headers=key).text)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0}
        assert c.post("/completions", json=body).status_code == 401
        r = c.post("/completions", json=body, headers=key)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLY[:3]
        assert c.post("/completions", json={"prompt": 5}, headers=key).status_code == 400
        assert c.post("/tokenize", json={"prompt": "hi"}, headers=key).json()["count"] == 3
        # the schema lists each operation once, under /v1
        paths = c.get("/openapi.json").json()["paths"]
        assert "/v1/chat/completions" in paths and "/chat/completions" not in paths
        # each alias has its own metric label, not "other"
        metrics = c.get("/metrics").text
        assert 'endpoint="/chat/completions"' in metrics and 'endpoint="/models"' in metrics


def test_metrics_auth_flag() -> None:
    # default: /metrics stays open even with keys set (test_api_keys_401_and_success checks it too)
    c, _ = make_client(api_keys=["sk-one"])
    with c:
        assert c.get("/metrics").status_code == 200
    c, _ = make_client(api_keys=["sk-one"], metrics_auth=True, rate_limit_rpm=1)
    with c:
        r = c.get("/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/metrics", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        for _ in range(3):  # the key is checked, but scrapes are not rate limited
            r = c.get("/metrics", headers={"Authorization": "Bearer sk-one"})
            assert r.status_code == 200 and "wllm_requests" in r.text
        assert c.get("/health").status_code == 200  # probes stay open
    c, _ = make_client(metrics_auth=True)  # no keys: nothing to check
    with c:
        assert c.get("/metrics").status_code == 200


def test_rate_limit_requests_per_minute_per_ip() -> None:
    c, _ = make_client(rate_limit_rpm=2)
    with c:
        assert c.get("/v1/models").status_code == 200
        assert c.get("/v1/models").status_code == 200
        r = c.get("/v1/models")
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(r.headers["retry-after"]) >= 1


def test_rate_limit_per_key_and_tokens_per_minute() -> None:
    c, _ = make_client(api_keys=["k1", "k2"], rate_limit_tpm=20)
    with c:
        k1 = {"Authorization": "Bearer k1"}
        assert chat(c, max_tokens=5).status_code == 401
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 5}, headers=k1)
        assert r.status_code == 200  # 32 tokens used: the bucket of 20 is now negative
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 5}, headers=k1)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "tokens per minute" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 5},
                   headers={"Authorization": "Bearer k2"})
        assert r.status_code == 200  # another key has its own bucket


def test_cors_only_when_origins_given() -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    c, _ = make_client()
    with c:
        assert "access-control-allow-origin" not in c.get("/v1/models", headers={"Origin": "https://x"}).headers
    c, _ = make_client(cors_origins=["https://app.example"])
    with c:
        r = c.options("/v1/chat/completions", headers=preflight)
        assert r.status_code in (200, 204)
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.options("/chat/completions", headers=preflight)  # the route without /v1 too
        assert r.status_code in (200, 204)


def test_refused_cors_preflight_is_a_json_error() -> None:
    c, _ = make_client(cors_origins=["https://app.example"])
    with c:
        for path in ("/v1/chat/completions", "/models", "/nowhere"):
            r = c.options(path, headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
            assert r.status_code == 400 and r.headers["content-type"] == "application/json"
            assert "access-control-allow-origin" not in r.headers
            assert r.json() == {"error": {"message": "CORS preflight refused: disallowed Origin (see --cors-origin).",
                                          "type": "invalid_request_error", "param": None, "code": "cors_disallowed"}}
        # an allowed origin's simple request is unchanged
        r = c.get("/v1/models", headers={"Origin": "https://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"


# ------------------------------------------------------------------ small endpoints


def test_tokenize_detokenize_version_openapi(client: TestClient) -> None:
    r = client.post("/tokenize", json={"model": "tiny", "prompt": "hi"})
    assert r.json() == {"count": 3, "max_model_len": 256, "tokens": [0, 107, 108]}
    r = client.post("/tokenize", json={"messages": MSGS})
    assert r.json()["count"] == len("<s><|user|>hi\n<|assistant|>")
    assert client.post("/tokenize", json={}).status_code == 400
    assert client.post("/detokenize", json={"tokens": [0, 107, 108]}).json() == {"prompt": "<s>hi"}
    assert client.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    from wllm.version import __version__

    assert client.get("/version").json() == {"version": __version__}
    schema = client.get("/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize"} <= set(schema["paths"])


def test_logprob_bytes_are_exact_for_partial_characters() -> None:
    from fake_engine import CharTokenizer

    from wllm.entrypoints.openai.serving_common import ServerContext
    from wllm.observability.metrics import ServerMetrics

    class PieceTokenizer(CharTokenizer):
        pieces = {900: "ä½", 901: "<0xE4>", 902: "Ġhi"}

        def decode(self, token_ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
            return "".join("\ufffd" if t in (900, 901) else " hi" if t == 902 else CharTokenizer.decode(self, [t])
                           for t in token_ids)

        def id_to_token(self, token_id: int) -> str | None:
            return self.pieces.get(token_id)

    engine = ScriptedEngine()
    engine.tokenizer = PieceTokenizer()
    ctx = ServerContext(engine, ServerConfig(), ServerMetrics(), None)
    assert ctx.token_bytes(900) == [0xE4, 0xBD]  # byte-level BPE piece: the first two bytes of 你
    assert ctx.token_bytes(901) == [0xE4]  # SentencePiece byte fallback
    assert ctx.token_bytes(902) == list(b" hi")
    assert ctx.token_bytes(ord("é") + 3) == list("é".encode())
