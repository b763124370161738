"""`wllm serve [MODEL]`: load a model, start the engine, serve the OpenAI-compatible API with uvicorn.

MODEL is an HF folder, a GGUF file, a hub id, or nothing (the embedded SmolLM2-135M-Instruct).
SIGINT / SIGTERM (Ctrl+C / Ctrl+Break on Windows) stop accepting connections, let in-flight
requests finish for up to `--shutdown-timeout` seconds (then end those left with a `server_shutdown`
error: an SSE error event and [DONE] for a stream), stop the engine and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import re
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wllm.model.loader.presets import DUMMY_QUANTIZATIONS

logger = logging.getLogger("wllm.serve")

GiB = 1 << 30
# After the drain timeout, how long the requests that were then cut (error event, [DONE]) get to send
# their last bytes before uvicorn cancels what is left.
CUT_GRACE_S = 5.0
# h11 refuses a head over its own limit with a bare 400; set above ours by more than one socket read (asyncio
# reads at most 256 KiB at a time), the watchdog's 431 with an OpenAI body always comes first.
H11_HEADROOM = 256 * 1024 + 1


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from "12GiB", "12G" (binary), "12GB" (decimal), "512MiB" or a plain byte count."""
    s = text.strip().lower().replace(" ", "")
    match = re.fullmatch(r"([0-9.]*)([a-z]*)", s)
    number, unit = match.groups() if match else ("", "?")
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a size such as 12GiB, 12GB, 512MiB or bytes, got {text!r}")
    return int(value * _SIZE_UNITS[unit])


def register(subparsers: Any) -> None:
    """Add the `serve` subcommand to the `wllm` CLI."""
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (chat, completions, models, tokenize, "
                    "metrics). Without MODEL, serves the embedded SmolLM2-135M-Instruct.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML file with serve settings (keys named like the flags); flags given here override it")
    add_serve_arguments(p)
    p.set_defaults(func=run_serve)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every `wllm serve` setting. The config file's keys are derived from these (wllm/settings.py),
    so a flag added here is a config key too."""
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="HF model folder, GGUF file, HF hub id (REPO or REPO:FILE for a GGUF in a hub repo), "
                        "or nothing for the embedded SmolLM2-135M-Instruct (also by its name, SmolLM2-135M-Instruct)")
    p.add_argument("more_models", nargs="*", default=[], metavar="[NAME=]MODEL",
                   help="more models served beside MODEL, each with its own engine (e.g. an embedding or rerank "
                        "model next to a chat model); requests pick one by `model`. NAME= names it (default: the "
                        "folder name, file stem or hub id)")
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    net.add_argument("--port", type=int, default=8000, help="port to bind (0 picks a free one)")
    net.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests may take to finish after SIGINT/SIGTERM; those "
                          "still running then end with a server_shutdown error")
    net.add_argument("--ui", action=argparse.BooleanOptionalAction, default=True,
                     help="serve the web UI (chat playground, live engine view) at /; --no-ui: / answers 404")
    net.add_argument("--timeout-keep-alive", type=_positive_float, default=5.0, metavar="S",
                     help="close a connection that sends no request for S seconds (a new one too)")
    net.add_argument("--timeout-header", type=_positive_float, default=10.0, metavar="S",
                     help="a request's headers must be complete S seconds after their first byte (else 408)")
    net.add_argument("--timeout-body", type=_positive_float, default=60.0, metavar="S",
                     help="a request's body must have arrived S seconds after its headers (else 408)")
    net.add_argument("--max-header-size", type=_positive_float, default=64.0, metavar="KIB",
                     help="largest request head (request line and headers), in KiB (else 431)")
    net.add_argument("--max-connections", type=_positive_int, default=1024, metavar="N",
                     help="most open connections; at the cap the longest-idle one is closed to make room, "
                          "and when all are busy a new one gets 503")

    model = p.add_argument_group("model")
    model.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when available)")
    model.add_argument("--dtype", default="auto", help="auto, float16, bfloat16 or float32")
    model.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                       help="how to read MODEL; dummy = random weights in MODEL's shape (benchmarks)")
    model.add_argument("--quantization", default=None, choices=DUMMY_QUANTIZATIONS,
                       help="with --load-format dummy: random GGUF blocks of this preset's per-tensor types "
                            "(llama.cpp's mix for the _M presets)")
    model.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) for a hub id")
    model.add_argument("--tokenizer", default=None,
                       help="tokenizer folder or GGUF file, when it is not MODEL's own "
                            "(dummy shapes default to a synthetic byte-level one)")
    model.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                       help="name clients use in `model` (repeatable; the first is reported in responses)")
    model.add_argument("--chat-template", default=None,
                       help="chat template: a file, a template string, or the name of one of the model's templates")
    from wllm.entrypoints.openai.reasoning import REASONING_PARSER_CHOICES
    from wllm.entrypoints.openai.tool_parsers import TOOL_PARSER_CHOICES

    model.add_argument("--tool-call-parser", default="auto", choices=TOOL_PARSER_CHOICES,
                       help="tool-call format of the model's replies; auto: from the chat template's markers "
                            "(generic: tools described in a system message, calls as JSON)")
    model.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSER_CHOICES,
                       help="split <think>...</think> reasoning into reasoning_content; auto: when the chat "
                            "template has the markers")
    model.add_argument("--max-model-len", type=_positive_int, default=None,
                       help="context length (prompt + completion); default: the model's")
    model.add_argument("--seed", type=int, default=0, help="seed for requests that give no seed")
    model.add_argument("--task", action="append", default=[], metavar="[NAME=]TASK",
                       help="what a model serves: generate, embed or rerank (default: detected from its files). "
                            "NAME= picks the model by its served name; without it, the first model (repeatable)")

    eng = p.add_argument_group("engine")
    eng.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV cache block")
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                     help="fraction of GPU memory for weights + KV cache (CUDA)")
    eng.add_argument("--gpu-memory-limit", type=parse_size, default=None, metavar="SIZE",
                     help="most GPU memory wLLM may use, e.g. 12GiB (default: the whole card; the utilization "
                          "applies to this cap)")
    eng.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB of KV cache on the CPU")
    eng.add_argument("--swap-space", type=float, default=1.0,
                     help="GiB of CPU memory to swap preempted requests to (0: always recompute)")
    eng.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                     help="token budget per engine step (prefill chunks + decode tokens); "
                          "default on CUDA: the multiple of 64 x the GPU's SMs nearest 8192 "
                          "(8448 on an H100/H200), 2048 elsewhere")
    eng.add_argument("--max-num-seqs", type=_positive_int, default=256, help="most requests running at once")
    eng.add_argument("--max-queue", type=_non_negative_int, default=1024,
                     help="most requests waiting to be scheduled; more get 503 (0: unbounded)")
    eng.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                     help="serve by arrival, or by the request's `priority` (lower first)")
    eng.add_argument("--enforce-eager", action="store_true",
                     help="CUDA: run every step eagerly (no CUDA graphs)")
    eng.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                     help="CUDA: finish each decode step on the host before launching the next "
                          "(default: launch the next step first, so the GPU does not wait for the host)")
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                     help="reuse KV cache blocks of shared prompt prefixes")
    eng.add_argument("--stream-interval", type=_positive_int, default=1, metavar="N",
                     help="send a stream's new tokens once N have come (the first and last at once): fewer, "
                          "larger frames, for throughput at hundreds of streaming clients")
    eng.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                     help="run the engine in its own process (own GIL), so the HTTP loop and the engine do "
                          "not slow each other down under load; "
                          "default: on for CUDA, off on the CPU")

    sec = p.add_argument_group("security")
    sec.add_argument("--api-key", action="append", default=[], metavar="KEY",
                     help="accepted API key (repeatable); also read from env WLLM_API_KEY / WLLM_API_KEYS "
                          "(comma-separated). No key anywhere: no auth")
    sec.add_argument("--api-key-file", default=None, help="file with one API key per line (# comments)")
    sec.add_argument("--rate-limit-rpm", type=float, default=None,
                     help="requests per minute per API key (per client IP when auth is off)")
    sec.add_argument("--rate-limit-tpm", type=float, default=None,
                     help="prompt + completion tokens per minute per API key (per client IP when auth is off)")
    sec.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                     help="allow browser requests from ORIGIN (repeatable; '*' for any). Default: CORS off")
    sec.add_argument("--metrics-auth", action=argparse.BooleanOptionalAction, default=False,
                     help="GET /metrics needs an API key too (when keys are set). Default: off, open to scrapers")
    sec.add_argument("--max-body-size", type=_positive_float, default=16.0, metavar="MIB",
                     help="largest request body, in MiB (else 413)")
    sec.add_argument("--max-prompt-chars", type=_positive_int, default=None, metavar="N",
                     help="longest prompt in characters (a rendered chat, or one completion prompt), refused "
                          "with a 400 before it is tokenized; default: 16 per token of --max-model-len")
    sec.add_argument("--max-n", type=_positive_int, default=16, help="largest `n` a request may ask for")
    sec.add_argument("--grammar-timeout", type=float, default=10.0, metavar="SECONDS",
                     help="deadline for compiling a request's structured-output grammar (past it: a 400)")

    obs = p.add_argument_group("observability")
    obs.add_argument("--log-format", default="text", choices=["text", "json"],
                     help="json: one JSON object per line, incl. one per request")
    obs.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    obs.add_argument("--otlp-endpoint", default=None,
                     help="send OpenTelemetry traces to this OTLP collector (http://host:4318 or grpc://host:4317); "
                          "needs `pip install opentelemetry-exporter-otlp`")


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def use_engine_process(flag: bool | None, device: str) -> bool:
    """`--engine-process` / `--no-engine-process` as given; unset: on for CUDA only. On the GPU the
    engine steps every few ms and competes with the HTTP loop for the GIL; on the CPU a step is long
    and mostly outside the GIL, and a second process would only add its start-up and share the cores."""
    return flag if flag is not None else device.startswith("cuda")


def _model_source(source: str | None) -> str:
    from wllm.model.default_model import DEFAULT_MODEL_NAME, default_model_path

    return str(default_model_path()) if source is None or source == DEFAULT_MODEL_NAME else source


def _extra_models(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(served name, source) of each model after the first, from `[NAME=]MODEL`."""
    out = []
    for item in args.more_models:
        name, sep, source = item.partition("=")
        if not sep or not name or Path(item).exists():
            name, source = _served_name(item, None)[0], item
        out.append((name, source))
    return out


def _tasks(args: argparse.Namespace, names: list[str]) -> dict[str, str]:
    """Served name -> task from `--task [NAME=]TASK` (a bare TASK is the first model's)."""
    from wllm.model.pooling import TASKS

    tasks: dict[str, str] = {}
    for item in args.task:
        name, sep, task = item.rpartition("=")
        name = name if sep else names[0]
        if task not in TASKS:
            raise ValueError(f"--task {item}: the task must be one of {', '.join(TASKS)}")
        if name not in names:
            raise ValueError(f"--task {item}: no model is served as {name!r} (served: {', '.join(names)})")
        tasks[name] = task
    return tasks


def _served_name(source: str | None, names: list[str] | None) -> list[str]:
    if names:
        return names
    if source is None:
        from wllm.model.default_model import DEFAULT_MODEL_NAME

        return [DEFAULT_MODEL_NAME]
    path = Path(source)
    if path.exists():
        return [path.name if path.is_dir() else path.stem]
    return [source]  # a hub id or a dummy shape name, as given


def _chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    with contextlib.suppress(OSError):
        if len(value) < 1024 and path.is_file():
            return path.read_text(encoding="utf-8")
    return value


def build_engine(args: argparse.Namespace, source: str | None = None, task: str = "auto",
                 first: bool = True) -> tuple[Any, str]:
    """Load a model (`source`, default MODEL) and its tokenizer and start an AsyncEngine (over an engine process
    on CUDA or with `--engine-process`); returns it and the model source. The model-wide flags (`--tokenizer`,
    `--load-format`, `--revision`, `--max-model-len`) apply to the first model only."""
    from wllm.engine.async_engine import AsyncEngine
    from wllm.engine.llm_engine import LLMEngine

    source = _model_source(args.model) if source is None else _model_source(source)
    # The same loading path as wllm.LLM (tokenizer resolution, EOS ids from generation_config).
    kwargs = dict(
        tokenizer=args.tokenizer if first else None, load_format=args.load_format if first else "auto",
        revision=args.revision if first else None, task=task,
        quantization=args.quantization if first else None, dtype=args.dtype, seed=args.seed,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        gpu_memory_limit=args.gpu_memory_limit,
        kv_cache_memory=max(1, int(args.kv_cache_memory * GiB)), swap_space=args.swap_space,
        enable_prefix_caching=args.enable_prefix_caching, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_waiting=args.max_queue, policy=args.scheduling_policy,
        max_model_len=args.max_model_len if first else None,
    )
    # Resolving "auto" asks the driver for a device count; it creates no CUDA context here.
    device = _resolve_device(args.device)
    engine: Any
    if use_engine_process(args.engine_process, device):
        from wllm.engine.engine_process import EngineProcess

        logger.info("engine in its own process (--no-engine-process: in a thread of this one)")
        engine = EngineProcess(source, dict(kwargs, device=device), log=(args.log_format, args.log_level.upper()))
    else:
        engine = LLMEngine.from_pretrained(source, device=device, **kwargs)
    if engine.tokenizer is None:
        engine.close()
        raise ValueError(f"{source} has no tokenizer files; pass --tokenizer <folder or .gguf>")
    async_engine = AsyncEngine(engine, stream_interval=args.stream_interval)
    async_engine.start()
    return async_engine, source


def connection_limits(args: argparse.Namespace) -> Any:
    """The `ConnectionLimits` of the network flags (defaults for a namespace without them)."""
    from wllm.entrypoints.openai.connections import ConnectionLimits

    d = ConnectionLimits()
    return ConnectionLimits(
        keep_alive_timeout=getattr(args, "timeout_keep_alive", d.keep_alive_timeout),
        header_timeout=getattr(args, "timeout_header", d.header_timeout),
        body_timeout=getattr(args, "timeout_body", d.body_timeout),
        max_header_bytes=int(getattr(args, "max_header_size", d.max_header_bytes / 1024) * 1024),
        max_connections=getattr(args, "max_connections", d.max_connections))


def _make_server(app: Any, args: argparse.Namespace, on_ready: Any) -> Any:
    import uvicorn
    from uvicorn.server import HANDLED_SIGNALS

    from wllm.entrypoints.openai.connections import default_http_protocol, guarded_protocol

    class Server(uvicorn.Server):
        """uvicorn's server, but a signal-initiated graceful stop is a clean exit (status 0).

        Stock uvicorn re-raises the captured signal after shutting down, which makes the process
        die of SIGTERM or raise KeyboardInterrupt; a service manager would call that a failure.
        """

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            # signal.signal works on Windows too (SIGINT, SIGTERM, SIGBREAK are in HANDLED_SIGNALS there).
            original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        async def _wait_tasks_to_complete(self) -> None:
            # uvicorn waits for in-flight requests up to `timeout_graceful_shutdown`, then cancels their
            # tasks: streams cut mid-chunk, logged as disconnects with tracebacks. Here, past the drain
            # timeout, every running request is ended by the app instead (a stream sends an error event
            # and [DONE]); only what still runs after CUT_GRACE_S is cancelled.
            drain = super()._wait_tasks_to_complete
            try:
                await asyncio.wait_for(drain(), args.shutdown_timeout)
                return
            except TimeoutError:
                pass
            ctx = app.state.get("server") if hasattr(app, "state") else None
            cut = ctx.cut_requests() if ctx is not None else 0
            logger.warning("shutdown: the drain timeout (%g s) ran out; cancelling %d running request(s), "
                           "each ends with a server_shutdown error", args.shutdown_timeout, cut)
            try:
                await asyncio.wait_for(drain(), CUT_GRACE_S)
            except TimeoutError:
                logger.error("shutdown: %d task(s) still running %g s later; cancelling them",
                             len(self.server_state.tasks), CUT_GRACE_S)
                for t in self.server_state.tasks:
                    t.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and self.servers:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                on_ready(host, port)

    # http="auto": httptools (a dependency; wheels for Linux and Windows) when it imports, h11 otherwise.
    # At high concurrency one event loop's CPU bounds serving, and httptools spends less of it per token.
    # The drain timeout is ours (Server._wait_tasks_to_complete above, a private uvicorn hook, tested by
    # test_server_lifecycle); a uvicorn without that hook keeps its own timeout and its hard cut.
    # The protocol is uvicorn's, under a watchdog for the header / body / idle timeouts and the connection cap
    # that uvicorn lacks (connections.py); its connection-closing events are counted in /metrics.
    own_drain = hasattr(uvicorn.Server, "_wait_tasks_to_complete")
    limits = connection_limits(args)
    ctx = app.state.get("server") if hasattr(app, "state") else None
    on_close = (lambda reason: ctx.metrics.connections_closed.labels(reason=reason).inc()) if ctx is not None else None
    protocol = guarded_protocol(default_http_protocol(), limits, on_close)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False,
                            timeout_graceful_shutdown=None if own_drain else args.shutdown_timeout,
                            timeout_keep_alive=max(1, math.ceil(limits.keep_alive_timeout)),
                            h11_max_incomplete_event_size=limits.max_header_bytes + H11_HEADROOM,
                            loop="asyncio", http=protocol, lifespan="on", server_header=False)
    return Server(config)


class ServeControl:
    """Stops a `run_serve` that runs in another thread, the way SIGTERM stops one in the main thread:
    no new connections, in-flight requests drain for `--shutdown-timeout`, the engine stops. The
    Windows service uses it (a service gets its stop request from the service manager, not a signal)."""

    def __init__(self, log_handlers: tuple[logging.Handler, ...] = ()) -> None:
        self.log_handlers = log_handlers  # added to wLLM's and uvicorn's loggers (the service's Event Log)
        self._lock = threading.Lock()
        self._stopping = False
        self._server: Any = None

    @property
    def stopping(self) -> bool:
        return self._stopping

    def attach(self, server: Any) -> None:
        with self._lock:
            self._server = server
            if self._stopping:
                server.should_exit = True

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            if self._server is not None:
                server = self._server
                server.should_exit = True  # what uvicorn's own signal handler sets: a graceful shutdown


def run_serve(args: argparse.Namespace, control: ServeControl | None = None) -> int:
    """Entry point of `wllm serve`; returns the process exit status (0 after a graceful stop, 1 when the
    model or the server fails, 2 for bad settings)."""
    from wllm.entrypoints.openai.auth import APIKeyError, collect_api_keys
    from wllm.entrypoints.openai.config import MiB, ServerConfig
    from wllm.observability.logs import setup_logging
    from wllm.observability.tracing import TracingSetupError, otlp_tracer_provider
    from wllm.settings import ConfigError, apply, effective

    try:  # flags over the --config file over the environment over the defaults
        args = apply(args, effective(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_format, args.log_level.upper(), extra_handlers=control.log_handlers if control else ())
    try:
        # The environment's keys are already in args.api_key when neither a flag nor the file set it.
        keys = collect_api_keys(args.api_key, args.api_key_file, environ={})
        tracer_provider = otlp_tracer_provider(args.otlp_endpoint) if args.otlp_endpoint else None
        server_config = ServerConfig(
            served_model_names=_served_name(args.model, args.served_model_name),
            chat_template=_chat_template(args.chat_template),
            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
            api_keys=keys, rate_limit_rpm=args.rate_limit_rpm, rate_limit_tpm=args.rate_limit_tpm,
            cors_origins=args.cors_origin, metrics_auth=args.metrics_auth, ui=args.ui,
            max_body_bytes=max(1, int(args.max_body_size * MiB)), max_prompt_chars=args.max_prompt_chars,
            max_n=args.max_n, grammar_timeout_s=args.grammar_timeout)
        connection_limits(args).validate()
        server_config.validate()
    except (APIKeyError, TracingSetupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    extras = _extra_models(args)
    try:
        names = [server_config.served_model_names[0], *(name for name, _ in extras)]
        if len(set(names)) != len(names) or set(server_config.served_model_names) & {n for n, _ in extras}:
            raise ValueError(f"two models are served under one name ({', '.join(names)}); name them NAME=MODEL")
        tasks = _tasks(args, names)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import msgspec

    engines: list[Any] = []
    extra_models: list[tuple[Any, ServerConfig]] = []
    try:
        # One engine per model, each with its own KV cache: a pooling model's holds one step (LLMEngine).
        logger.info("loading model %s", args.model or "(embedded SmolLM2-135M-Instruct)")
        engine, source = build_engine(args, task=tasks.get(names[0], "auto"))
        engines.append(engine)
        server_config.model_root = source
        for name, extra in extras:
            logger.info("loading model %s as %s", extra, name)
            extra_engine, extra_source = build_engine(args, extra, tasks.get(name, "auto"), first=False)
            engines.append(extra_engine)
            extra_models.append((extra_engine, msgspec.structs.replace(
                server_config, served_model_names=[name], model_root=extra_source, chat_template=None)))
    except Exception as exc:  # loader, tokenizer and config errors name the file and what is supported
        for started in engines:
            started.shutdown(close_engine=True)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    server_config.model_root = source
    if control is not None and control.stopping:  # asked to stop while the model loaded
        for started in engines:
            started.shutdown(close_engine=True)
        logger.info("stopped before serving")
        return 0

    from wllm.entrypoints.openai.app import create_app

    app = create_app(engine, server_config, tracer_provider=tracer_provider, extra_models=extra_models)

    def on_ready(host: str, port: int) -> None:
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        shown = f"[{shown}]" if ":" in shown else shown
        auth = "on" if keys else "off"
        ui = f"web UI: http://{shown}:{port}/; " if server_config.ui else ""
        print(f"wLLM ready: serving {','.join(names)} at http://{shown}:{port}/v1 "
              f"(API keys: {auth}; {ui}Ctrl+C to stop)", flush=True)

    server = _make_server(app, args, on_ready)
    if control is not None:
        control.attach(server)
    try:
        server.run()
    finally:
        for started in engines:
            started.shutdown(close_engine=True)
        if tracer_provider is not None:
            tracer_provider.shutdown()
    if not server.started:
        print(f"error: could not start the server on {args.host}:{args.port} (is the port in use?)", file=sys.stderr)
        return 1
    logger.info("server stopped")
    return 0
