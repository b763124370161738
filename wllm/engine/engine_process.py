"""`EngineProcess`: an `LLMEngine` in a spawned child process, driven through a pipe by `AsyncEngine`.

Why: in one process the engine thread and the server's event loop share one GIL. At 256 streaming clients
(H200, Qwen2.5-0.5B shape) each waits on the other: the engine's step took 3-4 ms of wall time for ~2 ms of
GPU work and the loop lagged up to ~0.2 s, so clients saw an inter-token p50 of 34-45 ms. With the engine
in its own process (its own interpreter and GIL) the same load gave 12.6 ms (benchmarks/RESULTS.md,
session 21). `wllm serve` uses it on CUDA (`--engine-process` / `--no-engine-process` decide otherwise).

The parent holds this object in place of an `LLMEngine`: `AsyncEngine` runs its usual loop over it, and
`step()` returns the child's next batch of outputs. Commands go to the child as they come (`add_request`,
`abort` return at once); the child applies them between its steps and runs steps for as long as it has
work, sending one message per step. Outputs cross the pipe as deltas (new token ids, logprobs and text
since the last message) and are rebuilt here as cumulative `RequestOutput`s, so a long stream costs the
same per step as a short one. A request the child refuses (`ValueError`, `QueueFullError`) comes back as
an error for that request's stream (`take_rejected`); an aborted request's blocks are freed by the child
at its next step boundary. Works with the spawn start method only (the default on Windows and macOS; the
child never inherits the parent's CUDA state): the child imports wllm afresh and loads the model itself.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from wllm.outputs import CompletionOutput, ListPrefix, RequestOutput
from wllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["EngineProcess", "EngineProcessError"]


class EngineProcessError(RuntimeError):
    """The engine process failed to start or stopped (its message says why)."""


# ----------------------------------------------------------------------------------- output deltas
# A request's message: (key, finished, num_cached_tokens, error, metrics, new prompt logprobs or None,
# [choice delta]); a choice delta: (index, new token ids, new logprobs or None, text kept, text added,
# cumulative logprob, finish reason, stop reason). The prompt never crosses back: the parent sent it.


class _DeltaEncoder:
    """Child side: what each running request's consumer has been sent, to send only what is new."""

    def __init__(self) -> None:
        # key -> [prompt logprobs sent, {choice index: [tokens sent, logprobs sent, text sent]}]
        self._sent: dict[str, list[Any]] = {}

    def encode(self, out: RequestOutput) -> tuple[Any, ...]:
        state = self._sent.get(out.request_id)
        if state is None:
            state = self._sent[out.request_id] = [0, {}]
        prompt_lps = None
        if out.prompt_logprobs is not None:
            prompt_lps = out.prompt_logprobs[state[0]:]
            state[0] = len(out.prompt_logprobs)
        choices = []
        for c in out.outputs:
            sent = state[1].get(c.index)
            if sent is None:
                sent = state[1][c.index] = [0, 0, ""]
            ids = c.token_ids[sent[0]:]
            lps = None if c.logprobs is None else c.logprobs[sent[1]:]
            old, text = sent[2], c.text
            keep = len(old) if text.startswith(old) else len(os.path.commonprefix([old, text]))
            choices.append((c.index, ids, lps, keep, text[keep:], c.cumulative_logprob, c.finish_reason,
                            c.stop_reason))
            sent[0] = len(c.token_ids)
            sent[1] = 0 if c.logprobs is None else len(c.logprobs)
            sent[2] = text
        if out.finished:
            del self._sent[out.request_id]
        return (out.request_id, out.finished, out.num_cached_tokens, out.error, out.metrics, prompt_lps, choices)

    def forget(self, key: str) -> None:
        self._sent.pop(key, None)


class _Choice:
    """Parent side: one choice's cumulative outputs."""

    __slots__ = ("token_ids", "logprobs", "text", "cumulative_logprob", "finish_reason", "stop_reason")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[Any] | None = None
        self.text = ""
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class _Request:
    """Parent side: one request's cumulative outputs, rebuilt from the child's deltas."""

    __slots__ = ("request_id", "prompt", "prompt_logprobs", "choices", "cached", "metrics")

    def __init__(self, request_id: str, prompt: list[int]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_logprobs: list[Any] | None = None
        self.choices: dict[int, _Choice] = {}
        self.cached = 0
        self.metrics: Any = None

    def apply(self, msg: tuple[Any, ...]) -> RequestOutput:
        """The cumulative output after one of the child's messages for this request."""
        _, finished, self.cached, error, self.metrics, prompt_lps, deltas = msg
        if prompt_lps is not None:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs.extend(prompt_lps)
        for index, ids, lps, keep, added, cum, reason, stop in deltas:
            c = self.choices.get(index)
            if c is None:
                c = self.choices[index] = _Choice()
            c.token_ids.extend(ids)
            if lps is not None:
                if c.logprobs is None:
                    c.logprobs = []
                c.logprobs.extend(lps)
            c.text = c.text[:keep] + added
            c.cumulative_logprob, c.finish_reason, c.stop_reason = cum, reason, stop
        return self.output(finished, [d[0] for d in deltas], error)

    def output(self, finished: bool, indices: Iterable[int] | None = None, error: str | None = None,
               reason: str | None = None) -> RequestOutput:
        """The output now: views of the growing lists while running, lists once finished; `reason` for the
        choices that have none (an abort). `indices`: the choices in the child's order (default: by index)."""
        snap = list if finished else ListPrefix
        outs = []
        for i in sorted(self.choices) if indices is None else indices:
            c = self.choices[i]
            outs.append(CompletionOutput(index=i, text=c.text, token_ids=snap(c.token_ids),
                                         cumulative_logprob=c.cumulative_logprob,
                                         logprobs=None if c.logprobs is None else snap(c.logprobs),
                                         finish_reason=c.finish_reason or reason, stop_reason=c.stop_reason))
        if not outs and reason is not None:
            outs = [CompletionOutput(0, "", [], finish_reason=reason)]
        plp = self.prompt_logprobs
        return RequestOutput(request_id=self.request_id, prompt_token_ids=self.prompt, outputs=outs,
                             finished=finished, num_cached_tokens=self.cached,
                             prompt_logprobs=None if plp is None else snap(plp), metrics=self.metrics, error=error)


# ------------------------------------------------------------------------------------------- child
def _child_main(model: str, engine_kwargs: dict[str, Any], commands: Any, conn: Any,
                log: tuple[str, str] | None, factory: Callable[..., Any] | None) -> None:
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
    try:
        engine = factory(model, **engine_kwargs)
    except BaseException as e:
        _send_error(conn, e)
        return
    try:
        conn.send(("ready", engine.tokenizer, engine.max_model_len, engine.stats(), engine.model_source))
        _serve(engine, commands, conn)
    except (EOFError, BrokenPipeError, ConnectionError):
        pass  # the parent is gone
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, which fails every request
        logger.exception("engine process failed")
        _send_error(conn, e, kind="dead")
    finally:
        engine.close()


def _picklable(error: BaseException) -> BaseException:
    """`error`, or for one that does not pickle a ValueError / EngineProcessError with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        kind = ValueError if isinstance(error, ValueError) else EngineProcessError
        return kind(f"{type(error).__name__}: {error}")


def _send_error(conn: Any, error: BaseException, kind: str = "error") -> None:
    try:
        conn.send((kind, _picklable(error)))
    except Exception:
        pass  # the parent is gone


def _serve(engine: Any, commands: Any, conn: Any) -> None:
    encoder = _DeltaEncoder()
    while True:
        # Apply every command that has come; wait for one only while there is nothing to run.
        while not engine.has_unfinished() or commands.poll():
            msg = commands.recv()
            kind = msg[0]
            if kind == "add":
                _, rid, prompt, params, priority, cache_salt, arrival = msg
                try:
                    engine.add_request(rid, prompt, params, priority=priority, cache_salt=cache_salt,
                                       arrival_time=arrival)
                except Exception as e:  # the request's own error: its stream gets it, the engine goes on
                    conn.send(("rejected", rid, _picklable(e), engine.stats()))
            elif kind == "abort":
                engine.abort(msg[1])
                encoder.forget(msg[1])
                conn.send(("aborted", msg[1], engine.stats()))
            elif kind == "stop":
                return
        outputs = engine.step()
        conn.send(("step", [encoder.encode(o) for o in outputs], engine.stats(), engine.num_failed_steps))


# ------------------------------------------------------------------------------------------ parent
class EngineProcess:
    """An `LLMEngine` running in a child process; the object `AsyncEngine` drives in its place.

    `model` and `engine_kwargs` are `LLMEngine.from_pretrained`'s arguments (loaded in the child);
    `log` = (format, level) sets up the child's logging as `wllm serve` does; `engine_factory` (a
    module-level callable, called in the child as `engine_factory(model, **engine_kwargs)`) replaces
    `LLMEngine.from_pretrained` (tests). Raises what the child's load raised (a ValueError naming the
    file, say), or EngineProcessError if it died while starting. Not thread-safe: one thread
    (AsyncEngine's) calls everything but `stats`."""

    def __init__(self, model: str, engine_kwargs: dict[str, Any] | None = None, *,
                 log: tuple[str, str] | None = None, engine_factory: Callable[..., Any] | None = None) -> None:
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
        self._outbox: deque[tuple[Any, ...]] = deque()
        self._outbox_ready = threading.Condition()
        self._send_error: str | None = None
        self.closed = False
        try:
            msg = self._recv()
        except (EOFError, OSError):
            msg = ("error", None)
        if msg[0] != "ready":
            self._proc.join(5)
            self._conn.close()
            self._commands.close()
            if msg[1] is None:
                raise EngineProcessError(
                    f"the engine process exited while starting (exit code {self._proc.exitcode})")
            raise msg[1]
        _, self.tokenizer, self.max_model_len, self._stats, self.model_source = msg
        self.num_failed_steps = 0
        self._sender = threading.Thread(target=self._send_loop, name="wllm-engine-process-send", daemon=True)
        self._sender.start()
        # The child knows each request by a key never used before ("<id>#<n>"): a step's output for a request
        # aborted here (sent before the child saw the abort) cannot land on a new request of the same id.
        self._next_key = 0
        self._keys: dict[str, str] = {}  # request id -> key of its running request
        self._running: dict[str, _Request] = {}  # key -> its request
        self._aborts_unanswered = 0  # read on until the child's answer (and its fresh stats) are in
        self._rejected: deque[tuple[str, BaseException]] = deque()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def is_alive(self) -> bool:
        """Whether the child still runs (False once closed)."""
        return not self.closed and self._proc.is_alive()

    # ------------------------------------------------------------------ what AsyncEngine calls
    def add_request(self, request_id: str, prompt: Iterable[int], params: SamplingParams | None = None, *,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        """Send a request to the child. Its validation happens there: a refused request comes back from
        `take_rejected` after a later `step()`."""
        if request_id in self._keys:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = list(prompt)
        key = f"{request_id}#{self._next_key}"
        self._send(("add", key, ids, params or SamplingParams(), priority, cache_salt,
                    time.monotonic() if arrival_time is None else arrival_time))
        self._next_key += 1
        self._keys[request_id] = key
        self._running[key] = _Request(request_id, ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request; returns its final output (what had come so far, finish reason "abort" for the
        choices still running), None if it is not running. The child frees its blocks at its next step
        boundary."""
        key = self._keys.pop(request_id, None)
        if key is None:
            return None
        request = self._running.pop(key)
        if self._send_error is None:  # a gone child has nothing left to abort; the reader sees its exit
            self._put(("abort", key))
            self._aborts_unanswered += 1
        return request.output(True, reason="abort")

    def has_unfinished(self) -> bool:
        return bool(self._running) or self._aborts_unanswered > 0

    def step(self) -> list[RequestOutput]:
        """The outputs of the child's next step (waits for it; rejections and answers to aborts on the way
        are taken in). Returns [] if nothing is left to wait for. Raises EngineProcessError when the child
        has stopped."""
        while self.has_unfinished():
            try:
                msg = self._recv()
            except (EOFError, OSError):
                self._proc.join(5)
                raise EngineProcessError(f"the engine process exited (exit code {self._proc.exitcode})") from None
            kind = msg[0]
            if kind == "step":
                _, encoded, self._stats, self.num_failed_steps = msg
                outputs = []
                for m in encoded:
                    request = self._running.get(m[0])
                    if request is None:
                        continue  # aborted here while the step ran
                    out = request.apply(m)
                    if out.finished:
                        del self._running[m[0]], self._keys[request.request_id]
                    outputs.append(out)
                return outputs
            if kind == "rejected":
                _, key, error, self._stats = msg
                request = self._running.pop(key, None)
                if request is not None:
                    del self._keys[request.request_id]
                    self._rejected.append((request.request_id, error))
            elif kind == "aborted":
                self._stats = msg[2]
                self._aborts_unanswered -= 1
            elif kind == "dead":
                raise EngineProcessError(f"the engine process failed: {msg[1]}")
            else:
                raise EngineProcessError(f"unexpected message from the engine process: {kind!r}")
        return []

    def _recv(self) -> Any:
        """The child's next message; EOFError once it has exited with nothing left to read. Waits on the
        process too: on Windows a child that dies before taking over its pipe ends leaves ours open."""
        if not self._conn.poll():
            ready = multiprocessing.connection.wait([self._conn, self._proc.sentinel])
            if self._conn not in ready and not self._conn.poll():
                raise EOFError
        return self._conn.recv()

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
        self._put(("stop",))
        deadline = time.monotonic() + timeout
        # Read on while waiting: a child blocked sending a step's results would never see the stop.
        while self._proc.is_alive() and time.monotonic() < deadline:
            try:
                if self._conn.poll(0.05):
                    self._conn.recv()
            except (EOFError, OSError):
                break
        self._proc.join(max(0.0, deadline - time.monotonic()))
        if self._proc.is_alive():
            logger.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()

    def _send(self, msg: tuple[Any, ...]) -> None:
        if self._send_error is not None:
            raise EngineProcessError(f"the engine process is gone ({self._send_error})")
        self._put(msg)

    def _put(self, msg: tuple[Any, ...]) -> None:
        with self._outbox_ready:
            self._outbox.append(msg)
            self._outbox_ready.notify()

    def _send_loop(self) -> None:
        """The sender thread: writes queued commands to the child in order, never holding up the reader. It
        ends after sending "stop" (`close` always queues it) or when the child is gone (a killed child
        breaks a blocked send too)."""
        while True:
            with self._outbox_ready:
                while not self._outbox:
                    self._outbox_ready.wait()
                batch = list(self._outbox)
                self._outbox.clear()
            try:
                for msg in batch:
                    self._commands.send(msg)
                    if msg[0] == "stop":
                        self._commands.close()
                        return
            except (OSError, ValueError) as e:
                self._send_error = str(e)  # the child is gone; the reader sees its exit
                return
