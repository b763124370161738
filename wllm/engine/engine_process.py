"""`EngineProcess`: an `LLMEngine` in a spawned child process, driven through a pipe by `AsyncEngine`.

Why: in one process the engine thread and the server's event loop share one GIL, and under many streaming
clients each waits on the other (inter-token latency, loop lag); with the engine in its own process (its own
interpreter and GIL) they do not (benchmarks/RESULTS.md). `wllm serve` uses it on CUDA (`--engine-process` /
`--no-engine-process` decide otherwise).

The parent holds this object in place of an `LLMEngine`: both implement `wllm.engine.protocol.EngineCore`,
so `AsyncEngine` runs its usual loop over it, and `step_deltas()` returns the child's next batch of deltas.
Commands go to the child as they come (`add_request`, `abort_delta` return at once); the child applies them
between its steps and runs steps for as long as it has work, sending one message per step. Every message
either way is a msgspec Struct of a tagged union (`Command`, `Reply`), encoded as msgpack. Outputs cross as
`RequestDelta`s (new token ids, logprobs and text since the last message) and go on to `AsyncEngine` as
they are, so a long stream costs the same per step as a short one. A request the child refuses
(`ValueError`, `QueueFullError`) comes back as an error for that request's stream (`take_rejected`); an
aborted request's blocks are freed by the child at its next step boundary. Works with the spawn start
method only (the default on Windows and macOS; the child never inherits the parent's CUDA state): the
child imports wllm afresh and loads the model itself.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Literal

import msgspec

from wllm.engine.protocol import EngineCore
from wllm.engine.request import QueueFullError
from wllm.model.pooling import PoolingConfig
from wllm.outputs import CompletionDelta, RequestDelta, RequestMetrics
from wllm.pooling_params import PoolingParams
from wllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["EngineProcess", "EngineProcessError"]


class EngineProcessError(RuntimeError):
    """The engine process failed to start or stopped (its message says why)."""


# -------------------------------------------------------------------------------------------- messages
# Requests are known to the child by a key never used before ("<id>#<n>"), not by their id: see
# EngineProcess.__init__.


class RemoteError(msgspec.Struct, array_like=True):
    """An exception raised in the child, as the parent re-raises it: ValueError and QueueFullError keep their
    class (the server maps them to 400 and 503), anything else becomes EngineProcessError; the message is
    the original's `str()`."""

    kind: Literal["value", "queue_full", "other"]
    type_name: str
    message: str

    @classmethod
    def of(cls, error: BaseException) -> RemoteError:
        kind: Literal["value", "queue_full", "other"] = (
            "queue_full" if isinstance(error, QueueFullError) else "value" if isinstance(error, ValueError)
            else "other")
        return cls(kind, type(error).__name__, str(error) or type(error).__name__)

    def exception(self) -> BaseException:
        if self.kind == "value":
            return ValueError(self.message)
        if self.kind == "queue_full":
            return QueueFullError(self.message)
        return EngineProcessError(self.message)


# Parent -> child.
class AddRequest(msgspec.Struct, tag=True, array_like=True):
    key: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float
    pooling: PoolingParams | None = None  # a pooling request (then `params` is unused)


class AbortRequest(msgspec.Struct, tag=True, array_like=True):
    key: str


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


Command = AddRequest | AbortRequest | Shutdown


# Child -> parent.
class Ready(msgspec.Struct, tag=True, array_like=True):
    """The model is loaded. The tokenizer stays pickled: it is a Python object (a `tokenizers` or GGUF
    vocabulary with its chat template and special-token tables) with no schema of its own, and rebuilding it
    in the parent from its files would mean resolving and loading them a second time."""

    tokenizer: bytes
    max_model_len: int
    stats: dict[str, Any]
    pooling: PoolingConfig | None = None


class LoadFailed(msgspec.Struct, tag=True, array_like=True):
    error: RemoteError


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """One step's deltas, keyed by the child's request keys."""

    deltas: list[RequestDelta]
    stats: dict[str, Any]
    num_failed_steps: int


class Rejected(msgspec.Struct, tag=True, array_like=True):
    key: str
    error: RemoteError
    stats: dict[str, Any]


class Aborted(msgspec.Struct, tag=True, array_like=True):
    key: str
    stats: dict[str, Any]


class EngineFailed(msgspec.Struct, tag=True, array_like=True):
    """The child's loop broke; it exits after sending this."""

    error: RemoteError


Reply = Ready | LoadFailed | StepOutputs | Rejected | Aborted | EngineFailed


def _plain(obj: Any) -> Any:
    """msgpack's hook for a value it cannot encode: a numpy or torch scalar (a token id, a logprob or a stat
    a caller computed with them) goes as the Python number it holds."""
    item = getattr(type(obj), "item", None)
    if item is None:
        raise TypeError(f"cannot send a {type(obj).__name__} to or from the engine process")
    return item(obj)


# ------------------------------------------------------------------------------------------- child
def _child_main(model: str, engine_kwargs: dict[str, Any], commands: Any, conn: Any,
                log: tuple[str, str] | None, factory: Callable[..., EngineCore] | None) -> None:
    """The engine process: load the model, report ready (or the error) on `conn`, then apply what comes on
    `commands` and run steps."""
    # Ctrl+C (and Windows' Ctrl+Break) reach every process of the console: the parent drains its requests and
    # then stops the engine. SIGTERM is left alone: multiprocessing stops a forgotten child with it at exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGBREAK"):
        signal.signal(signal.SIGBREAK, signal.SIG_IGN)
    if log is not None:
        from wllm.observability.logs import setup_logging
        setup_logging(*log)
    if factory is None:
        from wllm.engine.llm_engine import LLMEngine

        factory = LLMEngine.from_pretrained
    encode = msgspec.msgpack.Encoder(enc_hook=_plain).encode
    try:
        engine = factory(model, **engine_kwargs)
    except BaseException as e:
        _send_error(conn, encode, LoadFailed(RemoteError.of(e)))
        return
    try:
        conn.send_bytes(encode(Ready(pickle.dumps(engine.tokenizer), engine.max_model_len, engine.stats(),
                                     getattr(engine, "pooling", None))))
        _serve(engine, commands, conn, encode)
    except (EOFError, BrokenPipeError, ConnectionError):
        pass  # the parent is gone
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, which fails every request
        logger.exception("engine process failed")
        _send_error(conn, encode, EngineFailed(RemoteError.of(e)))
    finally:
        engine.close()


def _send_error(conn: Any, encode: Callable[[Any], bytes], msg: LoadFailed | EngineFailed) -> None:
    try:
        conn.send_bytes(encode(msg))
    except Exception:
        pass  # the parent is gone


def _serve(engine: EngineCore, commands: Any, conn: Any, encode: Callable[[Any], bytes]) -> None:
    decode = msgspec.msgpack.Decoder(Command).decode
    while True:
        # Apply every command that has come; wait for one only while there is nothing to run.
        while not engine.has_unfinished() or commands.poll():
            msg = decode(commands.recv_bytes())
            if isinstance(msg, AddRequest):
                try:
                    engine.add_request(msg.key, msg.prompt, msg.pooling or msg.params, priority=msg.priority,
                                       cache_salt=msg.cache_salt, arrival_time=msg.arrival_time)
                except Exception as e:  # the request's own error: its stream gets it, the engine goes on
                    conn.send_bytes(encode(Rejected(msg.key, RemoteError.of(e), engine.stats())))
            elif isinstance(msg, AbortRequest):
                engine.abort_delta(msg.key)  # the parent answered its caller already
                conn.send_bytes(encode(Aborted(msg.key, engine.stats())))
            else:
                return
        deltas = engine.step_deltas()
        for key, error in engine.take_rejected():  # a grammar that failed to compile in the child
            conn.send_bytes(encode(Rejected(key, RemoteError.of(error), engine.stats())))
        conn.send_bytes(encode(StepOutputs(deltas, engine.stats(), engine.num_failed_steps)))


# ------------------------------------------------------------------------------------------ parent
class _Running:
    """Parent side: what a running request's abort answers with (no outputs are kept here: they went on)."""

    __slots__ = ("request_id", "choices", "cached", "metrics")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.choices: dict[int, tuple[str | None, str | int | None, float | None]] = {}  # finish, stop, cum. lp
        self.cached = 0
        self.metrics: RequestMetrics | None = None

    def seen(self, delta: RequestDelta) -> None:
        self.cached, self.metrics = delta.num_cached_tokens, delta.metrics
        for c in delta.outputs:
            self.choices[c.index] = (c.finish_reason, c.stop_reason, c.cumulative_logprob)

    def aborted(self) -> RequestDelta:
        """The last delta of an aborted request: finish reason "abort" for the choices that had none."""
        outs = [CompletionDelta(i, "", [], None, cum, reason or "abort", stop)
                for i, (reason, stop, cum) in sorted(self.choices.items())]
        return RequestDelta(self.request_id, outs or [CompletionDelta(0, "", [], finish_reason="abort")],
                            finished=True, num_cached_tokens=self.cached, metrics=self.metrics)


class EngineProcess:
    """An `LLMEngine` running in a child process; the `EngineCore` `AsyncEngine` drives in its place.

    `model` and `engine_kwargs` are `LLMEngine.from_pretrained`'s arguments (loaded in the child);
    `log` = (format, level) sets up the child's logging as `wllm serve` does; `engine_factory` (a
    module-level callable, called in the child as `engine_factory(model, **engine_kwargs)`, returning an
    `EngineCore`) replaces `LLMEngine.from_pretrained` (tests). Raises what the child's load raised (a
    ValueError naming the file, say; other errors as EngineProcessError with their message), or
    EngineProcessError if it died while starting. Not thread-safe: one thread (AsyncEngine's) calls
    everything but `stats`."""

    def __init__(self, model: str, engine_kwargs: dict[str, Any] | None = None, *,
                 log: tuple[str, str] | None = None, engine_factory: Callable[..., EngineCore] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        # One pipe each way, each end used by one thread: commands are written by a sender thread, results
        # read by AsyncEngine's. A thread that sent and read in turn could block sending while the child
        # blocks sending its results, each pipe full, each side waiting on the other.
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._conn, results_out = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child_main,
                                 args=(model, dict(engine_kwargs or {}), commands_in, results_out, log,
                                       engine_factory),
                                 name="wllm-engine-process", daemon=True)
        self._proc.start()
        commands_in.close()  # the child's ends: EOF on ours once it has exited
        results_out.close()
        self._decode = msgspec.msgpack.Decoder(Reply).decode
        self._encode = msgspec.msgpack.Encoder(enc_hook=_plain).encode
        self._outbox: deque[tuple[bytes, bool]] = deque()  # (encoded command, is it Shutdown)
        self._outbox_ready = threading.Condition()
        self._send_error: str | None = None
        self.closed = False
        try:
            msg: Reply | None = self._recv()
        except (EOFError, OSError):
            msg = None
        if not isinstance(msg, Ready):
            self._proc.join(5)
            self._conn.close()
            self._commands.close()
            if isinstance(msg, (LoadFailed, EngineFailed)):
                raise msg.error.exception()
            raise EngineProcessError(f"the engine process exited while starting (exit code {self._proc.exitcode})")
        self._tokenizer = pickle.loads(msg.tokenizer)
        self._max_model_len = msg.max_model_len
        self._pooling = msg.pooling
        self._stats = msg.stats
        self.num_failed_steps = 0
        self._sender = threading.Thread(target=self._send_loop, name="wllm-engine-process-send", daemon=True)
        self._sender.start()
        # The child knows each request by a key never used before ("<id>#<n>"): a step's output for a request
        # aborted here (sent before the child saw the abort) cannot land on a new request of the same id.
        self._next_key = 0
        self._keys: dict[str, str] = {}  # request id -> key of its running request
        self._running: dict[str, _Running] = {}  # key -> its request
        self._aborts_unanswered = 0  # read on until the child's answer (and its fresh stats) are in
        self._rejected: deque[tuple[str, BaseException]] = deque()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def pooling(self) -> PoolingConfig | None:
        """The child's model's pooling (None: a generative model)."""
        return self._pooling

    def is_alive(self) -> bool:
        """Whether the child still runs (False once closed)."""
        return not self.closed and self._proc.is_alive()

    # ------------------------------------------------------------------ what AsyncEngine calls
    def add_request(self, request_id: str, prompt: Iterable[int], params: SamplingParams | PoolingParams | None = None,
                    *, priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        """Send a request to the child. Its validation happens there: a refused request comes back from
        `take_rejected` after a later `step_deltas()`."""
        if request_id in self._keys:
            raise ValueError(f"request id {request_id!r} is already in use")
        key = f"{request_id}#{self._next_key}"
        pooling = params if isinstance(params, PoolingParams) else None
        sampling = SamplingParams() if pooling is not None or params is None else params
        self._send(AddRequest(key, list(prompt), sampling, priority, cache_salt,  # type: ignore[arg-type]
                              time.monotonic() if arrival_time is None else arrival_time, pooling))
        self._next_key += 1
        self._keys[request_id] = key
        self._running[key] = _Running(request_id)

    def abort_delta(self, request_id: str) -> RequestDelta | None:
        """Stop a request; returns its last delta (finish reason "abort" for the choices still running), None
        if it is not running. The child frees its blocks at its next step boundary."""
        key = self._keys.pop(request_id, None)
        if key is None:
            return None
        request = self._running.pop(key)
        if self._send_error is None:  # a gone child has nothing left to abort; the reader sees its exit
            self._put(AbortRequest(key))
            self._aborts_unanswered += 1
        return request.aborted()

    def has_unfinished(self) -> bool:
        return bool(self._running) or self._aborts_unanswered > 0

    def step_deltas(self) -> list[RequestDelta]:
        """The deltas of the child's next step (waits for it; rejections and answers to aborts on the way
        are taken in). Returns [] if nothing is left to wait for. Raises EngineProcessError when the child
        has stopped."""
        while self.has_unfinished():
            try:
                msg = self._recv()
            except (EOFError, OSError):
                self._proc.join(5)
                raise EngineProcessError(f"the engine process exited (exit code {self._proc.exitcode})") from None
            if isinstance(msg, StepOutputs):
                self._stats, self.num_failed_steps = msg.stats, msg.num_failed_steps
                deltas = []
                for delta in msg.deltas:
                    key = delta.request_id
                    request = self._running.get(key)
                    if request is None:
                        continue  # aborted here while the step ran
                    request.seen(delta)
                    delta.request_id = request.request_id
                    if delta.finished:
                        del self._running[key], self._keys[request.request_id]
                    deltas.append(delta)
                return deltas
            if isinstance(msg, Rejected):
                self._stats = msg.stats
                rejected = self._running.pop(msg.key, None)
                if rejected is not None:
                    del self._keys[rejected.request_id]
                    self._rejected.append((rejected.request_id, msg.error.exception()))
            elif isinstance(msg, Aborted):
                self._stats = msg.stats
                self._aborts_unanswered -= 1
            elif isinstance(msg, EngineFailed):
                raise EngineProcessError(f"the engine process failed: {msg.error.message}")
            else:
                raise EngineProcessError(f"unexpected message from the engine process: {type(msg).__name__}")
        return []

    def _recv(self) -> Reply:
        """The child's next message; EOFError once it has exited with nothing left to read. Waits on the
        process too: on Windows a child that dies before taking over its pipe ends leaves ours open."""
        if not self._conn.poll():
            ready = multiprocessing.connection.wait([self._conn, self._proc.sentinel])
            if self._conn not in ready and not self._conn.poll():
                raise EOFError
        return self._decode(self._conn.recv_bytes())

    def take_rejected(self) -> list[tuple[str, BaseException]]:
        """Requests the child refused since the last call, with the error `add_request` raised there."""
        out = list(self._rejected)
        self._rejected.clear()
        return out

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child (it frees the GPU as it exits) and wait for it; kill it after `timeout` s."""
        if self.closed:
            return
        self.closed = True
        self._put(Shutdown())
        deadline = time.monotonic() + timeout
        # Read on while waiting: a child blocked sending a step's results would never see the stop.
        while self._proc.is_alive() and time.monotonic() < deadline:
            try:
                if self._conn.poll(0.05):
                    self._conn.recv_bytes()
            except (EOFError, OSError):
                break
        self._proc.join(max(0.0, deadline - time.monotonic()))
        if self._proc.is_alive():
            logger.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()

    def _send(self, msg: AddRequest) -> None:
        if self._send_error is not None:
            raise EngineProcessError(f"the engine process is gone ({self._send_error})")
        try:
            self._put(msg)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as e:
            # A value msgpack cannot carry (an int past 64 bits, an object it has no encoding for) fails
            # this request alone, as a bad request.
            raise ValueError(f"the request cannot be sent to the engine process: {e}") from None

    def _put(self, msg: AddRequest | AbortRequest | Shutdown) -> None:
        # Encoded here, on the caller's thread, so that an encoding error reaches the caller instead of ending
        # the sender thread (which would leave every later command unsent).
        data = self._encode(msg)
        with self._outbox_ready:
            self._outbox.append((data, isinstance(msg, Shutdown)))
            self._outbox_ready.notify()

    def _send_loop(self) -> None:
        """The sender thread: writes queued commands to the child in order, never holding up the reader. It
        ends after sending `Shutdown` (`close` always queues it) or when the child is gone (a killed child
        breaks a blocked send too)."""
        while True:
            with self._outbox_ready:
                while not self._outbox:
                    self._outbox_ready.wait()
                batch = list(self._outbox)
                self._outbox.clear()
            try:
                for data, shutdown in batch:
                    self._commands.send_bytes(data)
                    if shutdown:
                        self._commands.close()
                        return
            except Exception as e:  # noqa: BLE001 - the pipe is broken: the child is gone, the reader sees its exit
                self._send_error = str(e)
                return
