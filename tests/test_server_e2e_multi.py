"""`wllm serve SmolLM2-135M-Instruct minilm=<all-MiniLM-L6-v2>`: one real server process with a chat model and
an embedding model, each with its own engine, answering chat and embeddings at the same time through the
official `openai` client."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx
import openai
import pytest
from test_embeddings import minilm_path
from test_server_e2e import ServerProcess

from wllm.model.default_model import DEFAULT_MODEL_NAME, default_model_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    default_model_path()  # fetch outside the server's start-up deadline
    s = ServerProcess(
        [
            DEFAULT_MODEL_NAME,
            f"minilm={minilm_path()}",
            "--max-model-len",
            "512",
            "--kv-cache-memory",
            "0.25",
            "--no-engine-process",
        ],
        tmp_path_factory.mktemp("multi") / "server.log",
    )
    yield s
    s.stop()


def test_chat_and_embeddings_concurrently(server: ServerProcess) -> None:
    assert f"serving {DEFAULT_MODEL_NAME},minilm at" in "".join(server.stdout)
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    models = {m.id: m.model_dump()["task"] for m in client.models.list().data}
    assert models == {DEFAULT_MODEL_NAME: "generate", "minilm": "embed"}

    def chat() -> str:
        r = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            temperature=0,
            max_tokens=12,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        return r.choices[0].message.content or ""

    def embed(i: int) -> list[list[float]]:
        texts = [f"text {i}", "Paris is the capital of France.", "Bananas are yellow."]
        return [d.embedding for d in client.embeddings.create(model="minilm", input=texts).data]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        chats = [pool.submit(chat) for _ in range(2)]
        embeds = [pool.submit(embed, i) for i in range(4)]
        answers = [f.result() for f in chats]
        vectors = [f.result() for f in embeds]
    assert all("Paris" in a for a in answers), answers
    assert all(len(v) == 3 and len(v[0]) == 384 for v in vectors)
    assert max(abs(a - b) for a, b in zip(vectors[0][1], vectors[3][1])) < 1e-5  # same text, same embedding

    r = httpx.post(
        f"{server.root}/v1/rerank",
        timeout=60,
        json={
            "model": "minilm",
            "query": "What is the capital of France?",
            "documents": ["Bananas are yellow.", "Paris is the capital of France."],
        },
    ).json()
    assert [x["index"] for x in r["results"]] == [1, 0]
    bad = httpx.post(
        f"{server.base_url}/chat/completions",
        timeout=60,
        json={"model": "minilm", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert bad.status_code == 400 and "embed model" in bad.json()["error"]["message"]
