"""The pooling routes: `/v1/embeddings` (OpenAI), `/v1/rerank` (Cohere / Jina) and `/v1/score` (vLLM).

Each input becomes one engine request with `PoolingParams`; the engine runs it whole in one step and returns
the pooled vector (`RequestOutput.pooled`). Rerank and score run each (query, document) pair through a
rerank model (a cross-encoder, or a yes/no decoder reranker), or, for an embed model, compare the cosine
similarity of the embeddings of each text.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from collections.abc import Sequence
from typing import Any

from litestar import Request

from wllm.entrypoints.openai.errors import APIError, bad_request
from wllm.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from wllm.entrypoints.openai.serving_common import EngineRun, RequestRecord, ServerContext, new_id, unless_disconnected
from wllm.model.pooling import InputTooLongError, PoolingConfig, check_dimensions, embed_input, pair_input
from wllm.outputs import RequestOutput
from wllm.pooling_params import PoolingParams

# Most inputs one request may carry (OpenAI's own limit for embeddings), and most rerank documents.
MAX_INPUTS = 2048


def _input_error(exc: ValueError, param: str) -> APIError:
    code = "context_length_exceeded" if isinstance(exc, InputTooLongError) else None
    return bad_request(str(exc), param=param, code=code)


def _embedding_inputs(value: str | list[Any], vocab: int | None) -> list[str | list[int]]:
    """`input` as a list of texts or token-id lists; a 400 naming what is wrong."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and all(type(v) is int for v in value):
        items = [value]  # one input as token ids
    else:
        items = value
    if not items:
        raise bad_request("input must not be an empty list", param="input")
    if len(items) > MAX_INPUTS:
        raise bad_request(f"input may have at most {MAX_INPUTS} items, got {len(items)}", param="input")
    out: list[str | list[int]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise bad_request(f"input[{i}] is an empty string", param="input")
            out.append(item)
        elif isinstance(item, list) and item and all(type(t) is int for t in item):
            bad = [t for t in item if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise bad_request(f"input[{i}] has token id {bad[0]}, outside the vocabulary", param="input")
            out.append(item)
        else:
            raise bad_request(
                f"input[{i}] must be a non-empty string or a non-empty list of token ids "
                f"(integers), got {_describe(item)}",
                param="input",
            )
    return out


def _describe(value: Any) -> str:
    if isinstance(value, list):
        return "an empty list" if not value else "a list with other items than integers"
    return {dict: "an object", float: "a number", bool: "a boolean", type(None): "null"}.get(type(value), "a value")


def _vocab(ctx: ServerContext) -> int | None:
    vocab = getattr(ctx.engine.tokenizer, "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def _check_truncate(value: int | None) -> None:
    if value is not None and value != -1 and value < 1:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 (the model's maximum) or at least 1, got {value}",
            param="truncate_prompt_tokens",
        )


async def _run_all(
    ctx: ServerContext,
    record: RequestRecord,
    request: Request[Any, Any, Any],
    prefix: str,
    prompts: Sequence[tuple[list[int], PoolingParams]],
) -> list[RequestOutput]:
    """Run every prompt as its own engine request (they batch in the engine's steps); outputs in order."""
    request_id = new_id(prefix)
    record.request_id = request_id
    runs = [EngineRun(ctx, record, ids, params, f"{request_id}-{i}") for i, (ids, params) in enumerate(prompts)]

    async def all_runs() -> list[RequestOutput]:
        tasks = [asyncio.ensure_future(run.final()) for run in runs]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # one failed: the others are aborted (EngineRun aborts on cancel)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    outs = await unless_disconnected(all_runs(), request.receive)
    for out in outs:
        if out.pooled is None:
            raise APIError(500, "The engine returned no pooled output", type="internal_error")
    return outs


def _b64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def create_embeddings(
    ctx: ServerContext, req: EmbeddingRequest, request: Request[Any, Any, Any], record: RequestRecord
) -> EmbeddingResponse:
    ctx = ctx.route(req.model, "/v1/embeddings", ("embed",))
    ctx.check_healthy()
    pooling: PoolingConfig = ctx.engine.pooling  # type: ignore[attr-defined]
    why = check_dimensions(pooling, req.dimensions)
    if why is not None:
        raise bad_request(why, param="dimensions")
    _check_truncate(req.truncate_prompt_tokens)
    tok, max_len = ctx.engine.tokenizer, ctx.engine.max_model_len
    params = PoolingParams(dimensions=req.dimensions)

    def tokenize() -> list[tuple[list[int], PoolingParams]]:
        prompts = []
        for i, item in enumerate(_embedding_inputs(req.input, _vocab(ctx))):
            try:
                prompts.append((embed_input(tok, item, max_len, req.truncate_prompt_tokens, what=f"input[{i}]"),
                                params))
            except ValueError as exc:
                raise _input_error(exc, "input") from None
        return prompts

    prompts = await ctx.prep.run(record.body_bytes, tokenize)  # off the event loop for a large body
    outs = await _run_all(ctx, record, request, "embd", prompts)
    encode = _b64 if req.encoding_format == "base64" else list
    data = [EmbeddingData(index=i, embedding=encode(out.pooled or [])) for i, out in enumerate(outs)]
    tokens = sum(len(ids) for ids, _ in prompts)
    return EmbeddingResponse(data=data, model=ctx.model_name, usage=EmbeddingUsage(tokens, tokens))


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


async def _pair_scores(
    ctx: ServerContext,
    record: RequestRecord,
    request: Request[Any, Any, Any],
    prefix: str,
    pairs: Sequence[tuple[str, str]],
    truncate: int | None,
) -> tuple[list[float], int]:
    """The relevance score of each (query, document) pair, and the tokens computed."""
    _check_truncate(truncate)
    pooling: PoolingConfig = ctx.engine.pooling  # type: ignore[attr-defined]
    tok, max_len = ctx.engine.tokenizer, ctx.engine.max_model_len
    if pooling.pairs_as_one_prompt:
        def tokenize_pairs() -> list[tuple[list[int], PoolingParams]]:
            prompts = []
            for i, (query, doc) in enumerate(pairs):
                try:
                    ids, type_start = pair_input(tok, pooling, query, doc, max_len, truncate, what=f"pair {i}")
                except ValueError as exc:
                    raise _input_error(exc, "documents") from None
                prompts.append((ids, PoolingParams(token_type_start=type_start)))
            return prompts

        prompts = await ctx.prep.run(record.body_bytes, tokenize_pairs)  # off the event loop for a large body
        outs = await _run_all(ctx, record, request, prefix, prompts)
        return [(out.pooled or [0.0])[0] for out in outs], sum(len(ids) for ids, _ in prompts)
    # An embed model: the cosine similarity of the two texts' embeddings, each text embedded once.
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))

    def tokenize_texts() -> list[tuple[list[int], PoolingParams]]:
        prompts = []
        for text in texts:
            try:
                prompts.append((embed_input(tok, text, max_len, truncate, what="text"), PoolingParams()))
            except ValueError as exc:
                raise _input_error(exc, "documents") from None
        return prompts

    prompts = await ctx.prep.run(record.body_bytes, tokenize_texts)
    outs = await _run_all(ctx, record, request, prefix, prompts)
    vectors = {text: out.pooled or [] for text, out in zip(texts, outs)}
    return [_cosine(vectors[q], vectors[d]) for q, d in pairs], sum(len(ids) for ids, _ in prompts)


def _document_text(doc: Any, i: int) -> str:
    if isinstance(doc, dict) and set(doc) == {"text"}:
        doc = doc["text"]
    if not isinstance(doc, str):
        raise bad_request(
            f'documents[{i}] must be a string or an object {{"text": string}}, got {_describe(doc)}', param="documents"
        )
    if not doc:
        raise bad_request(f"documents[{i}] is empty", param="documents")
    return doc


async def create_rerank(
    ctx: ServerContext, req: RerankRequest, request: Request[Any, Any, Any], record: RequestRecord
) -> RerankResponse:
    ctx = ctx.route(req.model, "/v1/rerank", ("rerank", "embed"))
    ctx.check_healthy()
    if not req.query:
        raise bad_request("query must not be empty", param="query")
    if not req.documents:
        raise bad_request("documents must not be an empty list", param="documents")
    if len(req.documents) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} documents are allowed, got {len(req.documents)}", param="documents")
    if req.top_n is not None and req.top_n < 1:
        raise bad_request(f"top_n must be at least 1, got {req.top_n}", param="top_n")
    docs = [_document_text(d, i) for i, d in enumerate(req.documents)]
    scores, tokens = await _pair_scores(
        ctx, record, request, "rerank", [(req.query, d) for d in docs], req.truncate_prompt_tokens
    )
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[: req.top_n or len(docs)]
    results = [
        RerankResult(
            index=i,
            relevance_score=scores[i],
            **({"document": RerankDocument(docs[i])} if req.return_documents else {}),
        )
        for i in order
    ]
    return RerankResponse(
        id=record.request_id or new_id("rerank"), model=ctx.model_name, results=results, usage=RerankUsage(tokens)
    )


async def create_score(
    ctx: ServerContext, req: ScoreRequest, request: Request[Any, Any, Any], record: RequestRecord
) -> ScoreResponse:
    ctx = ctx.route(req.model, "/v1/score", ("rerank", "embed"))
    ctx.check_healthy()
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    for name, texts in (("text_1", first), ("text_2", second)):
        if not texts:
            raise bad_request(f"{name} must not be an empty list", param=name)
        if any(not t for t in texts):
            raise bad_request(f"{name} has an empty string", param=name)
        if len(texts) > MAX_INPUTS:
            raise bad_request(f"{name} may have at most {MAX_INPUTS} texts", param=name)
    if len(first) == 1:
        pairs = [(first[0], t) for t in second]
    elif len(first) == len(second):
        pairs = list(zip(first, second))
    else:
        raise bad_request(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
            "as text_2 (scored pairwise)",
            param="text_1",
        )
    scores, tokens = await _pair_scores(ctx, record, request, "score", pairs, req.truncate_prompt_tokens)
    return ScoreResponse(
        id=record.request_id or new_id("score"),
        model=ctx.model_name,
        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=EmbeddingUsage(tokens, tokens),
    )
