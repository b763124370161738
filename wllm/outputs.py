"""What the engine streams back for each request (cumulative, so consumers derive deltas)."""

from __future__ import annotations

import msgspec


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
    """One of a request's `n` sequences; `text`, `token_ids` and `logprobs` are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[StepLogprobs] | None = None
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
    prompt_logprobs: list[StepLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None
