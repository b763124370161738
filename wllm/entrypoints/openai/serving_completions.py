"""POST /v1/completions: one or many prompts (text or token ids), `n` choices each, echo, logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from wllm.entrypoints.openai.errors import APIError, bad_request
from wllm.entrypoints.openai.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
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
from wllm.outputs import OutputAccumulator, RequestDelta, RequestOutput, StepLogprobs

MAX_PROMPTS = 64  # prompts per request; each becomes its own engine request


def parse_prompts(prompt: Any, vocab_size: int | None) -> list[str | list[int]]:
    """Tell apart the four OpenAI prompt shapes: str, [str], [int], [[int]]."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        prompts: list[str | list[int]] = list(prompt)
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, list) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids, or a list of "
                          "token-id lists (not a mix)", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    for p in prompts:
        if isinstance(p, list):
            if not p:
                raise bad_request("a token-id prompt must not be empty", param="prompt")
            bad = [t for t in p if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if bad:
                raise bad_request(f"prompt token id {bad[0]} is out of range", param="prompt")
    return prompts


def _prepare_prompts(ctx: ServerContext, prompt: Any, echo: bool) -> tuple[list[list[int]], list[str]]:
    """The prompts, their token ids and (for echo) their texts. Blocking: run it through `ctx.prep`."""
    tok = ctx.engine.tokenizer
    prompts = parse_prompts(prompt, getattr(tok, "vocab_size", None))
    for p in prompts:
        if isinstance(p, str):
            ctx.check_prompt_chars(p, "prompt")
    prompt_ids = [tok.encode(p, add_special_tokens=True) if isinstance(p, str) else p for p in prompts]
    texts = [p if isinstance(p, str) else (tok.decode(p, skip_special_tokens=False) if echo else "") for p in prompts]
    return prompt_ids, texts


class _LogprobWriter:
    """Builds a choice's CompletionLogprobs incrementally (text_offset continues across chunks)."""

    def __init__(self, ctx: ServerContext, top_n: int) -> None:
        self.ctx = ctx
        self.top_n = top_n
        self.offset = 0

    def build(self, steps: list[StepLogprobs | None], token_ids: list[int]) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for token_id, step in zip(token_ids, steps):
            text = self.ctx.token_text(token_id)
            lp.tokens.append(text)
            lp.text_offset.append(self.offset)
            self.offset += len(text)
            if step is None:  # the first prompt token has no logprob
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                continue
            lp.token_logprobs.append(clean_logprob(step.logprob))
            top = {self.ctx.token_text(t.token_id): clean_logprob(t.logprob) for t in step.top[:self.top_n]}
            top.setdefault(text, clean_logprob(step.logprob))
            lp.top_logprobs.append(top)
        return lp


async def _merge(streams: list[AsyncIterator[RequestDelta]]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Interleave several engine streams as their outputs arrive; closing this closes them all."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, RequestDelta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestDelta]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except BaseException as exc:  # forwarded to the consumer, including cancellation
            await queue.put((i, exc))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


async def create_completion(ctx: ServerContext, req: CompletionRequest, request: Request[Any, Any, Any],
                            record: RequestRecord) -> Response[Any] | Stream:
    ctx = ctx.route(req.model, "/v1/completions", ("generate",))
    ctx.check_healthy()
    reject_unsupported(req)
    if req.suffix:
        raise bad_request("suffix is not supported by this server", param="suffix")
    prompt_ids, prompt_texts = await ctx.prep.run(record.body_bytes, _prepare_prompts, ctx, req.prompt, req.echo)
    top_n = req.logprobs
    request_id = new_id("cmpl")
    record.request_id = request_id
    runs: list[EngineRun] = []
    grammar = await request_grammar(ctx, req)
    for i, ids in enumerate(prompt_ids):
        max_tokens = resolve_max_tokens(len(ids), req.max_tokens, ctx.engine.max_model_len, "prompt")
        params = build_sampling_params(ctx, req, max_tokens=max_tokens, logprobs=top_n,
                                       prompt_logprobs=top_n if req.echo and top_n is not None else None,
                                       grammar=grammar)
        runs.append(EngineRun(ctx, record, ids, params, f"{request_id}-{i}", priority=req.priority,
                              cache_salt=req.cache_salt))
    n, model, created = req.n, ctx.model_name, int(time.time())

    def prompt_part(i: int, prompt_logprobs: list[StepLogprobs | None] | None,
                    writer: _LogprobWriter | None) -> tuple[str, CompletionLogprobs | None]:
        """What echo prepends to a choice: the prompt text and (with logprobs) its token logprobs."""
        if not req.echo:
            return "", None
        if writer is None:
            return prompt_texts[i], None
        steps = list(prompt_logprobs or [None] * len(prompt_ids[i]))
        return prompt_texts[i], writer.build(steps, prompt_ids[i])

    if not req.stream:
        async def finals() -> list[RequestOutput]:
            accs = [OutputAccumulator(r.request_id, r.prompt_ids) for r in runs]
            async for i, out in _merge([r.outputs() for r in runs]):
                accs[i].add(out)
            return [acc.output() for acc in accs]

        outs = await unless_disconnected(finals(), request.receive)
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                writer = _LogprobWriter(ctx, top_n) if top_n is not None else None
                text, lps = prompt_part(i, out.prompt_logprobs, writer)
                if writer is not None and lps is not None:
                    gen = writer.build(list(c.logprobs or []), c.token_ids)
                    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        getattr(lps, field).extend(getattr(gen, field))
                elif writer is not None:
                    lps = writer.build(list(c.logprobs or []), c.token_ids)
                choices.append(CompletionChoice(index=i * n + c.index, text=text + c.text, logprobs=lps,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return Response(CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                           usage=usage_from(outs), system_fingerprint=SYSTEM_FINGERPRINT))

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    merged = _merge([r.outputs() for r in runs])
    first = await unless_disconnected(merged.__anext__(), request.receive)

    def chunk(choice: CompletionChoice) -> bytes:
        body = CompletionResponse(id=request_id, created=created, model=model, choices=[choice],
                                  system_fingerprint=SYSTEM_FINGERPRINT)
        if include_usage:
            body.usage = None
        return sse_event(body)

    async def events() -> AsyncIterator[bytes]:
        started: set[int] = set()
        writers: dict[int, _LogprobWriter] = {}
        finished: set[int] = set()
        seen: set[int] = set()

        def deltas(i: int, out: RequestDelta) -> list[bytes]:
            frames = []
            seen.add(i)
            for c in out.outputs:
                idx = i * n + c.index
                if idx in finished:
                    continue
                prefix, lps = "", None
                if idx not in started:  # first event of this choice: echo goes here
                    started.add(idx)
                    if top_n is not None:
                        writers[idx] = _LogprobWriter(ctx, top_n)
                    prefix, lps = prompt_part(i, runs[i].prompt_logprobs, writers.get(idx))
                text = c.text
                new_ids = c.token_ids
                if top_n is not None and new_ids:
                    steps = list(c.logprobs or [])
                    gen = writers[idx].build(steps, new_ids)
                    if lps is None:
                        lps = gen
                    else:
                        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                            getattr(lps, field).extend(getattr(gen, field))
                if prefix or text or lps:
                    frames.append(chunk(CompletionChoice(index=idx, text=prefix + text, logprobs=lps,
                                                         finish_reason=None)))
                if c.finish_reason is not None:
                    # As OpenAI does: the choice ends with its own chunk, empty text and the reason.
                    frames.append(chunk(CompletionChoice(index=idx, text="", logprobs=None,
                                                         finish_reason=c.finish_reason, stop_reason=c.stop_reason)))
                    finished.add(idx)
            return frames

        try:
            for frame in deltas(*first):
                yield frame
            async for i, out in merged:
                for frame in deltas(i, out):
                    yield frame
            if include_usage:
                yield sse_event(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                                   usage=usage_of([runs[i] for i in sorted(seen)]),
                                                   system_fingerprint=SYSTEM_FINGERPRINT))
        except APIError as exc:
            yield sse_event(exc.body())
        finally:
            await merged.aclose()
        yield DONE

    async def cleanup() -> None:
        if not all(r.finished for r in runs):  # the client went away mid-stream
            for r in runs:
                if not r.finished:
                    await r.abort()
            record.error = record.error or "client disconnected"

    return Stream(events(), media_type="text/event-stream", headers=SSE_HEADERS, background=BackgroundTask(cleanup))
