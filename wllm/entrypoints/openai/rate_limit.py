"""Token-bucket rate limits per client (API key id, or IP address when auth is off).

Two buckets per client: requests per minute and tokens per minute. The request bucket is charged
one unit before a request runs. Token counts are only known afterwards, so a request is admitted
while the token bucket is not negative and its actual prompt + completion tokens are charged when it
ends; the bucket may go negative and then refuses requests until it refills. Both refill
continuously at (limit / 60) per second up to the limit, so bursts up to a minute's worth pass.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable


class TokenBucket:
    """A bucket of `capacity` units refilling at `rate` units per second."""

    __slots__ = ("capacity", "rate", "level", "stamp")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self.level = capacity
        self.stamp = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_time(self, amount: float) -> float:
        """Seconds until `amount` units are available (0 when they are now)."""
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.rate


class RateLimited(Exception):
    """A client is over one of its limits; `retry_after` is in whole seconds (at least 1)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


class RateLimiter:
    """Per-client request and token buckets, thread-safe, bounded in memory (LRU of clients)."""

    def __init__(
        self,
        requests_per_minute: float | None = None,
        tokens_per_minute: float | None = None,
        *,
        max_clients: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (("requests_per_minute", requests_per_minute), ("tokens_per_minute", tokens_per_minute)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.rpm = requests_per_minute
        self.tpm = tokens_per_minute
        self._max_clients = max_clients
        self._clock = clock
        self._lock = threading.Lock()
        self._clients: OrderedDict[str, tuple[TokenBucket | None, TokenBucket | None]] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    def _buckets(self, client: str, now: float) -> tuple[TokenBucket | None, TokenBucket | None]:
        buckets = self._clients.get(client)
        if buckets is None:
            buckets = (
                TokenBucket(self.rpm, self.rpm / 60.0, now) if self.rpm else None,
                TokenBucket(self.tpm, self.tpm / 60.0, now) if self.tpm else None,
            )
            self._clients[client] = buckets
            if len(self._clients) > self._max_clients:
                # The least recently seen client would have a full bucket by now anyway, or soon.
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client)
        for bucket in buckets:
            if bucket is not None:
                bucket.refill(now)
        return buckets

    def acquire(self, client: str) -> None:
        """Admit one request for `client` or raise RateLimited with the seconds to wait."""
        if not self.enabled:
            return
        with self._lock:
            now = self._clock()
            requests, tokens = self._buckets(client, now)
            if requests is not None and requests.level < 1:
                raise RateLimited(f"Rate limit reached: {self.rpm:g} requests per minute", requests.wait_time(1))
            if tokens is not None and tokens.level < 0:
                raise RateLimited(f"Rate limit reached: {self.tpm:g} tokens per minute", tokens.wait_time(0))
            if requests is not None:
                requests.level -= 1

    def charge_tokens(self, client: str, n_tokens: int) -> None:
        """Charge a finished request's prompt + completion tokens to `client`."""
        if self.tpm is None or n_tokens <= 0:
            return
        with self._lock:
            _, tokens = self._buckets(client, self._clock())
            if tokens is not None:
                tokens.level -= n_tokens
