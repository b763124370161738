"""POST /v1/chat/completions: chat template -> engine -> one JSON response or an SSE stream."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from wllm.entrypoints.openai.chat_tools import (
    ChatPlan,
    ReplyParser,
    assemble,
    delta_messages,
    plan_tools,
    template_text,
    token_ref_for,
)
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
                item[field] = msgspec.to_builtins(value) if field == "tool_calls" else value
        out.append(item)
    return out


def chat_prompt_ids(ctx: ServerContext, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
                    add_generation_prompt: bool, template_kwargs: dict[str, Any] | None) -> list[int]:
    """Render the chat template and tokenize; template errors are the client's (400), with their text."""
    return render_chat(ctx, template_messages(messages), tools, add_generation_prompt, template_kwargs)[0]


def render_chat(ctx: ServerContext, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool, template_kwargs: dict[str, Any] | None) -> tuple[list[int], str | None]:
    """The prompt's token ids and its text (None when the template gave token ids).

    A prompt over --max-prompt-chars is refused between rendering and tokenizing. Blocking: for a large
    request body, call it through `ctx.prep.run` (off the event loop), as `prepare_chat` does."""
    tok = ctx.engine.tokenizer
    try:
        kwargs = dict(template_kwargs or {})
        if ctx.config.chat_template is not None:
            kwargs["chat_template"] = ctx.config.chat_template
        rendered = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                           **kwargs)
    except APIError:
        raise
    except Exception as exc:  # jinja2 raises TemplateError, templates raise their own messages
        raise bad_request(f"The chat template could not render these messages: {exc}", param="messages") from None
    if isinstance(rendered, str):
        ctx.check_prompt_chars(rendered, "messages")
        # The template already wrote BOS and other special tokens as text.
        return tok.encode(rendered, add_special_tokens=False), rendered
    return list(rendered), None


# A tool grammar that takes longer than this to check is refused (a hostile schema must not hold a worker).
GRAMMAR_CHECK_TIMEOUT_S = 10.0
# Agents send the same tools every turn: the verdict on each grammar is kept (least recently used out).
_checked_grammars: OrderedDict[str, str] = OrderedDict()
_CHECKED_MAX = 256


async def check_grammar(grammar: str) -> None:
    """400 with llguidance's reason when a tool grammar (really: a tool's parameter schema) does not compile."""
    from llguidance import LLMatcher

    error = _checked_grammars.get(grammar)
    if error is None:
        try:
            error = await asyncio.wait_for(asyncio.to_thread(LLMatcher.validate_grammar, grammar),
                                           GRAMMAR_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:  # not the builtin TimeoutError on Python 3.10
            raise bad_request("The tools' parameter schemas took too long to compile; simplify them",
                              param="tools") from None
        _checked_grammars[grammar] = error
        if len(_checked_grammars) > _CHECKED_MAX:
            _checked_grammars.popitem(last=False)
    else:
        _checked_grammars.move_to_end(grammar)
    if error:
        raise bad_request(f"The tools' parameter schemas cannot be enforced: {error}", param="tools")


async def prepare_chat(ctx: ServerContext, req: ChatCompletionRequest, body_bytes: int = 0
                       ) -> tuple[list[int], ChatPlan]:
    """Tools, tool history and reasoning checked and planned; the prompt rendered and tokenized (off the
    event loop for a request body of `body_bytes` >= offload.OFFLOAD_BODY_BYTES)."""
    prompt_ids, plan = await ctx.prep.run(body_bytes, _plan_and_render, ctx, req)
    if plan.grammar is not None:
        # Checked without a tokenizer here (any engine's); the engine compiles it for its own vocabulary.
        await check_grammar(plan.grammar)
    return prompt_ids, plan


def _plan_and_render(ctx: ServerContext, req: ChatCompletionRequest) -> tuple[list[int], ChatPlan]:
    tok = ctx.engine.tokenizer
    cfg = ctx.config
    template = template_text(tok, cfg.chat_template, bool(req.tools))
    plan = plan_tools(req, template, cfg.tool_call_parser, cfg.reasoning_parser)
    messages = plan.template_messages(template_messages(req.messages))
    prompt_ids, rendered = render_chat(ctx, messages, plan.template_tools, req.add_generation_prompt,
                                       req.chat_template_kwargs)
    if rendered is None and plan.parses_output:
        rendered = tok.decode(prompt_ids, skip_special_tokens=False)
    plan.finish_prompt(rendered or "", token_ref_for(tok))
    return prompt_ids, plan


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
    parsing, metrics, logs and cancellation are the same for all of them. Made by `await ChatStart.begin(...)`
    (checking a tool grammar runs in a worker thread).
    """

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, request: Request[Any, Any, Any],
                 record: RequestRecord, prompt_ids: list[int], plan: ChatPlan, request_id: str | None) -> None:
        self.ctx, self.req, self.request, self.record = ctx, req, request, record
        self.plan = plan
        self.top_n = req.top_logprobs or 0
        self.prompt_ids = prompt_ids
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = resolve_max_tokens(len(prompt_ids), requested, ctx.engine.max_model_len, "messages")
        self.params = build_sampling_params(ctx, req, max_tokens=max_tokens,
                                            logprobs=self.top_n if req.logprobs else None, grammar=plan.grammar)
        if plan.special_markers:
            self.params.skip_special_tokens = False  # the markers the reply is split at are special tokens
        self.request_id = request_id or new_id("chatcmpl")
        record.request_id = self.request_id
        self.run = EngineRun(ctx, record, prompt_ids, self.params, self.request_id, priority=req.priority,
                             cache_salt=req.cache_salt)
        self.model, self.created = ctx.model_name, int(time.time())

    @classmethod
    async def begin(cls, ctx: ServerContext, req: ChatCompletionRequest, request: Request[Any, Any, Any],
                    record: RequestRecord, request_id: str | None = None,
                    endpoint: str = "/v1/chat/completions") -> ChatStart:
        ctx = ctx.route(req.model, endpoint, ("generate",))
        ctx.check_healthy()
        reject_unsupported(req)
        if req.functions is not None or req.function_call is not None:
            field = "functions" if req.functions is not None else "function_call"
            raise bad_request(f"{field} (the deprecated functions API) is not supported; send tools", param=field)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        prompt_ids, plan = await prepare_chat(ctx, req, record.body_bytes)
        grammar = await request_grammar(ctx, req)
        if grammar is not None and plan.grammar is not None:
            if req.tool_choice != "none":
                raise bad_request("a structured-output constraint (response_format or guided_*) cannot be combined "
                                  "with tools the model may call; send tool_choice 'none' or drop one",
                                  param="response_format", code="invalid_grammar")
            plan.grammar = None  # tool_choice none: the output grammar alone (it cannot start a tool call)
        if grammar is not None:
            plan.grammar = grammar
        return cls(ctx, req, request, record, prompt_ids, plan, request_id)

    def _parsed(self, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        message = ChatResponseMessage(role="assistant", content=text)
        if self.plan.parses_output:
            parser = self.plan.reply_parser()
            reply = assemble(parser.feed(text) + parser.finish())
            message.content = reply.content
            if reply.reasoning_content is not None:
                message.reasoning_content = reply.reasoning_content
            if reply.tool_calls:
                message.tool_calls = reply.tool_calls
            finish_reason = parser.finish_reason(finish_reason)
        return message, finish_reason

    async def response(self) -> ChatCompletionResponse:
        """Run to the end (cancelled if the client disconnects first); the whole chat completion."""
        ctx, req = self.ctx, self.req
        out = await unless_disconnected(self.run.final(), self.request.receive)
        choices = []
        for c in out.outputs:
            message, finish_reason = self._parsed(c.text, c.finish_reason)
            choices.append(ChatCompletionChoice(
                index=c.index, message=message,
                logprobs=chat_logprobs(ctx, c.logprobs or [], self.top_n) if req.logprobs else None,
                finish_reason=finish_reason, stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=usage_from([out]), system_fingerprint=SYSTEM_FINGERPRINT)

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        """The stream's chunks. Awaits the first engine output before returning, so that a full queue or a
        dead engine is still a plain 503; after that an APIError comes out of the iterator (the caller
        renders it in its API's error event)."""
        ctx, req, params, plan = self.ctx, self.req, self.params, self.plan
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        outputs = self.run.outputs()
        first = await unless_disconnected(outputs.__anext__(), self.request.receive)

        def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
            c = ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                    system_fingerprint=SYSTEM_FINGERPRINT, choices=choices)
            if include_usage:
                c.usage = None
            return c

        parsers: list[ReplyParser] | None = [plan.reply_parser() for _ in range(params.n)] \
            if plan.parses_output else None

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
                lps = chat_logprobs(ctx, steps, self.top_n) if req.logprobs and steps else None
                finish_reason = c.finish_reason
                if parsers is not None:
                    # Parsed replies: reasoning, content and tool-call deltas; text that may still be a marker
                    # waits, and logprobs go with the first frame of the step (an empty delta if need be).
                    parser = parsers[i]
                    events = parser.feed(text) if text else []
                    if c.finish_reason is not None:
                        events += parser.finish()
                        finish_reason = parser.finish_reason(c.finish_reason)
                    messages = delta_messages(events)
                    if lps is not None and not messages:
                        messages = [DeltaMessage()]
                    for k, delta in enumerate(messages):
                        frames.append(chunk([ChatChunkChoice(index=i, delta=delta, logprobs=lps if k == 0 else None)]))
                elif text or steps:
                    frames.append(chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=text), logprobs=lps)]))
                if c.finish_reason is not None:
                    # As OpenAI does: the choice ends with its own chunk, an empty delta and the reason.
                    frames.append(chunk([ChatChunkChoice(index=i, delta=DeltaMessage(),
                                                         finish_reason=finish_reason, stop_reason=c.stop_reason)]))
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
    start = await ChatStart.begin(ctx, req, request, record)
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
