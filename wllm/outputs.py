"""What the engine gives back for each request: cumulative `RequestOutput`s (the synchronous `LLMEngine.step`,
the offline API) and the `RequestDelta`s that stream to the server (`wllm.engine.protocol`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, overload

import msgspec

T = TypeVar("T")


class ListPrefix(Sequence[T]):
    """The first `n` items of a list that only ever grows at its end, without copying them.

    A running request's outputs carry their cumulative token ids and logprobs this way: copying the
    whole lists for every stream at every step would cost O(length) per step, which grows with every
    long stream (benchmarks/RESULTS.md). Indexing, `len`, iteration and comparison work as on a
    list; a slice (`ids[sent:]`, how a stream takes its new tokens) copies only what it takes;
    `list(view)` makes a list. A finished request's final output carries real lists.
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


class BeamSearchSequence(msgspec.Struct):
    """One finished beam of `LLM.beam_search`: generated tokens (an EOS token included), their text, the raw
    cumulative logprob and the score the beams are ranked by (cumulative logprob / length ** length_penalty)."""

    text: str
    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS) | "length"


class BeamSearchOutput(msgspec.Struct):
    """The beams of one prompt, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]


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
    # A pooling request's output (wllm.pooling_params): the embedding, or [relevance score].
    pooled: list[float] | None = None


# ------------------------------------------------------------------------------------------------ deltas
# What streams from the engine to the server: per step, per request that changed, only what is new. The
# visible text of a sequence only ever grows (the engine holds back a tail that may still become a stop
# string, and cuts a matched stop string inside that held-back tail), so a text delta is a suffix to append.


class CompletionDelta(msgspec.Struct, array_like=True):
    """What one of a request's `n` sequences added in a step."""

    index: int
    text: str  # appended to the text sent before
    token_ids: list[int]
    logprobs: list[StepLogprobs] | None = None  # one per new token, when logprobs were asked for
    cumulative_logprob: float | None = None  # over all tokens so far
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class RequestDelta(msgspec.Struct, array_like=True):
    """One request's news from one engine step (or its abort). The prompt never comes back: the caller sent
    it. `prompt_logprobs` are the new prompt positions' (the whole prompt's come before the first token)."""

    request_id: str
    outputs: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[StepLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None
    pooled: list[float] | None = None  # a pooling request's output, in its last delta


class DeltaEncoder:
    """Engine side: turns each request's cumulative `RequestOutput`s into `RequestDelta`s by remembering, per
    running request, how much of each list and text its consumer has been sent (slicing a `ListPrefix`
    copies only the new items)."""

    def __init__(self) -> None:
        # request id -> [prompt logprobs sent, {choice index: [tokens sent, logprobs sent, text length sent]}]
        self._sent: dict[str, list[Any]] = {}

    def encode(self, out: RequestOutput) -> RequestDelta:
        state = self._sent.get(out.request_id)
        if state is None:
            state = self._sent[out.request_id] = [0, {}]
        prompt_lps = None
        if out.prompt_logprobs is not None and len(out.prompt_logprobs) > state[0]:
            prompt_lps = out.prompt_logprobs[state[0]:]
            state[0] = len(out.prompt_logprobs)
        choices = []
        for c in out.outputs:
            sent = state[1].get(c.index)
            if sent is None:
                sent = state[1][c.index] = [0, 0, 0]
            lps = None if c.logprobs is None else c.logprobs[sent[1]:]
            choices.append(CompletionDelta(c.index, c.text[sent[2]:], c.token_ids[sent[0]:], lps,
                                           c.cumulative_logprob, c.finish_reason, c.stop_reason))
            sent[0] = len(c.token_ids)
            sent[1] = 0 if c.logprobs is None else len(c.logprobs)
            sent[2] = len(c.text)
        if out.finished:
            del self._sent[out.request_id]
        return RequestDelta(out.request_id, choices, out.finished, out.num_cached_tokens, prompt_lps,
                            out.metrics, out.error, out.pooled)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class _ChoiceSoFar:
    __slots__ = ("text", "token_ids", "logprobs", "cumulative_logprob", "finish_reason", "stop_reason")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[StepLogprobs] | None = None
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def add(self, d: CompletionDelta) -> None:
        """Append what `d` says this choice added (the newest delta's cumulative fields win)."""
        if d.text:
            self.text.append(d.text)
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(d.logprobs)
        self.cumulative_logprob, self.finish_reason, self.stop_reason = d.cumulative_logprob, d.finish_reason, \
            d.stop_reason


class OutputAccumulator:
    """Consumer side: the cumulative `RequestOutput` of a request, from its deltas in order. For the consumers
    that need the whole (a non-streamed response, a test); a stream forwards the deltas themselves."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._choices: dict[int, _ChoiceSoFar] = {}
        self._order: list[int] = []
        self._prompt_logprobs: list[StepLogprobs | None] | None = None
        self._last: RequestDelta | None = None

    def add(self, delta: RequestDelta) -> None:
        self._last = delta
        if delta.prompt_logprobs is not None:
            if self._prompt_logprobs is None:
                self._prompt_logprobs = []
            self._prompt_logprobs.extend(delta.prompt_logprobs)
        self._order = [d.index for d in delta.outputs] or self._order
        for d in delta.outputs:
            c = self._choices.get(d.index)
            if c is None:
                c = self._choices[d.index] = _ChoiceSoFar()
            c.add(d)

    def output(self) -> RequestOutput:
        """Everything so far (choices in the newest delta's order, then any it left out)."""
        last = self._last
        order = self._order + [i for i in self._choices if i not in self._order]
        outs = []
        for i in order:
            c = self._choices[i]
            outs.append(CompletionOutput(i, "".join(c.text), list(c.token_ids), c.cumulative_logprob,
                                         None if c.logprobs is None else list(c.logprobs), c.finish_reason,
                                         c.stop_reason))
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids, outputs=outs,
            finished=last is not None and last.finished,
            num_cached_tokens=0 if last is None else last.num_cached_tokens,
            prompt_logprobs=None if self._prompt_logprobs is None else list(self._prompt_logprobs),
            metrics=None if last is None else last.metrics, error=None if last is None else last.error,
            pooled=None if last is None else last.pooled)


def merge_deltas(deltas: Sequence[RequestDelta]) -> RequestDelta:
    """One delta saying what `deltas` (one request's, in order) say together: for a consumer that fell behind,
    so that it sends one frame where it would have sent several."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    merged: dict[int, _ChoiceSoFar] = {}
    prompt_lps: list[StepLogprobs | None] | None = None
    for delta in deltas:
        if delta.prompt_logprobs is not None:
            prompt_lps = (prompt_lps or []) + delta.prompt_logprobs
        for d in delta.outputs:
            m = merged.get(d.index)
            if m is None:
                m = merged[d.index] = _ChoiceSoFar()
            m.add(d)
    order = [d.index for d in last.outputs]
    order += [i for i in merged if i not in order]
    outs = []
    for i in order:
        m = merged[i]
        outs.append(CompletionDelta(i, "".join(m.text), m.token_ids, m.logprobs, m.cumulative_logprob,
                                    m.finish_reason, m.stop_reason))
    return RequestDelta(last.request_id, outs, last.finished, last.num_cached_tokens, prompt_lps, last.metrics,
                        last.error, last.pooled)
