"""When and how a replica writes its snapshots, off the apply loop.

The apply loop never waits for a snapshot: the writer takes the applier's lock only to fork
(``Snapshots.start``: milliseconds, measured as the pause), and a forked child serializes and
writes while the replica goes on applying and drafting. Measured against the alternative, a save in
the process under the applier's lock (``bench/replication.py --parts snapshot``), which stops
applying for the whole write. One snapshot runs at a time.

Times are jittered so replicas started together do not write together: the first snapshot falls
due after 0.5-1.5 intervals, each next one after 0.8-1.2. After each snapshot the writer collects
old ones across replica ids (``Snapshots.collect``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable

from corpus_service.replication.snapshots import SnapshotRecord, Snapshots
from corpus_service.server.state import ServiceState

log = logging.getLogger("corpus_service.replication")


class SnapshotWriter:
    def __init__(self, snapshots: Snapshots, state: ServiceState, apply_lock: threading.Lock, interval_s: float,
                 keep: int, max_age_s: float) -> None:
        self.snapshots, self.state, self.apply_lock = snapshots, state, apply_lock
        self.interval_s, self.keep, self.max_age_s = interval_s, keep, max_age_s
        self._busy = asyncio.Lock()
        self._rng = random.Random()
        self.next_due = float("inf")
        self.written = self.errors = 0
        self.last_error = ""
        self.seq = 0  # position of the newest snapshot this replica wrote or loaded ...
        self.incarnation = ""  # ... in this stream incarnation
        self.newest_time = 0.0  # wall time of the newest snapshot this replica knows of (any replica's)
        self.last_duration_s = self.last_pause_s = 0.0
        self.last_bytes = 0
        self.dir = ""  # the newest snapshot's directory (written or loaded)

    def schedule(self, first: bool = False) -> None:
        if self.interval_s <= 0:
            return
        lo, hi = (0.5, 1.5) if first else (0.8, 1.2)
        self.next_due = time.monotonic() + self.interval_s * self._rng.uniform(lo, hi)

    def due(self, applied_seq: int, incarnation: str) -> bool:
        return (time.monotonic() >= self.next_due and not self._busy.locked()
                and (applied_seq, incarnation) != (self.seq, self.incarnation))

    def busy(self) -> bool:
        return self._busy.locked()

    def loaded(self, rec: SnapshotRecord) -> None:
        """The replica loaded ``rec``: that is its newest snapshot until it writes one."""
        self.seq, self.incarnation, self.dir = rec.seq, rec.incarnation, rec.dir
        self.newest_time = max(self.newest_time, rec.time)

    async def write(self, position: Callable[[], tuple[int, str]],
                    written: Callable[[SnapshotRecord], Awaitable[set[str]]]) -> SnapshotRecord | None:
        """Writes a snapshot of the applied state (``position()`` -> (seq, incarnation), read under
        the applier's lock) and hands the record to ``written`` (which records it and returns the
        directories garbage collection must keep). None if nothing changed since the last one."""
        async with self._busy:
            try:
                pending = await asyncio.to_thread(self._fork, position)
                if pending is None:
                    return None
                rec = await asyncio.to_thread(self.snapshots.finish, pending)
            except Exception as e:  # noqa: BLE001 - counted, logged, reported; applying goes on
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"
                log.error("snapshot failed: %s", self.last_error)
                raise
            finally:
                self.schedule()
            self.written += 1
            self.seq, self.incarnation, self.dir = rec.seq, rec.incarnation, rec.dir
            self.newest_time = max(self.newest_time, rec.time)
            self.last_duration_s = time.monotonic() - pending.started
            self.last_pause_s, self.last_bytes = pending.pause_s, rec.bytes
            log.info("snapshot at seq %d written (%d bytes) in %.2fs; applying paused %.1f ms for it", rec.seq,
                     rec.bytes, self.last_duration_s, 1e3 * self.last_pause_s)
            protect = await written(rec)
            try:
                await asyncio.to_thread(self.snapshots.collect, self.keep, self.max_age_s, protect)
            except OSError as e:  # the next snapshot collects again
                log.warning("snapshot garbage collection failed: %s", e)
            return rec

    def _fork(self, position):
        with self.apply_lock:
            seq, incarnation = position()
            if (seq, incarnation) == (self.seq, self.incarnation):
                return None  # the newest snapshot holds this state already
            return self.snapshots.start(self.state, seq, incarnation)

    def stats(self) -> dict:
        return {"snapshot_seq": self.seq, "snapshots_written": self.written, "snapshot_errors": self.errors,
                "snapshot_error": self.last_error, "snapshot_writing": self.busy(),
                "snapshot_age_s": time.time() - self.newest_time if self.newest_time else None,
                "snapshot_duration_s": self.last_duration_s, "snapshot_pause_ms": 1e3 * self.last_pause_s,
                "snapshot_bytes": self.last_bytes}
