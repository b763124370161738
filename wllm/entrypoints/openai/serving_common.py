"""Pieces shared by the chat and text completion handlers.

`ServerContext` bundles the engine and the server-wide services. `EngineRun` drives one engine
request: it hands on the engine's deltas, maps engine errors to HTTP errors, feeds metrics, the request
log and the trace (from counters it keeps, not from cumulative outputs), and aborts the engine request
whenever its consumer stops early (client disconnect, error).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry.trace import Span

from wllm.entrypoints.openai.auth import APIKeyChecker
from wllm.entrypoints.openai.config import ServerConfig
from wllm.entrypoints.openai.engine_client import EngineClient, EngineDeadError, QueueFullError
from wllm.entrypoints.openai.errors import APIError, bad_request, model_not_found, service_unavailable
from wllm.entrypoints.openai.offload import DEFAULT_CHARS_PER_TOKEN, PrepPool
from wllm.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from wllm.entrypoints.openai.rate_limit import RateLimiter
from wllm.model.pooling import task_of
from wllm.observability.metrics import ServerMetrics
from wllm.observability.tracing import RequestTracer
from wllm.outputs import OutputAccumulator, RequestDelta, RequestOutput, StepLogprobs
from wllm.sampling_params import SamplingParams
from wllm.version import __version__

if TYPE_CHECKING:
    from wllm.structured.compiler import GrammarCompiler

T = TypeVar("T")

SYSTEM_FINGERPRINT = f"wllm-{__version__}"
STATE_KEY = "wllm_record"
# Set in a request's scope["state"] (to --timeout-body's seconds) by the connection watchdog when its body
# upload timed out: the app then ends the request as a 408, not as a client disconnect.
UPLOAD_TIMEOUT_KEY = "wllm_upload_timeout"
# JSON has no -inf; a masked-out token's logprob is reported as this (what vLLM does too).
MIN_LOGPROB = -9999.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class RequestRecord:
    """What one HTTP request did, filled in by handlers and read by the access log and limiter."""

    def __init__(self) -> None:
        self.request_id: str | None = None
        self.key_id: str | None = None
        self.client: str | None = None
        self.body_bytes = 0  # size of the request body (decides where its preparation runs; see offload.py)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.arrival: float | None = None  # time.monotonic() when the request reached the server
        self.queue_time: float | None = None
        self.ttft: float | None = None
        self.error: str | None = None
        self.span: Span | None = None

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.request_id:
            out["request_id"] = self.request_id
        if self.key_id:
            out["key_id"] = self.key_id
        if self.request_id:
            out.update(prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                       completion_tokens=self.completion_tokens)
            out["queue_time_s"] = None if self.queue_time is None else round(self.queue_time, 6)
            out["ttft_s"] = None if self.ttft is None else round(self.ttft, 6)
        if self.error:
            out["error"] = self.error
        return out


class ServerContext:
    """One served model's engine plus the server-wide services every handler uses.

    A server of several models (`wllm serve A B`) has one context per model: the first is the app's, the
    others come from `add_model` and share its services (keys, limits, metrics, the running requests) and
    its routing table; `route` picks a request's context by its `model` field and the endpoint's tasks."""

    def __init__(self, engine: EngineClient, config: ServerConfig, metrics: ServerMetrics,
                 tracer: RequestTracer | None, *, root: ServerContext | None = None) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.tracer = tracer
        self.max_prompt_chars = config.max_prompt_chars or DEFAULT_CHARS_PER_TOKEN * engine.max_model_len
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self.task: str = task_of(getattr(engine, "pooling", None))
        if root is None:
            self.keys = APIKeyChecker(config.api_keys)
            self.limiter = RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm)
            self.running: set[EngineRun] = set()  # engine requests being consumed now (streamed or not)
            self._cut_aborts: set[asyncio.Future[None]] = set()
            self.prep = PrepPool()  # one pool for every model's request preparation
            self.models: list[ServerContext] = []  # every model's context, in the order served
            self.by_name: dict[str, ServerContext] = {}
            self._root = self
            self._cutting = False  # set once shutdown's drain timeout has run out
        else:
            self.keys, self.limiter, self.running, self.prep = root.keys, root.limiter, root.running, root.prep
            self._cut_aborts, self.models, self.by_name, self._root = root._cut_aborts, root.models, root.by_name, root
        self._grammar_compiler: GrammarCompiler | None = None  # per model: its own tokenizer
        self.models.append(self)
        for name in config.served_model_names:
            if name in self.by_name:
                raise ValueError(f"the model name {name!r} is served twice; give each model its own name")
            self.by_name[name] = self

    def add_model(self, engine: EngineClient, config: ServerConfig) -> ServerContext:
        """Serve another model (its own engine; `config.served_model_names` its names) beside this one."""
        return ServerContext(engine, config, self.metrics, self.tracer, root=self._root)

    @property
    def cutting(self) -> bool:
        return self._root._cutting

    @cutting.setter
    def cutting(self, value: bool) -> None:
        self._root._cutting = value

    def route(self, model: str | None, endpoint: str, tasks: tuple[str, ...]) -> ServerContext:
        """The context of the model a request names (404 if none has that name; 400 if its task cannot serve
        `endpoint`). Without a name: the first model whose task can (the first model when none can)."""
        if model is None:
            target = next((c for c in self.models if c.task in tasks), self.models[0])
        else:
            found = self.by_name.get(model)
            if found is None:
                raise model_not_found(model)
            target = found
        if target.task not in tasks:
            name = target.config.served_model_names[0]
            article = "an" if target.task == "embed" else "a"
            raise APIError(400, f"The model `{name}` is {article} {target.task} model; {endpoint} needs "
                           f"{' or '.join(a_task(t) for t in tasks)} model.", param="model",
                           code="model_task_mismatch")
        return target

    def healthy(self) -> bool:
        """Every model's engine is running."""
        return all(c.engine.is_healthy() for c in self.models)

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler requests' grammars are checked with: the engine's own when it runs in this process
        (one cache for both), else one for the server built from the engine's tokenizer."""
        if self._grammar_compiler is None:
            from wllm.structured.compiler import GrammarCompiler

            core = getattr(self.engine, "engine", None)  # AsyncEngine's core: an LLMEngine in this process?
            own = getattr(core, "_grammar_compiler", None)
            if own is not None:
                own.timeout_s = self.config.grammar_timeout_s
            else:
                tok = self.engine.tokenizer
                own = GrammarCompiler(tok, getattr(tok, "vocab_size", None), getattr(tok, "eos_token_ids", ()) or (),
                                      timeout_s=self.config.grammar_timeout_s)
            self._grammar_compiler = own
        return self._grammar_compiler

    def cut_requests(self) -> int:
        """End every running request now, for a shutdown whose drain timeout ran out; how many HTTP
        requests that is (a multi-prompt completion runs several engine requests).

        Each run ends with `server_shutdown_error()`: a stream sends it as an error event and then
        `[DONE]`, a plain request answers it as a 503. The engine is asked to abort each request so its
        output stream wakes at the engine's next step. Call it on the event loop's thread."""
        self.cutting = True
        runs = list(self.running)
        for run in runs:
            run.cut = True
            task = asyncio.ensure_future(run.abort_engine())
            self._cut_aborts.add(task)
            task.add_done_callback(self._cut_aborts.discard)
        return len({id(run.record) for run in runs})

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.by_name:
            raise model_not_found(model)

    def check_prompt_chars(self, text: str, what: str) -> None:
        """400 for a prompt longer than --max-prompt-chars, before any time is spent tokenizing it."""
        if len(text) > self.max_prompt_chars:
            raise bad_request(f"The {what} is {len(text)} characters long; this server takes at most "
                              f"{self.max_prompt_chars} characters in one prompt (--max-prompt-chars).",
                              param=what, code="prompt_too_long")

    def check_healthy(self) -> None:
        if not self.engine.is_healthy():
            raise service_unavailable("The engine is not running; try again later.", self.config.retry_after_s)

    def token_bytes(self, token_id: int) -> list[int]:
        """A token's raw UTF-8 bytes: exact even for tokens that hold part of a character."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return list(text.encode())
        id_to_token = getattr(self.engine.tokenizer, "id_to_token", None)
        piece = id_to_token(token_id) if id_to_token is not None else None
        if piece:
            m = _BYTE_FALLBACK.match(piece)
            if m:  # SentencePiece byte-fallback token
                return [int(m.group(1), 16)]
            if all(c in _BYTE_LEVEL for c in piece):  # byte-level BPE piece
                return [_BYTE_LEVEL[c] for c in piece]
        return list(text.encode())

    def token_text(self, token_id: int) -> str:
        """The text of a single token, as shown in logprobs (cached: the vocabulary is fixed)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 1_000_000:
                self._token_text[token_id] = text
        return text


def a_task(task: str) -> str:
    """"an embed", "a rerank", "a generate"."""
    return f"{'an' if task == 'embed' else 'a'} {task}"


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet: each byte 0-255 is spelled by one printable character.

    Printable Latin-1 bytes spell themselves; the rest (controls, space, 0x7F-0xA0, 0xAD) are
    moved up to code points 256, 257, ... in byte order. Used to recover a token's raw bytes.
    """
    direct = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in direct}
    shifted = 0
    for b in range(256):
        if b not in direct:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def server_shutdown_error() -> APIError:
    return APIError(503, "The server is shutting down and its drain timeout ran out before this request "
                    "finished; it was cancelled. Retry it against a running server.",
                    type="service_unavailable_error", code="server_shutdown")


SHUTDOWN_CUT = "server shutdown: cancelled at the drain timeout"


def clean_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int, what: str) -> int:
    """The completion budget; a prompt that does not fit is a 400, never silently truncated."""
    if prompt_len == 0:
        raise bad_request(f"The {what} is empty after tokenization.", param=what)
    if requested is not None and requested < 1:
        raise bad_request(f"max_tokens must be at least 1, got {requested}", param="max_tokens")
    if requested is None:
        if prompt_len >= max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, your {what} "
                f"resulted in {prompt_len} tokens, leaving no room for a completion. "
                f"Please reduce the length of the {what}.",
                param=what, code="context_length_exceeded")
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} in the completion). "
            f"Please reduce the length of the {what} or completion.",
            param=what, code="context_length_exceeded")
    return requested


def _grammar_sources(req: Any) -> list[tuple[str, Callable[[], str | None]]]:
    """The structured-output fields a request sets, each with the builder of its grammar."""
    from wllm.structured import grammars as g

    found: list[tuple[str, Callable[[], str | None]]] = []
    if req.response_format is not None:
        found.append(("response_format", lambda: g.response_format_grammar(req.response_format)))
    for name, build in (("guided_json", g.json_schema_grammar), ("guided_regex", g.regex_grammar),
                        ("guided_choice", g.choice_grammar), ("guided_grammar", g.gbnf_grammar)):
        value = getattr(req, name)
        if value is not None:
            found.append((name, functools.partial(build, value)))
    so = req.structured_outputs
    if so is not None:
        for name, build in (("json", g.json_schema_grammar), ("regex", g.regex_grammar),
                            ("choice", g.choice_grammar), ("grammar", g.gbnf_grammar)):
            value = getattr(so, name)
            if value is not None:
                found.append((f"structured_outputs.{name}", functools.partial(build, value)))
        if so.json_object:
            found.append(("structured_outputs.json_object", g.json_object_grammar))
    return found


async def request_grammar(ctx: ServerContext, req: Any) -> str | None:
    """The llguidance grammar a request's structured-output fields ask for (None: unconstrained), compiled
    here, off the event loop, before the engine sees it: any problem is a 400 naming the field and the reason."""
    sources = _grammar_sources(req)
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise bad_request(f"set at most one structured-output constraint; this request sets {names}",
                          param=sources[1][0], code="invalid_grammar")
    name, build = sources[0]
    try:
        grammar = build()
        if grammar is not None:
            await ctx.grammar_compiler().compile_async(grammar)
    except (ValueError, TypeError) as exc:  # GrammarError is a ValueError, as llguidance's own reports are
        raise bad_request(f"{name}: {exc}", param=name, code="invalid_grammar") from None
    return grammar


def reject_unsupported(req: Any) -> None:
    """400 for the sampling fields chat and completions declare but do not implement, when set."""
    if req.use_beam_search:
        return  # the beam search's own bounds are checked by build_sampling_params
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is supported with use_beam_search only (as the beam width)",
                          param="best_of")
    for field, default in (("length_penalty", 1.0), ("early_stopping", False)):
        if getattr(req, field) != default:
            raise bad_request(f"{field} applies to beam search only; set use_beam_search", param=field)


def build_sampling_params(ctx: ServerContext, req: Any, *, max_tokens: int, logprobs: int | None,
                          prompt_logprobs: int | None = None, grammar: str | None = None) -> SamplingParams:
    """SamplingParams from the fields chat and completions share, with the server's bounds enforced."""
    cfg = ctx.config
    if not 1 <= req.n <= cfg.max_n:
        raise bad_request(f"n must be between 1 and {cfg.max_n}, got {req.n}", param="n")
    width = 0
    if req.use_beam_search:
        width = req.n if req.best_of is None else req.best_of
        if not req.n <= width <= cfg.max_n:
            raise bad_request(f"best_of (the beam width) must be between n ({req.n}) and {cfg.max_n}, got {width}",
                              param="best_of")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > cfg.max_stop:
        raise bad_request(f"at most {cfg.max_stop} stop sequences are allowed, got {len(stop)}", param="stop")
    if any(len(s) > cfg.max_stop_chars for s in stop):
        raise bad_request(f"stop sequences must be at most {cfg.max_stop_chars} characters", param="stop")
    if logprobs is not None and not 0 <= logprobs <= cfg.max_logprobs:
        raise bad_request(f"logprobs must be between 0 and {cfg.max_logprobs}, got {logprobs}", param="logprobs")
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise bad_request("seed must fit in 64 bits", param="seed")
    vocab = getattr(ctx.engine.tokenizer, "vocab_size", None)
    bias: dict[int, float] | None = None
    if req.logit_bias:
        if len(req.logit_bias) > cfg.max_logit_bias:
            raise bad_request(f"logit_bias may have at most {cfg.max_logit_bias} entries", param="logit_bias")
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
            if token_id < 0 or (isinstance(vocab, int) and token_id >= vocab):
                raise bad_request(f"logit_bias token id {token_id} is out of range", param="logit_bias")
            if not -100.0 <= value <= 100.0:
                raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
            bias[token_id] = float(value)
    for token_id in req.stop_token_ids or []:
        if token_id < 0 or (isinstance(vocab, int) and token_id >= vocab):
            raise bad_request(f"stop_token_ids entry {token_id} is out of range", param="stop_token_ids")
    params = SamplingParams(
        n=req.n,
        # Beam search is deterministic: temperature unset means 0 there (any other value is refused below).
        temperature=(0.0 if width else 1.0) if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None or req.top_k == -1 else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=bias,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        beam_width=width,
        length_penalty=req.length_penalty,
        early_stopping=req.early_stopping,
        grammar=grammar,
    )
    if params.temperature > 2.0 + 1e-9 and req.temperature is not None:
        raise bad_request(f"temperature must be in [0, 2], got {req.temperature}", param="temperature")
    try:
        params.validate()
    except ValueError as exc:
        message = str(exc)
        raise bad_request(message, param=message.split(" ", 1)[0]) from None
    return params


def usage_from(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return _usage(prompt, completion, cached)


def usage_of(runs: list[EngineRun]) -> UsageInfo:
    """`usage_from` for streamed runs, from the counters they kept."""
    prompt = sum(len(r.prompt_ids) for r in runs)
    completion = sum(r.completion_tokens for r in runs)
    cached = sum(r.num_cached_tokens for r in runs)
    return _usage(prompt, completion, cached)


def _usage(prompt: int, completion: int, cached: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class EngineRun:
    """One engine request, observed: metrics, request record, trace phases, abort on early exit."""

    def __init__(self, ctx: ServerContext, record: RequestRecord, prompt_ids: list[int], params: SamplingParams,
                 request_id: str, *, priority: int = 0, cache_salt: str | None = None) -> None:
        self.ctx = ctx
        self.record = record
        self.prompt_ids = prompt_ids
        self.params = params
        self.request_id = request_id
        self.priority = priority
        self.cache_salt = cache_salt
        self.finished = False
        self.cut = False  # shutdown's drain timeout ran out: end with server_shutdown_error()
        self.last: RequestDelta | None = None
        self.completion_tokens = 0  # all choices together
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[StepLogprobs | None] | None = None  # what has come (echo needs them whole)
        self._choice_tokens: dict[int, int] = {}
        self._arrival = time.monotonic()
        self._first_token: float | None = None
        self._last_token_time: float | None = None
        self._tokens_seen = 0  # longest choice so far

    async def outputs(self) -> AsyncIterator[RequestDelta]:
        """The engine's deltas until finished; raises APIError for a full queue or an engine failure."""
        ctx = self.ctx
        ctx.running.add(self)
        try:
            if ctx.cutting:
                self.cut = True
                raise self._cut_error()
            stream = ctx.engine.generate(self.prompt_ids, self.params, self.request_id,
                                         priority=self.priority, cache_salt=self.cache_salt)
            async for out in stream:
                if self.cut:
                    raise self._cut_error()
                self._observe(out)
                if out.error is not None:
                    self.record.error = out.error
                    raise APIError(500, f"The engine failed while generating: {out.error}", type="internal_error")
                if out.finished:
                    self.finished = True
                yield out
                if out.finished:
                    return
            if self.cut:
                raise self._cut_error()
            if not self.finished:
                raise APIError(500, "The engine stopped the request without finishing it", type="internal_error")
        except QueueFullError:
            raise service_unavailable("The server is at capacity (the request queue is full); try again shortly.",
                                      ctx.config.retry_after_s) from None
        except EngineDeadError as exc:
            self.record.error = str(exc)
            raise service_unavailable("The engine is not running; try again later.",
                                      ctx.config.retry_after_s) from None
        except ValueError as exc:  # the engine refused the request itself (e.g. a limit it checks)
            raise bad_request(f"The engine rejected the request: {exc}") from None
        except (asyncio.CancelledError, GeneratorExit):
            # The consumer stopped early: the client went away (or the server is being killed).
            self.record.error = self.record.error or "client disconnected"
            raise
        finally:
            ctx.running.discard(self)
            # Record first: under an anyio cancel scope every later await may be cancelled again.
            self._finish()
            if not self.finished:
                await self.abort()

    def _cut_error(self) -> APIError:
        self.record.error = SHUTDOWN_CUT
        return server_shutdown_error()

    async def abort_engine(self) -> None:
        """Ask the engine to abort this request, leaving `finished` alone (the consumer is still reading)."""
        with contextlib.suppress(Exception):
            await self.ctx.engine.abort(self.request_id)

    async def final(self) -> RequestOutput:
        """Run to the end; the whole output (a non-streamed response)."""
        acc = OutputAccumulator(self.request_id, self.prompt_ids)
        async for delta in self.outputs():
            acc.add(delta)
        return acc.output()

    async def abort(self) -> None:
        self.finished = True
        with contextlib.suppress(Exception):
            await asyncio.shield(self.ctx.engine.abort(self.request_id))

    def _observe(self, out: RequestDelta) -> None:
        self.last = out
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs.extend(out.prompt_logprobs)
        new = 0
        counts = self._choice_tokens
        for c in out.outputs:
            if c.token_ids:
                new += len(c.token_ids)
                counts[c.index] = counts.get(c.index, 0) + len(c.token_ids)
        if not new:
            return
        now = time.monotonic()
        metrics = self.ctx.metrics
        metrics.record_generated(new, now)
        self.completion_tokens += new
        longest = max(counts.values())
        if self._first_token is None:
            self._first_token = now
        elif self._last_token_time is not None:
            # Several tokens may arrive in one output; spread the gap over them.
            metrics.observe_itl((now - self._last_token_time) / max(1, longest - self._tokens_seen))
        self._last_token_time = now
        self._tokens_seen = longest

    def _finish(self) -> None:
        out, rec, metrics = self.last, self.record, self.ctx.metrics
        if out is None:
            return
        m = out.metrics
        arrival = m.arrival_time if m is not None else self._arrival  # the engine's: queue time starts there
        # TTFT and end-to-end latency count from the request's arrival at the server (HTTP parsing,
        # tokenization and the hand-off to the engine thread included): what a client waits for.
        received = min(rec.arrival, arrival) if rec.arrival is not None else arrival
        scheduled = m.first_scheduled_time if m is not None else None
        first = (m.first_token_time if m is not None else None) or self._first_token
        done = (m.finished_time if m is not None else None) or time.monotonic()
        prompt, cached = len(self.prompt_ids), out.num_cached_tokens
        rec.prompt_tokens += prompt
        rec.cached_tokens += cached
        rec.completion_tokens += self.completion_tokens
        metrics.prompt_tokens.inc(prompt)
        metrics.cached_prompt_tokens.inc(cached)
        if scheduled is not None:
            metrics.queue_time.observe(max(0.0, scheduled - arrival))
            rec.queue_time = max(0.0, scheduled - arrival) if rec.queue_time is None else rec.queue_time
        if first is not None:
            metrics.observe_ttft(max(0.0, first - received))
            rec.ttft = max(0.0, first - received) if rec.ttft is None else min(rec.ttft, first - received)
        if out.finished:
            metrics.e2e.observe(max(0.0, done - received))
        if self.ctx.tracer is not None and rec.span is not None:
            self.ctx.tracer.add_phases(rec.span, arrival, scheduled, first, done,
                                       {"wllm.completion_tokens": self.completion_tokens})


async def until_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return once the client has gone away (the ASGI server reports `http.disconnect`)."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


async def unless_disconnected(work: Awaitable[T], receive: Callable[[], Awaitable[dict[str, Any]]]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected()
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await watcher
    return task.result()


class ClientDisconnected(Exception):
    """The client went away before the response was ready; nothing more is sent."""
