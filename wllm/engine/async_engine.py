"""`AsyncEngine`: an engine's step loop in its own thread, streaming to asyncio consumers.

It drives a `wllm.engine.protocol.EngineCore`: an `LLMEngine` in this process or an `EngineProcess`.
Callers on any event loop submit commands (add, abort) through a thread-safe queue; the loop
thread applies them between steps, runs `step_deltas()`, and publishes each `RequestDelta` to the
request's consumer, waking all of a step's consumers on one event loop with one `call_soon_threadsafe`
(a consumer that falls behind gets the deltas it missed merged into one, not a backlog). A failing step
fails only its requests (they get an output with `error` set); after `max_consecutive_failures` failing
steps in a row, or if the loop itself breaks, the engine marks itself unhealthy, fails every request and
rejects new ones, so no consumer ever waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from wllm.engine.protocol import EngineCore
from wllm.model.pooling import PoolingConfig
from wllm.outputs import CompletionDelta, RequestDelta, merge_deltas
from wllm.pooling_params import PoolingParams
from wllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has failed; the server should report itself unhealthy."""


class _Stream:
    """Hands one request's deltas from the engine thread to its consumer's event loop.

    The engine thread queues each delta and wakes the loop at most once until the consumer has looked; the
    consumer takes everything queued and merges it into one delta (`merge_deltas`), so a consumer that has
    fallen behind sends one frame where it would have sent several. A handoff per delta (one loop callback
    and self-pipe write each, i.e. one per stream per step) kept a serving event loop busier than the
    engine under many streaming clients, and new requests waited behind that backlog. Lock-free: the
    queue is a deque (append and popleft are atomic), only the engine thread sets `woken`, only the loop
    thread clears it; a delta queued after the consumer looked finds `woken` clear and wakes it again, so
    none is missed.

    `interval` > 1 wakes the consumer only once `interval` more tokens (per choice) have come since its last
    wake-up (the first delta, a finished one and an error always wake it): fewer, larger frames per stream,
    for an event loop that streams to hundreds of clients (`wllm serve --stream-interval`)."""

    __slots__ = ("loop", "pending", "failed", "woken", "ready", "interval", "woke_at", "tokens")

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: int = 1) -> None:
        self.loop = loop
        self.pending: deque[RequestDelta | BaseException] = deque()
        self.failed = False  # engine thread only: an error was queued (it is final)
        self.woken = False
        self.ready = asyncio.Event()
        self.interval = interval
        self.woke_at = 0  # engine thread only: tokens (per choice) the consumer will have read when it wakes
        self.tokens: dict[int, int] = {}  # engine thread only, with `interval` > 1: tokens so far per choice

    def put(self, item: RequestDelta | BaseException) -> None:
        """Engine thread: queue `item` (an error is final) and wake the consumer."""
        if self.publish(item):
            _wake_on_loop(self.loop, (self,))

    def publish(self, item: RequestDelta | BaseException) -> bool:
        """Engine thread: `put` without the wake-up; True when the consumer must be woken (see `_wake_all`)."""
        if self.failed:
            return False
        if isinstance(item, BaseException):
            self.failed = True
        self.pending.append(item)
        if self.interval > 1 and isinstance(item, RequestDelta) and not item.finished:
            counts = self.tokens
            for c in item.outputs:
                if c.token_ids:
                    counts[c.index] = counts.get(c.index, 0) + len(c.token_ids)
            tokens = max(counts.values(), default=0)  # per choice: n > 1 alike
            if self.woken:  # the consumer, already woken, will read this delta with the others
                self.woke_at = tokens
                return False
            if self.woke_at and tokens - self.woke_at < self.interval:
                return False
            self.woke_at = tokens
        elif self.woken:
            return False
        self.woken = True
        return True

    def _wake(self) -> None:
        self.woken = False
        self.ready.set()

    async def __aiter__(self) -> AsyncIterator[RequestDelta | BaseException]:
        """Loop thread: what has come since the last time, as one delta (or the error, which replaces it)."""
        pending = self.pending
        while True:
            await self.ready.wait()
            self.ready.clear()
            batch = []
            while pending:
                batch.append(pending.popleft())
            if not batch:
                continue
            error = batch[-1]
            yield error if isinstance(error, BaseException) else merge_deltas(batch)  # type: ignore[arg-type]


class AsyncEngine:
    """Serve an `EngineCore` (an `LLMEngine`, an `EngineProcess`) to asyncio code. Satisfies the HTTP
    layer's `EngineClient`."""

    def __init__(self, engine: EngineCore, max_consecutive_failures: int = 3,
                 stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self.engine = engine
        self.max_consecutive_failures = max_consecutive_failures
        self.stream_interval = stream_interval
        self._streams: dict[str, _Stream] = {}
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._stop = False
        self._dead: str | None = None
        self._consecutive_failures = 0
        self._thread: threading.Thread | None = None
        self._stats: dict[str, Any] = engine.stats()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def pooling(self) -> PoolingConfig | None:
        """The model's pooling (None: a generative model); `generate` then takes `PoolingParams`."""
        return getattr(self.engine, "pooling", None)

    def is_healthy(self) -> bool:
        # An engine process can die while idle, when no step is there to notice: health asks it directly.
        return self._dead is None and self.engine.is_alive()

    def stats(self) -> dict[str, Any]:
        """The last step's engine stats plus health and stream counts (safe from any thread)."""
        s = dict(self._stats)
        s["healthy"] = self.is_healthy()
        s["num_streams"] = len(self._streams)
        return s

    # ----------------------------------------------------------------------------------- client
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="wllm-engine", daemon=True)
            self._thread.start()

    def shutdown(self, close_engine: bool = False) -> None:
        """Stop the loop thread; pending requests get an error output. `close_engine`: then close the
        engine too (an `EngineProcess`'s child exits; an `LLMEngine` frees the GPU)."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if close_engine:
            self.engine.close()

    def _submit(self, command: Callable[[], None]) -> None:
        with self._wake:
            if self._dead is not None:
                raise EngineDeadError(f"the engine has stopped after an error: {self._dead}")
            self._commands.append(command)
            self._wake.notify()

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas until it finishes (what a consumer that falls behind missed comes
        merged into one; the last has `finished` set). Raises QueueFullError (queue at its bound),
        ValueError (bad input) or EngineDeadError; aborts the request if the consumer stops iterating."""
        if not self.is_healthy():
            raise EngineDeadError(f"the engine has stopped after an error: {self._dead or 'its process exited'}")
        self.start()
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[None] = loop.create_future()
        stream = _Stream(loop, self.stream_interval)

        def add() -> None:
            try:
                if request_id in self._streams:
                    raise ValueError(f"request id {request_id!r} is already in use")
                self.engine.add_request(request_id, prompt_token_ids, params, priority=priority,
                                        cache_salt=cache_salt)
                self._streams[request_id] = stream
                result: BaseException | None = None
            except Exception as e:
                result = e
            _call_on_loop(loop, _settle, accepted, result)

        self._submit(add)
        await accepted
        finished = False
        try:
            async for item in stream:
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished and self._dead is None:
                self._submit(lambda: self._abort_now(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request and return once the engine has freed its blocks (an EngineProcess frees them at
        its next step boundary, shortly after); an unknown id is a no-op."""
        if self._dead is not None:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def command() -> None:
            try:
                self._abort_now(request_id)
            finally:
                _call_on_loop(loop, _settle, done, None)

        self._submit(command)
        await done

    # ------------------------------------------------------------------------------ loop thread
    def _abort_now(self, request_id: str) -> None:
        out = self.engine.abort_delta(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and out is not None:
            stream.put(out)
        # The engine may now go idle with no step to refresh the counters that /metrics reads.
        self._stats = self.engine.stats()

    def _deliver(self, outputs: list[RequestDelta]) -> None:
        # One loop callback per event loop per step, not one per stream: each costs the engine thread a lock
        # and a self-pipe write, and the loop a wake-up (one per stream per step otherwise).
        to_wake: dict[asyncio.AbstractEventLoop, list[_Stream]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if stream.publish(out):
                to_wake.setdefault(stream.loop, []).append(stream)
            if out.finished:
                del self._streams[out.request_id]
        for loop, streams in to_wake.items():
            _wake_on_loop(loop, streams)

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stop and not self._commands and not self.engine.has_unfinished():
                        self._wake.wait()
                    if self._stop:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:
                    command()
                if not self.engine.has_unfinished():
                    continue
                failed_before = self.engine.num_failed_steps
                outputs = self.engine.step_deltas()
                self._stats = self.engine.stats()
                if self.engine.num_failed_steps > failed_before:
                    self._consecutive_failures += 1
                else:
                    self._consecutive_failures = 0
                self._deliver(outputs)
                # An engine process validates requests in its child: one it refuses comes back after a step.
                for request_id, error in self.engine.take_rejected():
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        stream.put(error)
                if self._consecutive_failures >= self.max_consecutive_failures:
                    raise EngineDeadError(f"{self._consecutive_failures} engine steps failed in a row")
            self._fail_all("the engine was shut down")
        except BaseException as e:  # the loop must never die silently: fail everyone, go unhealthy
            logger.exception("engine loop failed")
            self._fail_all(f"{type(e).__name__}: {e}")

    def _fail_all(self, message: str) -> None:
        with self._wake:
            # Set under the lock: a later _submit raises instead of queueing a command nobody runs.
            self._dead = message
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            try:
                command()  # adds fail fast below (the request is failed right after), aborts finish
            except Exception:
                pass
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_delta(request_id)  # frees its blocks (an engine process's child stops computing it)
            except Exception:
                pass
            stream.put(RequestDelta(request_id, [CompletionDelta(0, "", [], finish_reason="error")], finished=True,
                                    error=message))
        self._streams.clear()


def _call_on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    """Engine thread: run `callback(*args)` on `loop`, unless that loop is closed (its caller is gone: a
    client's `asyncio.run` ended while its command waited). The engine thread must not die of that."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass


def _wake_on_loop(loop: asyncio.AbstractEventLoop, streams: Sequence[_Stream]) -> None:
    """Engine thread: wake `streams`' consumers, all waiting on `loop`, with one callback."""
    _call_on_loop(loop, _wake_all, streams)


def _wake_all(streams: Sequence[_Stream]) -> None:
    for stream in streams:
        stream._wake()


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
