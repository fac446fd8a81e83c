"""Outages of what the server depends on (its data directory, the commit log's broker), each logged
once when it starts and once when it ends, and counted.

A retry loop that logs every failed attempt floods the log during a long outage (one line per
snapshot interval, per publish, per reconnect) and hides everything else; here the first failure of
an episode is a WARNING with its reason, later failures of the same episode are DEBUG lines, and
the recovery is one INFO line with the outage's duration. ``ngram_corpus_dependency_outages``
counts episodes and ``ngram_corpus_dependency_down`` says which dependency is down now.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("corpus_service")


class Outages:
    def __init__(self, counter, gauge) -> None:
        self._counter = counter  # Counter with label "dependency"
        self._gauge = gauge  # Gauge with label "dependency"
        self._down: dict[str, tuple[float, str]] = {}  # dependency -> (since, monotonic; reason)
        self._lock = threading.Lock()

    def down(self, dependency: str, reason: str, exc_info: bool = False) -> bool:
        """A call to ``dependency`` failed; True when this starts an outage (logged and counted;
        ``exc_info``: with the traceback of the exception being handled)."""
        with self._lock:
            started = dependency not in self._down
            if started:
                self._down[dependency] = (time.monotonic(), reason)
        if not started:
            log.debug("%s still unavailable: %s", dependency, reason)
            return False
        self._counter.labels(dependency).inc()
        self._gauge.labels(dependency).set(1)
        log.warning("%s unavailable: %s (logged once; its recovery is logged too)", dependency, reason,
                    exc_info=exc_info)
        return True

    def up(self, dependency: str) -> None:
        """A call to ``dependency`` worked; ends its outage if one was running."""
        with self._lock:
            episode = self._down.pop(dependency, None)
        if episode is None:
            return
        self._gauge.labels(dependency).set(0)
        log.info("%s available again after %.1f s (down since: %s)", dependency, time.monotonic() - episode[0],
                 episode[1])

    def status(self) -> dict[str, dict[str, float | str]]:
        """Dependencies down now: name -> {"down_s", "reason"}."""
        now = time.monotonic()
        with self._lock:
            return {d: {"down_s": round(now - t, 1), "reason": r} for d, (t, r) in self._down.items()}
