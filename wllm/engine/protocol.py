"""`EngineCore`: what `AsyncEngine` drives, as one typing.Protocol.

Implemented by the in-thread `LLMEngine` and by `EngineProcess` (the same engine in a spawned child,
behind a pipe), so `AsyncEngine` runs one loop over either and never asks which one it has. Outputs
cross it as `RequestDelta`s: per step, per request that changed, only the new tokens, text and
logprobs (see `wllm.outputs`). `tests/test_engine_protocol.py` checks that every implementation has
every member with a compatible signature.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from wllm.model.pooling import PoolingConfig
from wllm.outputs import RequestDelta
from wllm.pooling_params import PoolingParams
from wllm.sampling_params import SamplingParams

__all__ = ["EngineCore"]


class EngineCore(Protocol):
    """A continuous-batching engine driven by one thread (`AsyncEngine`'s); only `stats` may be called from
    others."""

    num_failed_steps: int  # steps that failed so far (each fails only its own requests)

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (`encode`, `decode`, `apply_chat_template`), or None."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def pooling(self) -> PoolingConfig | None:
        """A pooling model's pooling (it takes `PoolingParams` requests only); None for a generative model."""
        ...

    def add_request(self, request_id: str, prompt: Iterable[int], params: SamplingParams | PoolingParams | None = None,
                    *, priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        """Queue a request. May raise ValueError / QueueFullError at once, or refuse it later: then it comes
        back from `take_rejected`."""
        ...

    def abort_delta(self, request_id: str) -> RequestDelta | None:
        """Stop a request now (its blocks are freed; an engine process's child frees them at its next step);
        returns the request's last delta (finish reason "abort" for the choices still running), None if it
        is not running."""
        ...

    def has_unfinished(self) -> bool: ...

    def step_deltas(self) -> list[RequestDelta]:
        """Run (or wait for) one step: the delta of every request that changed. A request's last delta has
        `finished` set; after it the request is gone."""
        ...

    def take_rejected(self) -> list[tuple[str, BaseException]]:
        """Requests refused after `add_request` returned (by an engine process's child) since the last call,
        with the error to give their consumers."""
        ...

    def is_alive(self) -> bool:
        """Whether the engine can still run steps (False once closed, or once its process has exited)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Gauges and counters (queue lengths, KV usage, prefix cache, steps), read by name for /metrics."""
        ...

    def close(self) -> None:
        """Free the engine (an engine process's child exits); closing again does nothing."""
        ...
