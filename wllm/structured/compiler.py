"""Compiling llguidance grammars off the engine loop, with a deadline, a size limit and an LRU cache.

A compiled grammar is a pristine `llguidance.LLMatcher`: each sequence gets a `deep_copy` of it (cheap: the
copies share the compiled grammar), so a schema used by many requests is compiled once. Compilation runs in
a small thread pool (llguidance drops the GIL while it builds a grammar), so neither the HTTP event loop
nor the engine's step loop waits for it. A compile that fails, or that takes longer than the deadline, is
cached as that failure: the same grammar always gets the same answer.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import llguidance

from wllm.structured.grammars import GrammarError

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_GRAMMAR_BYTES = 1 << 20
DEFAULT_CACHE_SIZE = 256


class CompiledGrammar:
    """One grammar, compiled for one tokenizer; `new_matcher()` gives a sequence its own matcher."""

    __slots__ = ("grammar", "seconds", "_matcher")

    def __init__(self, grammar: str, matcher: llguidance.LLMatcher, seconds: float) -> None:
        self.grammar = grammar
        self.seconds = seconds
        self._matcher = matcher

    def new_matcher(self) -> llguidance.LLMatcher:
        return self._matcher.deep_copy()


def ll_tokenizer(tokenizer: Any, vocab_size: int | None, eos_token_ids: Iterable[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a wLLM tokenizer (its `tokenizers` JSON; GGUF vocabularies are rebuilt as one).
    `vocab_size` is the model's logits width, which may exceed the tokenizer's (padding ids never match)."""
    backend = getattr(tokenizer, "backend", None)
    to_str = getattr(backend, "to_str", None)
    if to_str is None:
        raise GrammarError("this model's tokenizer is not a `tokenizers` tokenizer; structured output needs one")
    n_vocab = max(vocab_size or 0, int(getattr(tokenizer, "vocab_size", 0) or 0)) or None
    eos = sorted(set(eos_token_ids)) or None
    return llguidance.LLTokenizer(to_str(), n_vocab=n_vocab, eos_token=eos)


class GrammarCompiler:
    """Compiles grammar strings for one tokenizer; thread-safe.

    `submit` returns a future (already done on a cache hit); `compile` blocks; `compile_async` awaits with
    the deadline. Failures raise `GrammarError` with llguidance's reason.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        eos_token_ids: Iterable[int] = (),
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
        cache_size: int = DEFAULT_CACHE_SIZE,
        workers: int = 2,
    ) -> None:
        self._tokenizer_source = (tokenizer, vocab_size, list(eos_token_ids))
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self.timeout_s = timeout_s
        self.max_grammar_bytes = max_grammar_bytes
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="wllm-grammar")
        self.num_compiled = 0  # compiles run (cache misses), for tests and stats

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (a vocabulary's token trie takes a fraction of a second)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = ll_tokenizer(*self._tokenizer_source)
            return self._ll_tokenizer

    def submit(self, grammar: str) -> Future[CompiledGrammar]:
        """The compiled grammar as a future: from the cache, or compiling in the pool now."""
        if not isinstance(grammar, str) or not grammar:
            raise GrammarError("the grammar must be a non-empty string")
        with self._lock:
            found = self._cache.get(grammar)
            if found is not None:
                self._cache.move_to_end(grammar)
                return found
            future: Future[CompiledGrammar] = Future()
            self._cache[grammar] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        size = len(grammar.encode())
        if size > self.max_grammar_bytes:
            message = f"the grammar is {size} bytes, over this server's limit of {self.max_grammar_bytes}"
            future.set_exception(GrammarError(message))
            return future
        self._pool.submit(self._run, grammar, future)
        return future

    def _run(self, grammar: str, future: Future[CompiledGrammar]) -> None:
        try:
            future.set_result(self._compile_now(grammar))
        except BaseException as exc:  # every failure is the grammar's answer, cached with it
            future.set_exception(exc if isinstance(exc, GrammarError) else GrammarError(f"{type(exc).__name__}: {exc}"))

    def _compile_now(self, grammar: str) -> CompiledGrammar:
        tokenizer = self.ll_tokenizer
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        seconds = time.perf_counter() - start
        self.num_compiled += 1
        if matcher.is_error():
            raise GrammarError(matcher.get_error().strip())
        if seconds > self.timeout_s:
            raise GrammarError(
                f"the grammar took {seconds:.1f} s to compile, over this server's limit of "
                f"{self.timeout_s:g} s; simplify it"
            )
        return CompiledGrammar(grammar, matcher, seconds)

    def compile(self, grammar: str) -> CompiledGrammar:
        """Compile (or find) `grammar`, waiting up to the deadline; raises GrammarError."""
        try:
            return self.submit(grammar).result(timeout=self.timeout_s)
        except FutureTimeout:
            raise self._timeout_error() from None

    async def compile_async(self, grammar: str) -> CompiledGrammar:
        """`compile` for an event loop: the loop goes on serving while the pool compiles."""
        future = self.submit(grammar)
        if future.done():
            return future.result()
        try:
            # shield: a timeout must not cancel the shared (cached) future, which finishes with the compile.
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
            raise self._timeout_error() from None

    def _timeout_error(self) -> GrammarError:
        return GrammarError(
            f"the grammar did not compile within this server's limit of {self.timeout_s:g} s; simplify it"
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
