"""Publishes a replica's events to the log in batches; holds them (bounded) while the broker is down.

Decoding never waits for the broker: ``add_chunk`` only appends to a queue. The publish loop sends
one batch at a time and waits for JetStream's acknowledgement; a batch that was not acknowledged is
sent again under the same ``Nats-Msg-Id``, so the stream stores it once. While the broker is down
the queue grows to ``buffer_tokens`` committed tokens; further chunks are dropped and counted
(drafting gets worse, decoding never blocks). Markers (external corpora, resets) are never dropped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

import numpy as np

from corpus_service.replication.events import CHUNK, Batch

log = logging.getLogger("corpus_service.replication")
# NATS' default max_payload is 1 MiB: a batch stays well under it.
MAX_BATCH_TOKENS = 128 * 1024
MAX_BATCH_EVENTS = 4096


class Publisher:
    def __init__(self, origin: str, subject: str, buffer_tokens: int, batch_s: float) -> None:
        self.origin, self.subject, self.buffer_tokens, self.batch_s = origin, subject, buffer_tokens, batch_s
        self._lock = threading.Lock()
        self._queue: deque[tuple[list, np.ndarray | None, int]] = deque()  # event, tokens, when queued (ns)
        self._queued_tokens = 0
        self._unacked: tuple[bytes, str, int] | None = None  # payload, msg id, tokens
        self._serial = 0
        self._epoch = time.time_ns()  # msg ids stay unique across restarts of this replica id
        self.published_batches = self.published_tokens = 0
        self.dropped_tokens = self.dropped_chunks = 0
        self.publish_errors = 0
        self.connected: bool | None = None  # None: nothing published yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()  # set when the queue stops being empty (no polling while idle)

    # ------------------------------------------------------------------ producers (any thread)

    def add_chunk(self, namespace: str, tokens: np.ndarray) -> None:
        n = int(tokens.size)
        with self._lock:
            held = self._queued_tokens + (self._unacked[2] if self._unacked else 0)
            if held + n > self.buffer_tokens:
                self.dropped_tokens += n
                self.dropped_chunks += 1
                return
            self._queue.append(([CHUNK, namespace, n], tokens, time.time_ns()))
            self._queued_tokens += n
            wake = len(self._queue) == 1
        if wake:
            self._notify()

    def add_marker(self, event: list) -> None:
        with self._lock:
            self._queue.append((event, None, time.time_ns()))
            wake = len(self._queue) == 1
        if wake:
            self._notify()

    def _notify(self) -> None:
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the loop is closed: the service is stopping
                pass

    def buffered_tokens(self) -> int:
        with self._lock:
            return self._queued_tokens + (self._unacked[2] if self._unacked else 0)

    def pending(self) -> bool:
        with self._lock:
            return bool(self._queue) or self._unacked is not None

    # ------------------------------------------------------------------ the publish loop

    def _next_batch(self) -> tuple[bytes, str, int] | None:
        with self._lock:
            if not self._queue:
                return None
            # Stamped with its oldest event: readers measure commit-to-visible from it.
            batch = Batch(self.origin, self._queue[0][2])
            while self._queue and len(batch.events) < MAX_BATCH_EVENTS:
                event, tokens, _ = self._queue[0]
                if tokens is not None and batch.tokens and batch.num_tokens() + tokens.size > MAX_BATCH_TOKENS:
                    break
                self._queue.popleft()
                batch.events.append(event)
                if tokens is not None:
                    batch.tokens.append(tokens)
                    self._queued_tokens -= tokens.size
            self._serial += 1
            msg_id = f"{self.origin}-{self._epoch}-{self._serial}"
            self._unacked = (batch.encode(), msg_id, batch.num_tokens())
            return self._unacked

    async def run(self, js, stopping: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        backoff = self.batch_s
        while True:
            item = self._unacked or self._next_batch()
            if item is None:
                if stopping.is_set():
                    return
                self._wake.clear()
                if not self.pending():
                    try:
                        await asyncio.wait_for(self._wake.wait(), 0.5)
                    except asyncio.TimeoutError:
                        continue
                await asyncio.sleep(self.batch_s)  # let a batch gather behind the first event
                continue
            payload, msg_id, n = item
            try:
                await js.publish(self.subject, payload, timeout=2.0, headers={"Nats-Msg-Id": msg_id})
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the broker is down or slow: keep the batch, retry
                self.publish_errors += 1
                if self.connected:
                    log.warning("commit log publish failed (%s: %s); buffering commits", type(e).__name__, e)
                self.connected = False
                if stopping.is_set():
                    return
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)
                continue
            with self._lock:
                self._unacked = None
            if self.connected is False:
                log.info("commit log publish works again")
            self.connected = True
            backoff = self.batch_s
            self.published_batches += 1
            self.published_tokens += n

    def stats(self) -> dict:
        return {"published_batches": self.published_batches, "published_tokens": self.published_tokens,
                "buffered_tokens": self.buffered_tokens(), "dropped_tokens": self.dropped_tokens,
                "dropped_chunks": self.dropped_chunks, "publish_errors": self.publish_errors}
