"""Detokenize a sequence step by step and apply stop strings without leaking partial matches.

Text comes from the tokenizer package's `IncrementalDetokenizer` (a short sliding decode window,
holding back incomplete UTF-8 characters). A stop string may span several tokens, so the visible
text holds back any tail that is still a prefix of some stop string; once a stop string matches,
the text is cut before it (or after it with `include_stop_str_in_output`) and the sequence
finishes with that stop reason.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from wllm.model.tokenizer.detokenizer import IncrementalDetokenizer
from wllm.sampling_params import SamplingParams


class TextState:
    """The decoded text of one sequence and its stop-string state."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams,
                 defer: bool = False) -> None:
        """`tokenizer` needs `decode(ids, skip_special_tokens)`. `defer` (honoured only without stop
        strings): nobody reads the text before the sequence ends, so tokens are only collected and
        decoded in one call at `flush()` instead of one decode per token."""
        self.params = params
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.text = ""  # everything decoded so far (cut at the stop string once one matches)
        self.stopped_by: str | None = None
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        # An int64 array, not a list: it holds a copy of every output id of an offline batch's requests
        # until they end, and the cyclic GC walks every item of a live list in each full collection;
        # an array is not GC-tracked at all.
        self._deferred: array[int] | None = array("q") if defer and not params.stop else None

    def append(self, token_id: int, num_output_tokens: int, decode_token: bool = True) -> str | None:
        """Add one generated token; returns the stop string if one now matches.

        `decode_token` False appends the token without text (EOS / stop token ids, which are not
        part of the output text).
        """
        if not decode_token:
            return None
        if self._deferred is not None:
            self._deferred.append(token_id)
            return None
        old_len = len(self.text)
        self.text += self._detok.add(token_id)
        if not self.params.stop or num_output_tokens < self.params.min_tokens:
            return None
        # Only a match that ends inside the new text can be new.
        start = max(0, old_len - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            idx = self.text.find(stop, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if self.params.include_stop_str_in_output else self.text[:idx]
        self.stopped_by = stop
        return stop

    def flush(self) -> None:
        """Emit what an incomplete character was holding back (at the end of a sequence)."""
        if self._deferred:
            self.text += self._detok.add_many(self._deferred)
            self._deferred = array("q")
        if self.stopped_by is None:
            self.text += self._detok.flush()

    def visible_text(self, finished: bool) -> str:
        """The text a client may see now: the tail that could still grow into a stop string is
        held back until the sequence finishes or the tail stops matching."""
        if finished and self._deferred:
            self.flush()
        if finished or not self.params.stop or self.stopped_by is not None:
            return self.text
        text = self.text
        hold = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return text[: len(text) - hold] if hold else text


class StopChecker:
    """The one place that decides whether a sequence stops after its newest token, and why.

    In order: EOS ("stop", unless `ignore_eos` or fewer than `min_tokens` outputs), a stop token id
    ("stop", the id), a grammar that is complete and allows no more tokens ("stop"), the length limit
    ("length": `max_tokens` outputs or `max_model_len` tokens). Then,
    with a tokenizer, the token's text is decoded and a stop string that now matches wins over any of
    those ("stop", the string: the text is cut at it). EOS and stop token ids add no text.
    """

    def __init__(self, eos_token_ids: Sequence[int], max_model_len: int, tokenizer: Any | None = None) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def ends_by_length(self, params: SamplingParams, num_outputs: int, num_tokens: int) -> bool:
        """Whether a sequence of `num_outputs` generated and `num_tokens` tokens in all is at its length
        limit (also asked, ahead of time, about a token still in flight)."""
        return (params.max_tokens is not None and num_outputs >= params.max_tokens) or \
            num_tokens >= self.max_model_len

    def check(self, seq: Any) -> tuple[str, str | int | None] | None:
        """(finish reason, stop reason) once `seq` (a `wllm.engine.request.Sequence`) has appended its
        newest token, or None while it goes on. Keeps the sequence's text state (`seq.text_state`)."""
        p = seq.params
        outputs = seq.output_token_ids
        token = outputs[-1]
        n_out = len(outputs)
        found: tuple[str, str | int | None] | None = None
        text_token = False
        if not p.ignore_eos and token in self.eos_token_ids and n_out >= p.min_tokens:
            found = ("stop", None)
        elif token in p.stop_token_ids:
            found = ("stop", token)
        elif seq.matcher is not None and seq.matcher.is_stopped():
            found = ("stop", None)  # the grammar is complete and allows nothing more; the token is text
            text_token = token not in self.eos_token_ids
        elif self.ends_by_length(p, n_out, seq.num_tokens):
            found = ("length", None)
        if self.tokenizer is None:
            return found
        state = seq.text_state
        if state is None:
            state = seq.text_state = TextState(self.tokenizer, seq.prompt_token_ids, p, defer=seq.group.final_only)
        hit = state.append(token, n_out, decode_token=text_token or found is None or found[0] != "stop")
        if hit is not None:
            return ("stop", hit)
        if found is not None:
            state.flush()
        return found
