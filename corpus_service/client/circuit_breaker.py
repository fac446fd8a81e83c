"""A circuit breaker: after ``failure_threshold`` consecutive transport failures the corpus is
treated as down for ``cooldown_s``; calls then fail at once with ``CorpusUnavailable`` (a dict
lookup and a clock read, not a connection attempt or a timeout per decode step). After the
cool-down one trial call goes through (half-open): success closes the breaker, failure re-opens it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from corpus_service.protocol.status import CorpusUnavailable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(failure_threshold, bool) or not isinstance(failure_threshold, int) or failure_threshold < 1:
            raise ValueError(f"failure_threshold: expected an int >= 1, got {failure_threshold!r}")
        if not 0 <= cooldown_s < float("inf"):
            raise ValueError(f"cooldown_s: expected a finite number >= 0, got {cooldown_s!r}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = float(cooldown_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at = 0.0
        self._state = CLOSED
        self._trial_in_flight = False
        self.last_error = ""

    @property
    def state(self) -> str:
        with self._lock:
            if self._state == OPEN and self._clock() - self._opened_at >= self.cooldown_s:
                return HALF_OPEN
            return self._state

    def check(self) -> None:
        """Raises CorpusUnavailable while open (or while another half-open trial is running)."""
        with self._lock:
            if self._state == CLOSED:
                return
            now = self._clock()
            if self._state == OPEN and now - self._opened_at < self.cooldown_s:
                left = self.cooldown_s - (now - self._opened_at)
                raise CorpusUnavailable(f"corpus unavailable (circuit open for another {left:.2f}s after "
                                        f"{self._failures} failures; last: {self.last_error})")
            if self._trial_in_flight:
                raise CorpusUnavailable(f"corpus unavailable (circuit half-open, trial call in flight; last: {self.last_error})")
            self._state, self._trial_in_flight = HALF_OPEN, True

    def record_success(self) -> None:
        with self._lock:
            self._failures, self._state, self._trial_in_flight = 0, CLOSED, False

    def record_failure(self, error: str = "") -> None:
        with self._lock:
            self._failures += 1
            self.last_error = error[:300]
            if self._state == HALF_OPEN or self._failures >= self.failure_threshold:
                self._state, self._opened_at = OPEN, self._clock()
            self._trial_in_flight = False
