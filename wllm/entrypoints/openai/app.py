"""The Litestar application: routes, auth and rate-limit guard, CORS, body limit, error bodies, the web UI.

`create_app(engine, config)` builds an app around anything that satisfies `EngineClient`; the
`wllm serve` command passes the real AsyncEngine, tests pass a scripted fake.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from litestar import Litestar, Request, Response, Router, delete, get, post
from litestar.config.cors import CORSConfig
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers.base import BaseRouteHandler
from litestar.middleware._internal.cors import CORSMiddleware
from litestar.middleware.base import DefineMiddleware
from litestar.openapi import OpenAPIConfig
from litestar.params import FromPath, JSONBody
from opentelemetry.sdk.trace import TracerProvider

from wllm.entrypoints.openai.auth import bearer_token
from wllm.entrypoints.openai.config import ServerConfig
from wllm.entrypoints.openai.decoding import StrictRequest
from wllm.entrypoints.openai.engine_client import EngineClient
from wllm.entrypoints.openai.errors import EXCEPTION_HANDLERS, APIError, bad_request, client_closed, error_response
from wllm.entrypoints.openai.middleware import JSONErrorCORSMiddleware, ObservabilityMiddleware, client_host
from wllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    EngineStatsResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from wllm.entrypoints.openai.protocol_anthropic import CountTokensRequest, MessageObject, MessagesRequest, TokenCount
from wllm.entrypoints.openai.protocol_responses import DeletedResponse, ResponseObject, ResponsesRequest
from wllm.entrypoints.openai.rate_limit import RateLimited
from wllm.entrypoints.openai.serving_chat import chat_prompt_ids, create_chat_completion
from wllm.entrypoints.openai.serving_common import STATE_KEY, ClientDisconnected, RequestRecord, ServerContext
from wllm.entrypoints.openai.serving_completions import create_completion
from wllm.entrypoints.openai.serving_messages import ANTHROPIC_HANDLERS, by_path, count_tokens, create_message
from wllm.entrypoints.openai.serving_pooling import create_embeddings, create_rerank, create_score
from wllm.entrypoints.openai.serving_responses import ResponseStore, create_response, not_found
from wllm.entrypoints.openai.serving_stats import engine_stats
from wllm.model.pooling import TASKS
from wllm.observability.metrics import CONTENT_TYPE, ServerMetrics
from wllm.observability.tracing import RequestTracer
from wllm.version import __version__


def _ctx(connection: ASGIConnection[Any, Any, Any, Any]) -> ServerContext:
    return connection.app.state["server"]


def _record(connection: ASGIConnection[Any, Any, Any, Any]) -> RequestRecord:
    record = connection.scope.get("state", {}).get(STATE_KEY)
    if record is None:  # only when the middleware is bypassed (never in the served app)
        record = RequestRecord()
        connection.scope.setdefault("state", {})[STATE_KEY] = record  # type: ignore[typeddict-item]
    return record


def _check_api_key(connection: ASGIConnection[Any, Any, Any, Any], ctx: ServerContext, record: RequestRecord) -> None:
    """401 unless the request carries one of the keys (when keys are set); records the key id."""
    if not ctx.keys.enabled:
        return
    presented = bearer_token(connection.headers.get("authorization"), connection.headers.get("x-api-key"))
    kid = ctx.keys.check(presented)
    if kid is None:
        message = ("Missing API key: send it as `Authorization: Bearer <key>`." if presented is None
                   else "Incorrect API key provided.")
        raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    record.key_id = kid


async def metrics_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """With `--metrics-auth`, /metrics and /v1/engine/stats need an API key like the API does (no rate limit:
    scrapers and the web UI poll)."""
    ctx = _ctx(connection)
    if ctx.config.metrics_auth:
        _check_api_key(connection, ctx, _record(connection))


async def access_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """API key check (401) then per-key or per-IP token buckets (429 + Retry-After). A coroutine: Litestar
    runs a plain-function guard in a worker thread, a thread hop (two GIL hand-offs) per request."""
    ctx = _ctx(connection)
    record = _record(connection)
    _check_api_key(connection, ctx, record)
    try:
        ctx.limiter.acquire(record.key_id or client_host(connection.scope))
    except RateLimited as exc:
        raise APIError(429, f"{exc} for this {'key' if record.key_id else 'client'}; retry after "
                       f"{exc.retry_after} s.", type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(exc.retry_after)}) from None


@post("/v1/chat/completions", status_code=200, summary="Create a chat completion")
async def chat_completions(
    request: Request[Any, Any, Any], data: JSONBody[ChatCompletionRequest]
) -> Response[ChatCompletionResponse]:
    return await create_chat_completion(_ctx(request), data, request, _record(request))  # type: ignore[return-value]


@post("/v1/completions", status_code=200, summary="Create a text completion")
async def completions(
    request: Request[Any, Any, Any], data: JSONBody[CompletionRequest]
) -> Response[CompletionResponse]:
    return await create_completion(_ctx(request), data, request, _record(request))  # type: ignore[return-value]


def _store(connection: ASGIConnection[Any, Any, Any, Any]) -> ResponseStore:
    return connection.app.state["responses"]


@post("/v1/responses", status_code=200, summary="Create a model response (OpenAI Responses API)")
async def responses(request: Request[Any, Any, Any], data: JSONBody[ResponsesRequest]) -> Response[ResponseObject]:
    return await create_response(_ctx(request), _store(request), data, request,  # type: ignore[return-value]
                                 _record(request))


@get("/v1/responses/{response_id:str}", summary="Retrieve a stored response")
async def retrieve_response(request: Request[Any, Any, Any], response_id: FromPath[str]) -> ResponseObject:
    entry = _store(request).get(_record(request).key_id, response_id)
    if entry is None:
        raise not_found(response_id)
    return entry.response


@delete("/v1/responses/{response_id:str}", status_code=200, summary="Delete a stored response")
async def delete_response(request: Request[Any, Any, Any], response_id: FromPath[str]) -> DeletedResponse:
    if not _store(request).delete(_record(request).key_id, response_id):
        raise not_found(response_id)
    return DeletedResponse(id=response_id)


# Anthropic's routes answer every error, the guard's 401 and 429 included, in Anthropic's error shape.
@post("/v1/messages", status_code=200, summary="Create a message (Anthropic Messages API)",
      exception_handlers=ANTHROPIC_HANDLERS)
async def messages(request: Request[Any, Any, Any], data: JSONBody[MessagesRequest]) -> Response[MessageObject]:
    return await create_message(_ctx(request), data, request, _record(request))  # type: ignore[return-value]


@post("/v1/messages/count_tokens", status_code=200, summary="Count a message request's input tokens",
      exception_handlers=ANTHROPIC_HANDLERS)
async def messages_count_tokens(request: Request[Any, Any, Any], data: JSONBody[CountTokensRequest]) -> TokenCount:
    return await count_tokens(_ctx(request), data, _record(request).body_bytes)


@post("/v1/embeddings", status_code=200, summary="Create embeddings")
async def embeddings(request: Request[Any, Any, Any], data: JSONBody[EmbeddingRequest]) -> EmbeddingResponse:
    return await create_embeddings(_ctx(request), data, request, _record(request))


@post("/v1/rerank", status_code=200, summary="Rerank documents by relevance to a query (Cohere / Jina format)")
async def rerank(request: Request[Any, Any, Any], data: JSONBody[RerankRequest]) -> RerankResponse:
    return await create_rerank(_ctx(request), data, request, _record(request))


@post("/v1/score", status_code=200, summary="Score text pairs")
async def score(request: Request[Any, Any, Any], data: JSONBody[ScoreRequest]) -> ScoreResponse:
    return await create_score(_ctx(request), data, request, _record(request))


def _card(ctx: ServerContext, name: str) -> ModelCard:
    return ModelCard(id=name, created=ctx.created, root=ctx.config.model_root, max_model_len=ctx.engine.max_model_len,
                     task=ctx.task)


@get("/v1/models", summary="List models")
async def list_models(request: Request[Any, Any, Any]) -> ModelList:
    ctx = _ctx(request)
    return ModelList(data=[_card(c, name) for c in ctx.models for name in c.config.served_model_names])


@get("/v1/models/{model_id:path}", summary="Retrieve a model")
async def retrieve_model(request: Request[Any, Any, Any], model_id: FromPath[str]) -> ModelCard:
    ctx = _ctx(request)
    model_id = model_id.lstrip("/")
    ctx.check_model(model_id)
    return _card(ctx.by_name[model_id], model_id)


@post("/tokenize", status_code=200, summary="Tokenize a prompt or chat messages")
async def tokenize(request: Request[Any, Any, Any], data: JSONBody[TokenizeRequest]) -> TokenizeResponse:
    ctx = _ctx(request)
    ctx = ctx.route(data.model, "/tokenize", TASKS) if data.model is not None else ctx
    if (data.prompt is None) == (data.messages is None):
        raise bad_request("give exactly one of `prompt` or `messages`", param="prompt")
    if data.messages is not None:
        if data.add_special_tokens is not None:
            raise bad_request("add_special_tokens applies to `prompt` only; the chat template writes the "
                              "special tokens of `messages`", param="add_special_tokens")
        gen = True if data.add_generation_prompt is None else data.add_generation_prompt
        ids = await ctx.prep.run(_record(request).body_bytes, chat_prompt_ids, ctx, data.messages, None, gen, None)
    else:
        if data.add_generation_prompt is not None:
            raise bad_request("add_generation_prompt applies to `messages` only", param="add_generation_prompt")
        special = True if data.add_special_tokens is None else data.add_special_tokens
        prompt = data.prompt or ""
        ctx.check_prompt_chars(prompt, "prompt")
        ids = await ctx.prep.run(_record(request).body_bytes, ctx.engine.tokenizer.encode, prompt, special)
    return TokenizeResponse(count=len(ids), max_model_len=ctx.engine.max_model_len, tokens=ids)


@post("/detokenize", status_code=200, summary="Turn token ids back into text")
async def detokenize(request: Request[Any, Any, Any], data: JSONBody[DetokenizeRequest]) -> DetokenizeResponse:
    ctx = _ctx(request)
    ctx = ctx.route(data.model, "/detokenize", TASKS) if data.model is not None else ctx
    vocab = getattr(ctx.engine.tokenizer, "vocab_size", None)
    bad = [t for t in data.tokens if t < 0 or (isinstance(vocab, int) and t >= vocab)]
    if bad:
        raise bad_request(f"token id {bad[0]} is out of range", param="tokens")
    return DetokenizeResponse(prompt=ctx.engine.tokenizer.decode(data.tokens, skip_special_tokens=False))


@get("/health", summary="200 while the engine is serving, 503 otherwise")
async def health(request: Request[Any, Any, Any]) -> Response[HealthResponse]:
    ctx = _ctx(request)
    if ctx.healthy():
        return Response(HealthResponse(status="ok"))
    return Response(HealthResponse(status="unhealthy"), status_code=503,
                    headers={"Retry-After": str(ctx.config.retry_after_s)})


@get("/metrics", summary="Prometheus metrics", include_in_schema=True, guards=[metrics_guard])
async def metrics_endpoint(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(_ctx(request).metrics.render(), media_type=CONTENT_TYPE)


@get("/v1/engine/stats", summary="Engine gauges, counters and recent latency percentiles (JSON)",
     guards=[metrics_guard])
async def engine_stats_endpoint(request: Request[Any, Any, Any]) -> EngineStatsResponse:
    return engine_stats(_ctx(request))


@get("/version", summary="Server version")
async def version() -> VersionResponse:
    return VersionResponse(version=__version__)


@get("/openapi.json", include_in_schema=False)
async def openapi_json(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return request.app.openapi_schema.to_schema()


# The OpenAI routes also answer without `/v1`, as llama-server's do and many clients expect: the same
# handlers (and so the same guard and body limit), kept out of the OpenAPI schema so it lists each once.
UNPREFIXED = {"/chat/completions": chat_completions, "/completions": completions, "/models": list_models,
              "/models/{model_id:path}": retrieve_model, "/responses": responses,
              "/responses/{response_id:str}": retrieve_response, "/messages": messages,
              "/messages/count_tokens": messages_count_tokens, "/embeddings": embeddings, "/rerank": rerank,
              "/v2/rerank": rerank, "/score": score}
UNPREFIXED_DELETE = {"/responses/{response_id:str}": delete_response}


def _unprefixed_aliases() -> list[BaseRouteHandler]:
    aliases: list[BaseRouteHandler] = []
    for table, method in ((UNPREFIXED, None), (UNPREFIXED_DELETE, delete)):
        for path, handler in table.items():
            decorator = method or (post if "POST" in handler.http_methods else get)
            kwargs: dict[str, Any] = {"status_code": 200} if decorator is not get else {}
            aliases.append(decorator(path, include_in_schema=False, summary=handler.summary,
                                     exception_handlers=handler.exception_handlers, **kwargs)(handler.fn))
    return aliases


def _disconnected(_: Request[Any, Any, Any], __: ClientDisconnected) -> Response[Any]:
    return error_response(client_closed())


def create_app(
    engine: EngineClient,
    config: ServerConfig | None = None,
    *,
    metrics: ServerMetrics | None = None,
    tracer_provider: TracerProvider | None = None,
    extra_models: Sequence[tuple[EngineClient, ServerConfig]] = (),
) -> Litestar:
    """The OpenAI-compatible app around `engine`. Tracing is on when a tracer provider is given.
    `extra_models`: more models served beside it, each (its engine, a config naming it in
    `served_model_names`; the other fields are `config`'s); requests go to a model by their `model` field."""
    config = config or ServerConfig()
    config.validate()
    metrics = metrics or ServerMetrics()
    tracer = RequestTracer(tracer_provider) if tracer_provider is not None else None
    ctx = ServerContext(engine, config, metrics, tracer)
    for extra_engine, extra_config in extra_models:
        extra_config.validate()
        ctx.add_model(extra_engine, extra_config)
    # /metrics shows the first model's engine gauges; health is every model's.
    metrics.attach_engine(engine.stats, engine.is_healthy if not extra_models else ctx.healthy)
    api = Router(path="/", guards=[access_guard],
                 route_handlers=[chat_completions, completions, embeddings, rerank, score, list_models,
                                 retrieve_model, tokenize, detokenize, responses, retrieve_response, delete_response,
                                 messages, messages_count_tokens, *_unprefixed_aliases()])
    handlers = {cls: by_path(handler) for cls, handler in EXCEPTION_HANDLERS.items()}
    handlers[ClientDisconnected] = _disconnected
    cors = None
    if config.cors_origins:
        cors = CORSConfig(allow_origins=list(config.cors_origins), allow_methods=["*"], allow_headers=["*"],
                          expose_headers=["Retry-After"])
    routes: list[Any] = [api, health, metrics_endpoint, engine_stats_endpoint, version, openapi_json]
    if config.ui:
        from wllm.entrypoints.ui import ui_route_handlers

        routes.extend(ui_route_handlers())
    app = Litestar(
        route_handlers=routes,
        exception_handlers=handlers,
        middleware=[DefineMiddleware(ObservabilityMiddleware, ctx=ctx)],
        cors_config=cors,
        request_max_body_size=config.max_body_bytes,
        request_class=StrictRequest,  # bounded nesting, strict types, no unknown fields (decoding.py)
        openapi_config=OpenAPIConfig(title="wLLM", version=__version__, path="/docs",
                                     description="OpenAI-compatible LLM inference server"),
        state=State({"server": ctx, "responses": ResponseStore()}),
        on_shutdown=[ctx.prep.shutdown],
        logging_config=None,
        debug=False,
    )
    if cors is not None:  # Litestar wraps its whole ASGI handler in its CORS middleware; swap in ours
        handler = app.asgi_handler
        assert isinstance(handler, CORSMiddleware), type(handler)
        app.asgi_handler = JSONErrorCORSMiddleware(app=handler.app, config=cors)
    return app
