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
    request_grammar,
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


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, request: Request[Any, Any, Any],
                                 record: RequestRecord) -> Response[Any] | Stream:
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
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    top_n = req.top_logprobs or 0
    prompt_ids = chat_prompt_ids(ctx, req.messages, req.tools, req.add_generation_prompt, req.chat_template_kwargs)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(len(prompt_ids), requested, ctx.engine.max_model_len, "messages")
    grammar = await request_grammar(ctx, req)
    params = build_sampling_params(ctx, req, max_tokens=max_tokens, logprobs=top_n if req.logprobs else None,
                                   grammar=grammar)
    request_id = new_id("chatcmpl")
    record.request_id = request_id
    run = EngineRun(ctx, record, prompt_ids, params, request_id, priority=req.priority, cache_salt=req.cache_salt)
    model, created = ctx.model_name, int(time.time())

    if not req.stream:
        out = await unless_disconnected(run.final(), request.receive)
        choices = [
            ChatCompletionChoice(
                index=c.index,
                message=ChatResponseMessage(role="assistant", content=c.text),
                logprobs=chat_logprobs(ctx, c.logprobs or [], top_n) if req.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in out.outputs
        ]
        body = ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                      usage=usage_from([out]), system_fingerprint=SYSTEM_FINGERPRINT)
        return Response(body)

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    outputs = run.outputs()
    # Wait for the first output before sending headers so a full queue or a dead engine is a real 503.
    first = await unless_disconnected(outputs.__anext__(), request.receive)

    def chunk(choices: list[ChatChunkChoice]) -> bytes:
        c = ChatCompletionChunk(id=request_id, created=created, model=model, system_fingerprint=SYSTEM_FINGERPRINT,
                                choices=choices)
        if include_usage:
            c.usage = None
        return sse_event(c)

    async def events() -> AsyncIterator[bytes]:
        done = [False] * params.n
        for i in range(params.n):
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])

        def deltas(out: RequestDelta) -> list[bytes]:
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
                    lps = chat_logprobs(ctx, steps, top_n) if req.logprobs and steps else None
                    frames.append(chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=text), logprobs=lps)]))
                if c.finish_reason is not None:
                    # As OpenAI does: the choice ends with its own chunk, an empty delta and the reason.
                    frames.append(chunk([ChatChunkChoice(index=i, delta=DeltaMessage(),
                                                         finish_reason=c.finish_reason, stop_reason=c.stop_reason)]))
                    done[i] = True
            return frames

        try:
            for frame in deltas(first):
                yield frame
            async for out in outputs:
                for frame in deltas(out):
                    yield frame
            if include_usage:
                yield sse_event(ChatCompletionChunk(id=request_id, created=created, model=model,
                                                    system_fingerprint=SYSTEM_FINGERPRINT, choices=[],
                                                    usage=usage_of([run])))
        except APIError as exc:
            # Headers are gone already; OpenAI clients surface an `error` event as an APIError.
            yield sse_event(exc.body())
        finally:
            await outputs.aclose()
        yield DONE

    async def cleanup() -> None:
        if not run.finished:  # the client went away mid-stream
            await run.abort()
            record.error = record.error or "client disconnected"

    return Stream(events(), media_type="text/event-stream", headers=SSE_HEADERS, background=BackgroundTask(cleanup))
