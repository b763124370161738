"""What the HTTP layer needs from the engine, as a typing.Protocol.

`wllm.engine.async_engine.AsyncEngine` satisfies it; tests drive the app with a scripted fake
(tests/fake_engine.py). A request's outputs come as `RequestDelta`s: per step only what is new, which the
handlers turn into SSE chunks as they are (a non-streamed response accumulates them: `OutputAccumulator`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

from wllm.outputs import RequestDelta
from wllm.sampling_params import SamplingParams

try:  # the engine defines its errors; the fallbacks keep the API layer importable on its own
    from wllm.engine.request import QueueFullError
except ImportError:  # pragma: no cover - only when the engine package is absent

    class QueueFullError(RuntimeError):  # type: ignore[no-redef]
        """The engine's waiting queue is full."""


try:
    from wllm.engine.async_engine import EngineDeadError
except ImportError:  # pragma: no cover

    class EngineDeadError(RuntimeError):  # type: ignore[no-redef]
        """The engine loop has failed."""


__all__ = ["EngineClient", "EngineDeadError", "QueueFullError", "TokenizerLike"]


@runtime_checkable
class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str | list[int]: ...


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the server sees it."""

    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def max_model_len(self) -> int: ...

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas (the last one has `finished` set; a consumer that falls behind gets
        what it missed merged into one); raises QueueFullError when the waiting queue is full,
        EngineDeadError when the engine has failed, ValueError for a request it cannot take."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...

    def stats(self) -> Any:
        """A mapping (or object) of engine gauges and counters, read by name for /metrics."""
        ...
