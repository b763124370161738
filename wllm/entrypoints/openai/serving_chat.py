"""POST /v1/chat/completions: chat template -> engine -> one JSON response or an SSE stream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from wllm.entrypoints.openai.errors import APIError, bad_request
from wllm.entrypoints.openai.protocol import (
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    TopLogprob,
)
from wllm.entrypoints.openai.serving_common import (
    SYSTEM_FINGERPRINT,
    EngineRun,
    RequestRecord,
    ServerContext,
    build_sampling_params,
    clean_logprob,
    new_id,
    reject_unsupported,
    resolve_max_tokens,
    unless_disconnected,
    usage_from,
    usage_of,
)
from wllm.entrypoints.openai.sse import DONE, SSE_HEADERS, sse_event
from wllm.outputs import RequestDelta, StepLogprobs


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the plain dicts chat templates expect; multi-part text is joined with newlines."""
    if not messages:
        raise bad_request("messages must contain at least one message", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        for field in ("refusal", "function_call"):
            if getattr(msg, field) is not None:
                hint = "; send tool_calls instead" if field == "function_call" else ""
                raise bad_request(f"messages[{i}].{field} is not supported by this server{hint}",
                                  param=f"messages[{i}].{field}")
        content: str | None
        if isinstance(msg.content, list):
            texts = []
            for part in msg.content:
                extra = next((f for f in ("image_url", "input_audio", "file") if getattr(part, f) is not None), None)
                if part.type == "text" and part.text is None and extra is None:
                    raise bad_request(f"messages[{i}]: a text content part needs `text`",
                                      param=f"messages[{i}].content")
                if part.type != "text" or extra is not None:
                    kind = part.type if part.type != "text" or extra is None else extra
                    raise bad_request(f"messages[{i}]: content parts of type {kind!r} are not supported; "
                                      "this server accepts text parts only", param=f"messages[{i}].content")
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = msg.content
        # content null (an assistant turn that only calls tools) renders as "" (see chat_template).
        item: dict[str, Any] = {"role": msg.role, "content": content}
        for field in ("name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning"):
            value = getattr(msg, field)
            if value is not None:
                item[field] = value
        out.append(item)
    return out


def chat_prompt_ids(ctx: ServerContext, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
                    add_generation_prompt: bool, template_kwargs: dict[str, Any] | None) -> list[int]:
    """Render the chat template and tokenize; template errors are the client's (400), with their text."""
    tok = ctx.engine.tokenizer
    try:
        kwargs = dict(template_kwargs or {})
        if ctx.config.chat_template is not None:
            kwargs["chat_template"] = ctx.config.chat_template
        rendered = tok.apply_chat_template(template_messages(messages), tools=tools,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
    except APIError:
        raise
    except Exception as exc:  # jinja2 raises TemplateError, templates raise their own messages
        raise bad_request(f"The chat template could not render these messages: {exc}", param="messages") from None
    if isinstance(rendered, str):
        # The template already wrote BOS and other special tokens as text.
        return tok.encode(rendered, add_special_tokens=False)
    return list(rendered)


def chat_logprobs(ctx: ServerContext, steps: list[StepLogprobs], top_n: int) -> ChatLogprobs:
    content = []
    for step in steps:
        text = ctx.token_text(step.token_id)
        top = [TopLogprob(ctx.token_text(t.token_id), clean_logprob(t.logprob), ctx.token_bytes(t.token_id))
               for t in step.top[:top_n]]
        content.append(ChatLogprobToken(text, clean_logprob(step.logprob), ctx.token_bytes(step.token_id), top))
    return ChatLogprobs(content=content)


class ChatStart:
    """A chat request checked, templated and handed to an `EngineRun`: the one generation path.

    /v1/chat/completions encodes what it produces as OpenAI chunks; the Responses and Messages APIs
    (serving_responses.py, serving_messages.py) translate their requests into a `ChatCompletionRequest`,
    start it here and translate the chat response or chunks back, so templates, sampling, stops, tool
    parsing, metrics, logs and cancellation are the same for all of them.
    """

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, request: Request[Any, Any, Any],
                 record: RequestRecord, request_id: str | None = None) -> None:
        ctx.check_model(req.model)
        ctx.check_healthy()
        reject_unsupported(req)
        if req.functions is not None or req.function_call is not None:
            field = "functions" if req.functions is not None else "function_call"
            raise bad_request(f"{field} (the deprecated functions API) is not supported; send tools", param=field)
        if req.tool_choice == "required" or isinstance(req.tool_choice, dict):
            what = "'required'" if req.tool_choice == "required" else "a named tool"
            raise bad_request(f"tool_choice {what} is not supported yet: this server does not parse tool calls "
                              "out of the reply (tool_choice 'auto' and 'none' are)", param="tool_choice")
        if req.response_format is not None and req.response_format.get("type", "text") != "text":
            raise bad_request(f"response_format type {req.response_format.get('type')!r} is not supported by this "
                              "server; only 'text' is", param="response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        self.ctx, self.req, self.request = ctx, req, request
        self.top_n = req.top_logprobs or 0
        self.prompt_ids = chat_prompt_ids(ctx, req.messages, req.tools, req.add_generation_prompt,
                                          req.chat_template_kwargs)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = resolve_max_tokens(len(self.prompt_ids), requested, ctx.engine.max_model_len, "messages")
        self.params = build_sampling_params(ctx, req, max_tokens=max_tokens,
                                            logprobs=self.top_n if req.logprobs else None)
        self.request_id = request_id or new_id("chatcmpl")
        record.request_id = self.request_id
        self.run = EngineRun(ctx, record, self.prompt_ids, self.params, self.request_id, priority=req.priority,
                             cache_salt=req.cache_salt)
        self.record = record
        self.model, self.created = ctx.model_name, int(time.time())

    async def response(self) -> ChatCompletionResponse:
        """Run to the end (cancelled if the client disconnects first); the whole chat completion."""
        ctx, req = self.ctx, self.req
        out = await unless_disconnected(self.run.final(), self.request.receive)
        choices = [
            ChatCompletionChoice(
                index=c.index,
                message=ChatResponseMessage(role="assistant", content=c.text),
                logprobs=chat_logprobs(ctx, c.logprobs or [], self.top_n) if req.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in out.outputs
        ]
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=usage_from([out]), system_fingerprint=SYSTEM_FINGERPRINT)

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        """The stream's chunks. Awaits the first engine output before returning, so that a full queue or a
        dead engine is still a plain 503; after that an APIError comes out of the iterator (the caller
        renders it in its API's error event)."""
        ctx, req, params = self.ctx, self.req, self.params
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        outputs = self.run.outputs()
        first = await unless_disconnected(outputs.__anext__(), self.request.receive)

        def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
            c = ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                    system_fingerprint=SYSTEM_FINGERPRINT, choices=choices)
            if include_usage:
                c.usage = None
            return c

        def deltas(out: RequestDelta, done: list[bool]) -> list[ChatCompletionChunk]:
            frames = []
            for c in out.outputs:
                i = c.index
                if done[i]:
                    continue
                text = c.text
                steps = (c.logprobs or []) if req.logprobs else []
                if not text and not steps and c.finish_reason is None:
                    continue
                if text or steps:
                    lps = chat_logprobs(ctx, steps, self.top_n) if req.logprobs and steps else None
                    frames.append(chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=text), logprobs=lps)]))
                if c.finish_reason is not None:
                    # As OpenAI does: the choice ends with its own chunk, an empty delta and the reason.
                    frames.append(chunk([ChatChunkChoice(index=i, delta=DeltaMessage(),
                                                         finish_reason=c.finish_reason, stop_reason=c.stop_reason)]))
                    done[i] = True
            return frames

        async def gen() -> AsyncIterator[ChatCompletionChunk]:
            done = [False] * params.n
            try:
                for i in range(params.n):
                    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for c in deltas(first, done):
                    yield c
                async for out in outputs:
                    for c in deltas(out, done):
                        yield c
                if include_usage:
                    yield ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                              system_fingerprint=SYSTEM_FINGERPRINT, choices=[],
                                              usage=usage_of([self.run]))
            finally:
                await outputs.aclose()

        return gen()

    async def cleanup(self) -> None:
        """A stream's background task: abort the engine request if the client went away mid-stream."""
        if not self.run.finished:
            await self.run.abort()
            self.record.error = self.record.error or "client disconnected"


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, request: Request[Any, Any, Any],
                                 record: RequestRecord) -> Response[Any] | Stream:
    start = ChatStart(ctx, req, request, record)
    if not req.stream:
        return Response(await start.response())
    chunks = await start.chunks()

    async def events() -> AsyncIterator[bytes]:
        try:
            async for c in chunks:
                yield sse_event(c)
        except APIError as exc:
            # Headers are gone already; OpenAI clients surface an `error` event as an APIError.
            yield sse_event(exc.body())
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        yield DONE

    return Stream(events(), media_type="text/event-stream", headers=SSE_HEADERS,
                  background=BackgroundTask(start.cleanup))
