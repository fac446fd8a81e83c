"""Token-bucket rate limits per caller: mutating admin calls and BatchPut.

A caller is its client name when tokens are configured, otherwise its peer address (host only: a
client opens many connections). A refused call answers RESOURCE_EXHAUSTED (gRPC, with a
``retry-after`` trailer) or 429 (REST, with ``Retry-After``) and changes nothing. Both surfaces run
on the service's one event loop, so the buckets need no lock.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

import grpc

from corpus_service.protocol.status import CorpusError

MAX_KEYS = 10_000  # callers remembered; the least recently seen is forgotten (its bucket was refilling anyway)


class RateLimited(CorpusError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, what: str, retry_after_s: float) -> None:
        super().__init__(f"rate limit of {what} exceeded; retry after {retry_after_s:.2f} s")
        self.retry_after_s = retry_after_s

    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))  # HTTP wants whole seconds


class RateLimiter:
    """``burst`` calls at once, refilled at ``rate_per_s``; rate 0 = no limit."""

    def __init__(self, what: str, rate_per_s: float, burst: int,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = MAX_KEYS) -> None:
        if not rate_per_s >= 0 or not burst >= 1:
            raise ValueError(f"{what}: expected rate_per_s >= 0 and burst >= 1, got {rate_per_s}, {burst}")
        self.what, self.rate, self.burst = what, float(rate_per_s), float(burst)
        self._clock, self._max_keys = clock, max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, stamp)

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def acquire(self, key: str) -> None:
        """Takes one call from ``key``'s bucket, or raises RateLimited (taking nothing)."""
        if not self.rate:
            return
        now = self._clock()
        tokens, stamp = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - stamp) * self.rate)
        if tokens < 1.0:
            self._remember(key, tokens, now)
            raise RateLimited(self.what, (1.0 - tokens) / self.rate)
        self._remember(key, tokens - 1.0, now)

    def _remember(self, key: str, tokens: float, now: float) -> None:
        self._buckets[key] = (tokens, now)
        if len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)


def peer_host(peer: str) -> str:
    """``ipv4:10.0.0.1:5555`` / ``ipv6:[::1]:5555`` -> the address without its port."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer


__all__ = ["RateLimited", "RateLimiter", "peer_host"]
