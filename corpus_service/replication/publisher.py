"""Publishes a replica's events to the log in batches; holds them (bounded) while the broker is down.

Decoding never waits for the broker: ``add_chunk`` only appends to a queue. The publish loop sends
one batch at a time and waits for JetStream's acknowledgement; a batch that was not acknowledged is
sent again under the same ``Nats-Msg-Id``, so the stream stores it once. While the broker is down
or slower than the commits (overload), the queue grows to ``buffer_tokens`` committed tokens;
further chunks are dropped (drafting gets worse, decoding never blocks): ``add_chunk`` says so (a
``BatchPut`` is refused), every drop is counted (``dropped_tokens``, the metrics), and each episode
of drops is logged once when it starts and once when the queue is below half the bound again.
Markers (external corpora, resets) are never dropped. Every queued event has a serial, and each
acknowledgement says up to which serial the stream holds (``wait_acked``: read-your-writes).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

import numpy as np

from corpus_service._native import RANK_DELTA_WORDS
from corpus_service.replication.events import CHUNK, RANK, ROLLOUT, Batch

log = logging.getLogger("corpus_service.replication")
# NATS' default max_payload is 1 MiB: a batch stays well under it.
MAX_BATCH_TOKENS = 128 * 1024
MAX_BATCH_EVENTS = 4096


class Publisher:
    def __init__(self, origin: str, subject: str, buffer_tokens: int, batch_s: float) -> None:
        self.origin, self.subject, self.buffer_tokens, self.batch_s = origin, subject, buffer_tokens, batch_s
        self._lock = threading.Lock()
        # event, tokens, when queued (ns), serial
        self._queue: deque[tuple[list, np.ndarray | None, int, int]] = deque()
        self._queued_tokens = 0
        self._unacked: tuple[bytes, str, int, int] | None = None  # payload, msg id, tokens, last serial
        self._serial = 0
        self._added = 0  # serial of the newest queued event
        self.acked_serial = 0  # every event up to this serial is in the stream ...
        self.published_seq = 0  # ... at or before this stream sequence (of the newest acknowledgement)
        self._epoch = time.time_ns()  # msg ids stay unique across restarts of this replica id
        self.published_batches = self.published_tokens = 0
        self.dropped_tokens = self.dropped_chunks = self.drop_episodes = 0
        self._dropping = 0  # tokens dropped in the current episode (0: none running)
        self.publish_errors = 0
        self.last_error = ""
        self.connected: bool | None = None  # None: nothing published yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()  # set when the queue stops being empty (no polling while idle)
        self._acked = asyncio.Event()  # set (and replaced) at every acknowledgement

    # ------------------------------------------------------------------ producers (any thread)

    def add_chunk(self, namespace: str, tokens: np.ndarray) -> bool:
        """Queues a chunk; False if it was dropped (the buffer is full)."""
        return self._add_tokens([CHUNK, namespace, int(tokens.size)], tokens)

    def add_rollout(self, namespace: str, key: str, version: int, tokens: np.ndarray, output: int) -> bool:
        """Queues a finished request's rollout for its prompt key's history (events.py); dropped like
        a chunk when the buffer is full (False)."""
        tokens = np.asarray(tokens, np.int32)
        return self._add_tokens([ROLLOUT, namespace, key, int(version), int(output), int(tokens.size)], tokens)

    def add_rank_delta(self, namespace: str, words: np.ndarray) -> bool:
        """Queues what this replica's rank model observed (events.py); dropped like a chunk when the
        buffer is full (False): every replica then learns a little less, and alike."""
        words = np.asarray(words, np.int32)
        return self._add_tokens([RANK, namespace, int(words.size), RANK_DELTA_WORDS], words)

    def _add_tokens(self, event: list, tokens: np.ndarray) -> bool:
        n = int(tokens.size)
        with self._lock:
            held = self._queued_tokens + (self._unacked[2] if self._unacked else 0)
            if held + n > self.buffer_tokens:
                self.dropped_tokens += n
                self.dropped_chunks += 1
                first = not self._dropping
                self._dropping += n
                self.drop_episodes += first
            else:
                first = None
                self._added += 1
                self._queue.append((event, tokens, time.time_ns(), self._added))
                self._queued_tokens += n
                wake = len(self._queue) == 1
        if first is not None:
            if first:
                log.error("commit log buffer full (%d of %d tokens held; broker %s): commits are dropped and "
                          "counted (ngram_corpus_replication_dropped_tokens) until it is below half",
                          held, self.buffer_tokens, "unreachable" if self.connected is False else "slower than the commits")
            return False
        if wake:
            self._notify()
        return True

    def add_marker(self, event: list) -> None:
        with self._lock:
            self._added += 1
            self._queue.append((event, None, time.time_ns(), self._added))
            wake = len(self._queue) == 1
        if wake:
            self._notify()

    def mark(self) -> int:
        """The serial of the newest queued event (``wait_acked`` waits for it)."""
        with self._lock:
            return self._added

    async def wait_acked(self, serial: int, timeout: float) -> int:
        """Waits until every event up to ``serial`` is in the stream; returns a stream sequence at
        or after the last of them. TimeoutError if the broker has not acknowledged them in time."""
        async with asyncio.timeout(timeout):
            while self.acked_serial < serial:
                await self._acked.wait()
        return self.published_seq

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
            last = 0
            while self._queue and len(batch.events) < MAX_BATCH_EVENTS:
                event, tokens, _, serial = self._queue[0]
                if tokens is not None and batch.tokens and batch.num_tokens() + tokens.size > MAX_BATCH_TOKENS:
                    break
                self._queue.popleft()
                batch.events.append(event)
                last = serial
                if tokens is not None:
                    batch.tokens.append(tokens)
                    self._queued_tokens -= tokens.size
            self._serial += 1
            msg_id = f"{self.origin}-{self._epoch}-{self._serial}"
            self._unacked = (batch.encode(), msg_id, batch.num_tokens(), last)
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
            payload, msg_id, n, last = item
            try:
                ack = await js.publish(self.subject, payload, timeout=2.0, headers={"Nats-Msg-Id": msg_id})
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the broker is down or slow, or the stream is gone: retry
                self.publish_errors += 1
                self.last_error = f"{type(e).__name__}: {e}"
                if self.connected is not False:  # once per episode
                    log.warning("commit log publish failed (%s); buffering commits (at most %d tokens)",
                                self.last_error, self.buffer_tokens)
                self.connected = False
                if stopping.is_set():
                    return
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)
                continue
            with self._lock:
                self._unacked = None
                self.acked_serial, self.published_seq = last, int(ack.seq)
                dropped = self._dropping if self._dropping and self._queued_tokens <= self.buffer_tokens // 2 else 0
                if dropped:
                    self._dropping = 0
            self._acked.set()
            self._acked = asyncio.Event()
            if dropped:
                log.warning("commit log buffer below half again: commits are queued again (%d tokens were dropped "
                            "in this episode)", dropped)
            if self.connected is False:
                log.info("commit log publish works again")
            self.connected = True
            backoff = self.batch_s
            self.published_batches += 1
            self.published_tokens += n

    def stats(self) -> dict:
        return {"published_batches": self.published_batches, "published_tokens": self.published_tokens,
                "published_seq": self.published_seq, "buffered_tokens": self.buffered_tokens(),
                "dropped_tokens": self.dropped_tokens, "dropped_chunks": self.dropped_chunks,
                "drop_episodes": self.drop_episodes, "dropping": bool(self._dropping),
                "publish_errors": self.publish_errors, "publish_error": self.last_error if self.connected is False else ""}
