"""The servicer's background task: expires idle BatchGet state and hands freed memory back.

Started when a Session stream or a BatchGet call arrives (``ensure_running``), it runs on the event loop
every ``min(1 s, batch_get_idle_s / 4)``, so idle state is reclaimed without any further call.
"""

from __future__ import annotations

import asyncio
import logging

from corpus_service.server.reclaim import TRIM_AFTER_BYTES
from corpus_service.server.state import ServiceState

log = logging.getLogger("corpus_service")


class Housekeeping:
    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.interval_s = min(1.0, state.config.batch_get_idle_s / 4)
        self._task: asyncio.Task | None = None
        self._freed = 0  # budget bytes released since the last memory trim
        self._failing = False  # one log line per episode of failing sweeps

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="corpus-housekeeping")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.state.draining:  # shutting down: the engines' thread pool is about to close
                return
            try:
                await self.sweep()
                if self._failing:
                    log.info("housekeeping works again")
                self._failing = False
            except Exception:  # noqa: BLE001 - a failed sweep is retried at the next tick
                if not self._failing:
                    log.exception("housekeeping sweep failed (idle BatchGet state is kept until it works)")
                self._failing = True

    async def sweep(self) -> None:
        state = self.state
        for namespace, ids in state.batch_clients.expire(state.token_bytes):
            await state.run(state.corpus(namespace).erase_match_state, ids)
            state.metrics.batch_get_expired.inc(len(ids))
            log.debug("BatchGet: %d idle request ids of namespace '%s' expired", len(ids), namespace)
        self._freed += state.budget.take_freed()
        if state.reclaimer.available and self._freed >= TRIM_AFTER_BYTES:
            self._freed = 0
            await state.run(state.reclaimer.maybe_trim, TRIM_AFTER_BYTES)
