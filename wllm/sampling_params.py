"""Per-request generation parameters (the engine's contract with the API layer)."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

# Fields beam search does not combine with, and their defaults (each is refused when set).
_NOT_WITH_BEAMS = (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0),
                   ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("logit_bias", None), ("min_tokens", 0),
                   ("stop", []), ("stop_token_ids", []), ("logprobs", None), ("prompt_logprobs", None),
                   ("grammar", None))


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to sample one request. Defaults follow the OpenAI API and vLLM.

    `temperature == 0` means greedy. `top_k <= 0` and `top_p == 1` disable those filters.
    `logprobs = N` returns the sampled token's logprob plus the top N alternatives per step;
    `prompt_logprobs = N` does the same for prompt positions. `seed` makes the request's random
    stream depend only on (seed, position), never on the rest of the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # An llguidance top-level grammar (the serialised form `llguidance.LLMatcher` accepts); built from request
    # fields by wllm.structured. The engine only ever sees this string.
    grammar: str | None = None
    # Beam search (wllm.engine.beam_search) when > 0: this many beams, the best `n` of them returned. Deterministic,
    # so the sampling fields above must keep their defaults, with temperature 0.
    beam_width: int = 0
    length_penalty: float = 1.0  # a finished beam's score: cumulative logprob / length ** length_penalty
    early_stopping: bool | Literal["never"] = False  # as transformers' `early_stopping`

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for out-of-range values."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        if self.beam_width < 0:
            raise ValueError(f"beam_width must be at least 1 for beam search (0: none), got {self.beam_width}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")
        if not self.beam_width:
            if self.length_penalty != 1.0 or self.early_stopping is not False:
                name = "length_penalty" if self.length_penalty != 1.0 else "early_stopping"
                raise ValueError(f"{name} applies to beam search only (use_beam_search / beam_width)")
            return
        if self.n > self.beam_width:
            raise ValueError(f"n ({self.n}) must not exceed the beam width ({self.beam_width})")
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 with beam search (it is deterministic), got {self.temperature}")
        for name, default in _NOT_WITH_BEAMS:
            if getattr(self, name) != default:
                raise ValueError(f"{name} is not supported with beam search")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether repetition, frequency or presence penalties apply (they need the token counts)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """Offline beam search (`LLM.beam_search`): `beam_width` beams, all returned, best first. The ranking and
    stopping rules are HF transformers' `num_beams` search (see wllm.engine.beam_search)."""

    beam_width: int
    max_tokens: int | None = 16
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def to_sampling_params(self) -> SamplingParams:
        """The engine's parameters for this search; raises ValueError for out-of-range values."""
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        params = SamplingParams(n=self.beam_width, beam_width=self.beam_width, temperature=0.0,
                                max_tokens=self.max_tokens, length_penalty=self.length_penalty,
                                early_stopping=self.early_stopping, ignore_eos=self.ignore_eos,
                                skip_special_tokens=self.skip_special_tokens)
        params.validate()
        return params
