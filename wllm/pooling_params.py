"""Per-request parameters of a pooling request (embed, rerank, score): the prompt is run once, nothing is
sampled, and the output is the pooled hidden state (or the relevance score the model's head gives)."""

from __future__ import annotations

import msgspec


class PoolingParams(msgspec.Struct, kw_only=True):
    """How to pool one request.

    `dimensions`: keep the first N dimensions of the embedding before normalising (Matryoshka models
    only; the server checks the model allows it). `token_type_start`: for a cross-encoder pair, the
    index of the first token of the second text (BERT token type 1 from there on); -1 for a single text.
    """

    dimensions: int | None = None
    token_type_start: int = -1

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for out-of-range values."""
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
        if self.token_type_start < -1:
            raise ValueError(f"token_type_start must be -1 or an index, got {self.token_type_start}")
