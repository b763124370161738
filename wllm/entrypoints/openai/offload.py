"""Heavy per-request work off the event loop, and memory given back after big requests.

Decoding a large body, rendering a chat template over long messages and tokenizing a long prompt take
seconds at the body limit; on the event loop's thread that would stall every other request (and
/health) for as long. `PrepPool` runs that work in a few worker threads: the tokenizer's Rust code
and the depth scan's numpy passes release the GIL, so the loop keeps serving meanwhile. Small
requests (nearly all of them) stay on the loop, where they cost less than the hop to a thread would.

`release_memory()` hands freed heap pages back to the OS: glibc keeps the arenas a multi-megabyte
prompt was tokenized in (hundreds of MB of small allocations) mapped after they are freed.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
logger = logging.getLogger("wllm.server")

# A body at least this large is decoded, templated and tokenized in a worker thread. Below it, all of
# that takes well under a millisecond; above it, the hop costs nothing next to the work.
OFFLOAD_BODY_BYTES = 16 * 1024
# After a request whose body was at least this large, freed heap memory is handed back to the OS.
RELEASE_BODY_BYTES = 1 << 20
RELEASE_DELAY_S = 0.2
# Characters of prompt the default --max-prompt-chars allows per token of context: real text runs 3 to 5
# characters a token, so 16 leaves room for dense prompts (whitespace, code) while bounding the
# tokenizer's time on a prompt that could never fit.
DEFAULT_CHARS_PER_TOKEN = 16


class PrepPool:
    """A small thread pool for one request's heavy preparation (decode, template, tokenize)."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self._executor: ThreadPoolExecutor | None = None
        self._release_pending = False
        self._closed = False

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:  # created on first use: most servers never see a large body
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="wllm-prep")
        return self._executor

    async def run(self, body_bytes: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`: in a worker thread for a request body of `body_bytes` or more, inline otherwise."""
        if body_bytes < OFFLOAD_BODY_BYTES:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool(), functools.partial(fn, *args))

    def request_finished(self, body_bytes: int) -> None:
        """Call when a request ends; after a large one, give its freed memory back (in a worker, once
        per burst). Call it on the event loop's thread."""
        if body_bytes < RELEASE_BODY_BYTES or self._release_pending:
            return
        self._release_pending = True
        # A moment later: by then the ASGI server and the handler's frames have dropped the request (its
        # body, its prompt, its token ids), and a burst of large requests costs one release.
        asyncio.get_running_loop().call_later(RELEASE_DELAY_S, self._schedule_release)

    def _schedule_release(self) -> None:
        self._release_pending = False
        if not self._closed:
            self._pool().submit(release_memory)

    def shutdown(self) -> None:
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


@functools.cache
def _trim() -> Callable[[], Any] | None:
    """The C call that returns free heap memory to the OS on this platform, or None."""
    if sys.platform == "win32":
        # The UCRT heap: _heapmin decommits free pages (large blocks are returned on free anyway).
        try:
            return ctypes.CDLL("ucrtbase")._heapmin  # type: ignore[no-any-return]
        except (OSError, AttributeError):
            return None
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            trim = libc.malloc_trim  # glibc only (musl has none, and returns memory by itself)
        except (OSError, AttributeError):
            return None
        trim.argtypes = [ctypes.c_size_t]
        return functools.partial(trim, 0)
    return None  # macOS's allocator returns large freed regions by itself


def release_memory() -> bool:
    """Return freed heap memory to the OS (all of glibc's arenas); False where there is no such call.

    It runs with the GIL released (a ctypes call) and takes milliseconds to tens of milliseconds after
    a huge request, so call it from a worker thread."""
    trim = _trim()
    if trim is None:
        return False
    try:
        trim()
    except OSError:  # pragma: no cover - nothing to do but keep serving
        logger.debug("releasing freed memory failed", exc_info=True)
        return False
    return True
