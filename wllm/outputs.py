"""What the engine streams back for each request (cumulative, so consumers derive deltas)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, overload

import msgspec

T = TypeVar("T")


class ListPrefix(Sequence[T]):
    """The first `n` items of a list that only ever grows at its end, without copying them.

    A running request's outputs carry their cumulative token ids and logprobs this way: copying the
    whole lists for every stream at every step would cost O(length) per step, a visible share of a
    decode step with hundreds of long streams and logprobs. Indexing, `len`, iteration and
    comparison work as on a list; a slice (`ids[sent:]`, how a stream takes its new tokens) copies
    only what it takes; `list(view)` makes a list. A finished request's final output carries real
    lists.
    """

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[T], n: int | None = None) -> None:
        self._items = items
        self._n = len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._n)
            if step == 1:
                return self._items[start:stop]
            return [self._items[i] for i in range(start, stop, step)]
        i = index.__index__()
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("ListPrefix index out of range")
        return self._items[i]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._items, self._n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, ListPrefix)):  # as a list: never equal to a tuple
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable underneath, like a list

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (list(self),)  # pickles (and copies) as the list it shows


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class StepLogprobs(msgspec.Struct):
    """Logprob of the chosen token at one position and the top-N alternatives (best first)."""

    token_id: int
    logprob: float
    rank: int
    top: list[TokenLogprob]


class CompletionOutput(msgspec.Struct):
    """One of a request's `n` sequences; `text`, `token_ids` and `logprobs` are cumulative. While the
    request runs, `token_ids` and `logprobs` are read-only `ListPrefix` views (no per-step copy); the
    final output carries lists."""

    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None = None
    logprobs: Sequence[StepLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestMetrics(msgspec.Struct):
    """Wall-clock times (time.monotonic seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


class RequestOutput(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: Sequence[StepLogprobs | None] | None = None  # a ListPrefix while running, as above
    metrics: RequestMetrics | None = None
    error: str | None = None
