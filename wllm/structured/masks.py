"""The token masks of one step's constrained rows, filled on the host while the step's forward runs.

`MaskFiller.start(matchers)` hands the step's matchers to llguidance's batched fill (`LLExecutor`, which
drops the GIL and spreads the rows over its own threads) from a worker thread, and returns at once; the
runner launches the forward and calls `StepMasks.wait()` only when it is about to sample. A mask is one bit
per token id (int32 words, bit j of word w is token 32 w + j), as `wllm.kernels.apply_token_bitmask` reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class StepMasks:
    """The masks of one step, [rows, words] int32 on the host (pinned for a CUDA runner), once `wait()`
    returns."""

    __slots__ = ("masks", "_future")

    def __init__(self, masks: torch.Tensor, future: Future[None] | None) -> None:
        self.masks = masks
        self._future = future

    def wait(self) -> torch.Tensor:
        if self._future is not None:
            self._future.result()
            self._future = None
        return self.masks


class MaskFiller:
    """Fills step masks for a vocabulary of `vocab_size` ids (llguidance tokenizer's `vocab_size`)."""

    def __init__(self, vocab_size: int, pin_memory: bool = False) -> None:
        self.words = mask_words(vocab_size)
        self.pin_memory = pin_memory
        self._executor = llguidance.LLExecutor()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wllm-masks")

    def start(self, matchers: Sequence[llguidance.LLMatcher]) -> StepMasks:
        # A new buffer per step: with a CUDA runner the previous step's may still be in an upload (the
        # caching host allocator hands a pinned block out again only once its copies are done).
        masks = torch.empty((len(matchers), self.words), dtype=torch.int32, pin_memory=self.pin_memory)
        if not matchers:
            return StepMasks(masks, None)
        return StepMasks(masks, self._pool.submit(self._fill, list(matchers), masks))

    def fill(self, matchers: Sequence[llguidance.LLMatcher]) -> torch.Tensor:
        """The masks now, in the calling thread."""
        masks = torch.empty((len(matchers), self.words), dtype=torch.int32, pin_memory=self.pin_memory)
        if matchers:
            self._fill(list(matchers), masks)
        return masks

    def _fill(self, matchers: list[llguidance.LLMatcher], masks: torch.Tensor) -> None:
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], masks.data_ptr(), self.words * 4, len(matchers)
        )

    def close(self) -> None:
        self._pool.shutdown(wait=True)
