"""What the HTTP layer needs from the engine, as a typing.Protocol.

`wllm.engine.async_engine.AsyncEngine` satisfies it; tests drive the app with a scripted fake.
Keeping the seam this narrow lets the engine later move into its own process unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from wllm.outputs import RequestOutput
from wllm.sampling_params import SamplingParams

try:  # the engine defines the error; the fallback keeps the API layer importable on its own
    from wllm.engine.request import QueueFullError
except ImportError:  # pragma: no cover - only when the engine package is absent

    class QueueFullError(RuntimeError):  # type: ignore[no-redef]
        """The engine's waiting queue is full."""


__all__ = ["EngineClient", "QueueFullError", "TokenizerLike", "stat"]


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

    tokenizer: TokenizerLike
    max_model_len: int

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs; raises QueueFullError when the waiting queue is full."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...

    def stats(self) -> Any:
        """A mapping or object with engine gauges/counters; see `stat`."""
        ...


def stat(stats: Any, *names: str, default: float = 0.0) -> float:
    """Read the first present field among `names` from an engine stats mapping or object.

    The engine's stats type is its own; reading by name keeps the API layer from depending on it.
    """
    for name in names:
        value = stats.get(name) if isinstance(stats, Mapping) else getattr(stats, name, None)
        if value is not None:
            return float(value)
    return default
