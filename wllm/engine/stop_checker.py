"""Detokenize a sequence step by step and apply stop strings without leaking partial matches.

Text is decoded incrementally: the new text of a step is `decode(window + new) - decode(window)`
over a short sliding window of earlier tokens (so SentencePiece's leading-space rules and
multi-byte characters come out right); while a character is still incomplete (decode ends in
U+FFFD) nothing is emitted.

A stop string may span several tokens. The visible text therefore holds back any tail that is
still a prefix of some stop string; once a stop string matches, the text is cut before it (or
after it with `include_stop_str_in_output`) and the sequence finishes with that stop reason.
"""

from __future__ import annotations

from typing import Protocol

from wllm.sampling_params import SamplingParams

_PROMPT_CONTEXT = 5  # prompt tokens kept as decode context for the first output tokens


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class TextState:
    """The decoded text of one sequence and its stop-string state."""

    def __init__(self, decoder: Decoder, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.decoder = decoder
        self.params = params
        self.skip_special = params.skip_special_tokens
        context = prompt_token_ids[-_PROMPT_CONTEXT:]
        self._tokens: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""  # everything decoded so far (cut at the stop string once one matches)
        self.stopped_by: str | None = None
        self._max_stop_len = max((len(s) for s in params.stop), default=0)

    def _decode_delta(self, token_id: int) -> str:
        self._tokens.append(token_id)
        prefix = self.decoder.decode(self._tokens[self._prefix_offset:self._read_offset], self.skip_special)
        full = self.decoder.decode(self._tokens[self._prefix_offset:], self.skip_special)
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return full[len(prefix):]

    def append(self, token_id: int, num_output_tokens: int, decode_token: bool = True) -> str | None:
        """Add one generated token; returns the stop string if one now matches.

        `decode_token` False appends the token without text (EOS / stop token ids, which are not
        part of the output text).
        """
        if not decode_token:
            return None
        old_len = len(self.text)
        self.text += self._decode_delta(token_id)
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
        """Decode whatever an incomplete character was holding back (at the end of a sequence)."""
        if self._read_offset < len(self._tokens) and self.stopped_by is None:
            prefix = self.decoder.decode(self._tokens[self._prefix_offset:self._read_offset], self.skip_special)
            full = self.decoder.decode(self._tokens[self._prefix_offset:], self.skip_special)
            if len(full) > len(prefix):
                self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset = len(self._tokens)

    def visible_text(self, finished: bool) -> str:
        """The text a client may see now: the tail that could still grow into a stop string is
        held back until the sequence finishes or the tail stops matching."""
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
