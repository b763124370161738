"""Incremental detokenization: token ids in, new text out, one step at a time.

Decoding each new token on its own is wrong: SentencePiece pieces drop their leading space at
the start of a decode, byte-fallback and byte-level tokens can carry a fraction of a UTF-8
character, and WordPiece's "##" joins to the previous piece. So each step decodes a short
window that starts a few tokens back (the "prefix"), and emits what the new tokens add to the
prefix's text. Text that ends in U+FFFD (an incomplete character) is held back until the
character completes or the stream ends (`flush`).

SentencePiece byte-fallback tokens need one more rule: the decoder turns a run of <0xNN>
tokens into text only if the whole run is valid UTF-8, and otherwise replaces every byte of the
run (even an ASCII one) with U+FFFD. A later byte can thus change the text of earlier ones, so
text is held back while the newest token (skipped special tokens aside) is a byte token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from wllm.model.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as context for the first generated token (enough for any multi-byte char).
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    With no prompt, the concatenation of all deltas plus `flush()` equals
    `tokenizer.decode(generated_ids, skip_special_tokens)`. With `prompt_ids`, the last few
    prompt tokens are context, so a first SentencePiece token "▁Sure" comes out as " Sure",
    as it would appear after the prompt text.
    Each step decodes only the tokens since the last emitted text plus the new ones.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._num_context = len(self._ids)
        # ids[prefix:read] were decoded as the previous window; ids[read:] are not emitted yet.
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        self._text_parts: list[str] = []
        self._byte_ids = tokenizer.byte_fallback_ids

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self._ids[start:end]
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def token_ids(self) -> list[int]:
        """The generated ids seen so far (prompt context excluded)."""
        return self._ids[self._num_context:]

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._text_parts) > 1:
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    def add(self, token_id: int) -> str:
        """Feed one generated id; returns the text it completes (possibly "")."""
        return self.add_many((token_id,))

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Feed several generated ids at once (one decode); returns the new text."""
        before = len(self._ids)
        self._ids.extend(token_ids)
        if len(self._ids) == before or self._ends_in_byte_run():
            return ""
        full = self._decode(self._prefix)
        if len(full) <= len(self._prefix_text) or full.endswith(_REPLACEMENT):
            # Nothing new yet, or the text ends mid-character: wait for more tokens.
            return ""
        delta = full[len(self._prefix_text):]
        # The tokens just emitted become the next prefix: short, and ending on a whole character.
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        self._text_parts.append(delta)
        return delta

    def _ends_in_byte_run(self) -> bool:
        if not self._byte_ids:
            return False
        skipped = self._tokenizer.all_special_ids if self.skip_special_tokens else ()
        for i in reversed(self._ids):
            if i not in skipped:
                return i in self._byte_ids
        return False

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character comes out as U+FFFD). Call at the end."""
        if self._read == len(self._ids):
            return ""
        full = self._decode(self._prefix)
        delta = full[len(self._prefix_text):] if len(full) > len(self._prefix_text) else ""
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        if delta:
            self._text_parts.append(delta)
        return delta
