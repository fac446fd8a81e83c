"""The server-wide byte budget of live requests (``max_live_request_bytes``).

Every live request, whether a Session stream's or a BatchGet client's, is charged before it is
created or grows, and released when it ends (finish, erase, idle expiry, a closed stream), so no
mix of callers takes the live requests past the budget: per-session and per-request caps alone let
many sessions, or many client ids, each stay under their cap and still exhaust the server.

A request is charged ``REQUEST_CHARGE_BYTES`` plus its tokens (prompt + output, or the window a
BatchGet client keeps) times its namespace's ``token_charge_bytes``. Both are upper bounds of what
the server holds for it (measured on the real server: docs/reliability.md, "Memory bounds under
hostile callers"), so the live requests' memory stays below the budget.
"""

from __future__ import annotations

import math
import threading

import grpc

from corpus_service.engine.config import CorpusConfig, worst_case_bytes_per_token
from corpus_service.protocol.status import CorpusError

# The fixed part of a live request: its index's empty hash tables, the engine's state and map entry,
# and the server's records (session set / BatchGet registry). Measured: 4.3 KiB in the engine's own
# accounting, 5.1-5.2 KiB of server RSS per request (bench/fuzz_load.py); 8 KiB leaves allocator slack.
REQUEST_CHARGE_BYTES = 8 << 10


# Per token beyond the index itself: the buffers of the commit messages that brought it and the
# allocator's fragmentation. Measured with the real server: 41-45 B of RSS per committed token against
# the index's worst case of 37 B (default own_orders; the engine's own accounting says 22-26.5 B).
TOKEN_SLACK_BYTES = 12


def token_charge_bytes(config: CorpusConfig) -> int:
    """Bytes charged per token a request holds: the worst case of its own index for ``own_orders``
    (the learned corpus' bound) plus TOKEN_SLACK_BYTES; 49 B for the default 3 orders."""
    return math.ceil(worst_case_bytes_per_token(len(config.own_orders))) + TOKEN_SLACK_BYTES


class LiveBudget:
    """Bytes charged by live requests against ``limit``; thread-safe (steps apply on the pool)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.refused = 0  # reservations refused (also the metric ngram_corpus_limit_refused)
        self.freed = 0  # bytes released since the last memory reclaim (see reclaim.py)
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, what: str, credit: int = 0) -> None:
        """Charges ``nbytes`` or raises RESOURCE_EXHAUSTED (nothing charged). ``credit``: bytes the same
        call releases once applied (a step's finishes), so a caller at the limit can still end
        requests while it starts others. ``what`` names the call."""
        if nbytes <= 0:
            return
        with self._lock:
            if self.used + nbytes - credit > self.limit:
                self.refused += 1
                used = self.used
            else:
                self.used += nbytes
                self.peak = max(self.peak, self.used)
                return
        raise CorpusError(f"{what}: needs {nbytes} more bytes of live-request memory, but live requests already "
                          f"hold {used} of max_live_request_bytes = {self.limit} on this server; finish requests "
                          f"or retry later", grpc.StatusCode.RESOURCE_EXHAUSTED)

    def charge_applied(self, nbytes: int) -> None:
        """Charges what the engine already applied (no refusal: the memory is held either way)."""
        with self._lock:
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def release(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            # Never below zero: a request the engine expired on its own is released once, by its owner.
            nbytes = min(nbytes, self.used)
            self.used -= nbytes
            self.freed += nbytes

    def take_freed(self) -> int:
        """Bytes released since the last call (what a memory reclaim may hand back)."""
        with self._lock:
            freed, self.freed = self.freed, 0
            return freed

    def stats(self) -> dict[str, int]:
        return {"limit_bytes": self.limit, "used_bytes": self.used, "peak_bytes": self.peak, "refused": self.refused}
