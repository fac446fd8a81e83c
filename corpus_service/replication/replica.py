"""One corpus replica of a replicated cluster (``serve --log nats://HOST:PORT``).

Start: connect to NATS (retrying: lookups are served meanwhile), make sure the stream and the KV
bucket exist, load the newest snapshot whose sequence the stream still reaches back to, replay the
log from there, and report ready once at most ``ready_lag`` messages are left. Then: apply every
message in stream order (one applier), publish this replica's commits (``Publisher``), and write a
snapshot every ``snapshot_interval_s``. A retention gap (the log no longer holds the messages after
the newest snapshot) is logged, counted and shown in the status; a newer snapshot is loaded if one
exists, otherwise the replica continues from the oldest message the log still holds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections import deque
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
from nats.js import api

from corpus_service.replication.applier import Applier, digest
from corpus_service.replication.blobstore import open_blob_store
from corpus_service.replication.chunker import Chunker
from corpus_service.replication.events import decode
from corpus_service.replication.publisher import Publisher
from corpus_service.replication.snapshots import LATEST, SnapshotRecord, Snapshots
from corpus_service.service_config import ServiceConfig
from corpus_service.service_state import ServiceState

log = logging.getLogger("corpus_service.replication")
FETCH_BATCH = 512  # messages applied together at most
MAX_UNAPPLIED = 4096  # messages the broker sends ahead of the applied one


class Replica:
    def __init__(self, config: ServiceConfig, state: ServiceState, data_root: Path, externals=None) -> None:
        self.config, self.state = config, state
        self.id = config.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.stream = config.log_stream
        self.subject = f"{self.stream}.commits"
        self.bucket = f"{self.stream}-snapshots"
        self.blobs = open_blob_store(config.blob_store or Path(data_root) / "blobs")
        self.snapshots = Snapshots(self.blobs, self.id)
        self.publisher = Publisher(self.id, self.subject, config.log_buffer_tokens, config.log_batch_ms / 1000)
        self.chunkers = {s.name: Chunker(s.name, s.corpus.flush_tokens, s.corpus.learn_prompts, self.publisher.add_chunk)
                         for s in config.parsed_namespaces}
        self.externals = externals  # replicated external corpora (ExternalCorpora), set by the service
        self.applier = Applier(state, self._on_external, self._on_remove)
        self.applied_seq = 0
        self.pending = -1  # messages the stream holds beyond applied_seq (-1: unknown yet)
        self.bootstrapped = False
        self.gaps = 0
        self.gap_error = ""
        self.snapshot_seq = 0
        self.last_snapshot = time.monotonic()
        self.snapshot_errors = 0
        self.lags_ms: deque[float] = deque(maxlen=65536)  # commit-to-visible (ms), per applied batch
        self.lag_count = 0  # batches measured so far (the deque keeps the newest)
        self._nc = None
        self._js = None
        self._kv = None
        self._apply_lock = threading.Lock()  # applying and snapshotting take turns
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Returns at once; connecting and bootstrapping go on in the background (not ready yet)."""
        self._loop = asyncio.get_running_loop()
        self.state.ready = False
        self.state.not_ready_reason = "replica bootstrapping: connecting to the commit log"
        self._tasks.append(asyncio.create_task(self._main(), name="replica-main"))

    async def stop(self, timeout: float) -> None:
        """Publishes what is buffered (within ``timeout``), writes a last snapshot, disconnects."""
        deadline = time.monotonic() + timeout
        while self.publisher.pending() and self.publisher.connected is not False and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._stopping.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.bootstrapped:
            try:
                await asyncio.to_thread(self._snapshot)
            except Exception:  # noqa: BLE001
                log.exception("shutdown snapshot failed")
        if self._nc is not None:
            try:
                await asyncio.wait_for(self._nc.close(), 2.0)
            except Exception:  # noqa: BLE001 - the broker may be down
                pass

    async def _main(self) -> None:
        await self._connect()
        self._tasks.append(asyncio.create_task(self.publisher.run(self._js, self._stopping), name="replica-publish"))
        while True:
            try:
                await self._bootstrap()
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - e.g. the broker went away mid-bootstrap: retry
                log.warning("replica bootstrap failed (%s: %s); retrying", type(e).__name__, e)
                self.state.not_ready_reason = f"replica bootstrapping: {e}"
                await asyncio.sleep(0.5)
        await self._consume()

    async def _connect(self) -> None:
        servers = [u.strip() for u in self.config.log.split(",")]
        while True:
            try:
                self._nc = await nats.connect(servers=servers, name=f"ngram-corpus {self.id}", connect_timeout=2,
                                              allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=0.25,
                                              disconnected_cb=self._disconnected, reconnected_cb=self._reconnected,
                                              error_cb=self._error)
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - not up yet: lookups are served meanwhile
                log.warning("commit log %s unreachable (%s); retrying", self.config.log, e)
                await asyncio.sleep(0.5)
        self._js = self._nc.jetstream(timeout=2.0)
        log.info("replica %s connected to the commit log %s (stream %s)", self.id, self.config.log, self.stream)

    async def _disconnected(self) -> None:
        if not self._stopping.is_set():
            log.warning("commit log disconnected; lookups go on, commits are buffered")

    async def _reconnected(self) -> None:
        log.info("commit log reconnected")

    async def _error(self, e: Exception) -> None:
        log.debug("nats: %s", e)

    async def _ensure_stream(self):
        try:
            info = await self._js.stream_info(self.stream)
        except nats.js.errors.NotFoundError:
            cfg = api.StreamConfig(name=self.stream, subjects=[self.subject], storage=api.StorageType.FILE,
                                   max_msgs=self.config.log_max_msgs or -1, duplicate_window=120.0)
            await self._js.add_stream(cfg)
            info = await self._js.stream_info(self.stream)
        if hasattr(self.blobs, "attach"):
            await self.blobs.attach(self._js)
        try:
            self._kv = await self._js.key_value(self.bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            self._kv = await self._js.create_key_value(bucket=self.bucket, history=5)
        return info

    async def _records(self) -> list[SnapshotRecord]:
        """Complete snapshots, newest first: the blob store's, and the KV bucket's record of the newest
        (which may name one this replica cannot list, if the blob store is not shared)."""
        recs = await asyncio.to_thread(self.snapshots.records)
        try:
            entry = await self._kv.get(LATEST)
            kv = SnapshotRecord.from_json(entry.value)
            if all((r.seq, r.replica) != (kv.seq, kv.replica) for r in recs):
                recs.append(kv)
        except nats.js.errors.KeyNotFoundError:
            pass
        return sorted(recs, key=lambda r: r.seq, reverse=True)

    async def _bootstrap(self) -> None:
        self.state.not_ready_reason = "replica bootstrapping: loading the newest snapshot"
        info = await self._ensure_stream()
        first, last = info.state.first_seq, info.state.last_seq
        recs = await self._records()
        usable = [r for r in recs if r.seq + 1 >= first]
        if recs and not usable or (recs and usable and usable[0] is not recs[0]):
            newest = recs[0]
            self._gap(f"retention gap: the newest snapshot covers seq {newest.seq} but the log starts at seq {first}; "
                      + (f"loading the newer snapshot at seq {usable[0].seq}" if usable else
                         f"no newer snapshot: messages {newest.seq + 1}..{first - 1} are lost"))
        t0 = time.perf_counter()
        loaded = None
        for rec in usable or recs[:1]:
            try:
                await asyncio.to_thread(self.snapshots.load, self.state, rec)
                loaded = rec
                break
            except (OSError, ValueError) as e:  # missing blob, corrupt file: try the next older one
                log.error("snapshot at seq %d (replica %s) not loaded: %s", rec.seq, rec.replica, e)
        if loaded is not None:
            self.applied_seq = self.snapshot_seq = loaded.seq
            log.info("loaded snapshot at seq %d (%d bytes) in %.2fs", loaded.seq, loaded.bytes, time.perf_counter() - t0)
        if self.applied_seq + 1 < first:
            if loaded is None:
                self._gap(f"retention gap: no {'loadable ' if recs else ''}snapshot and the log starts at seq "
                          f"{first}: messages 1..{first - 1} are lost")
            self.applied_seq = first - 1
        self.pending = max(0, last - self.applied_seq)
        self.bootstrapped = True
        self.last_snapshot = time.monotonic()
        self._update_ready()

    def _gap(self, msg: str) -> None:
        self.gaps += 1
        self.gap_error = msg
        log.error("%s", msg)

    # ------------------------------------------------------------------ consuming

    async def _subscribe(self, start_seq: int):
        """A push consumer from ``start_seq``: messages arrive as soon as they are stored. Acking the
        last applied message (AckAll) lets the next ``MAX_UNAPPLIED`` through: the broker never
        floods a replica that is applying a backlog."""
        cfg = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(1, start_seq),
                                 ack_policy=api.AckPolicy.ALL, max_ack_pending=MAX_UNAPPLIED, ack_wait=30.0,
                                 inactive_threshold=30.0)
        return await self._js.subscribe(self.subject, stream=self.stream, config=cfg, manual_ack=True,
                                        pending_msgs_limit=4 * MAX_UNAPPLIED)

    async def _consume(self) -> None:
        sub, idle_behind = None, 0
        while not self._stopping.is_set():
            try:
                if sub is None:
                    sub = await self._subscribe(self.applied_seq + 1)
                msgs = [await sub.next_msg(timeout=0.5)]
                while len(msgs) < FETCH_BATCH and sub.pending_msgs > 0:
                    msgs.append(await sub.next_msg(timeout=0.5))
            except asyncio.CancelledError:
                raise
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                await self._refresh_pending()
                # Messages exist that the consumer does not deliver (it was lost with a broker
                # restart, or ran into the slow-consumer limit): subscribe again from applied+1.
                idle_behind = idle_behind + 1 if self.pending > 0 else 0
                if idle_behind >= 2 and sub is not None:
                    sub, idle_behind = await self._drop(sub), 0
                self._update_ready()
                await self._maybe_snapshot()
                continue
            except Exception as e:  # noqa: BLE001 - broker down or consumer gone: subscribe again from applied+1
                log.debug("commit log consumer failed (%s: %s); resubscribing", type(e).__name__, e)
                sub = await self._drop(sub)
                await asyncio.sleep(0.25)
                continue
            idle_behind = 0
            batches, last_seq, pending = [], self.applied_seq, self.pending
            for m in msgs:
                seq = m.metadata.sequence.stream
                if seq <= last_seq:
                    continue  # already applied (redelivered, or a resubscription repeats the start)
                if seq != last_seq + 1 and not await self._is_retention_gap(last_seq, seq):
                    break  # this client dropped messages: apply what came in order, resubscribe below
                try:
                    batches.append(decode(m.data))
                except ValueError as e:
                    log.error("log message %d skipped: %s", seq, e)
                last_seq, pending = seq, m.metadata.num_pending
            if last_seq != self.applied_seq:
                await asyncio.to_thread(self._apply, batches, last_seq)
                self.pending = pending
                try:
                    await msgs[-1].ack() if msgs[-1].metadata.sequence.stream == last_seq else None
                except Exception:  # noqa: BLE001 - an unacked message is redelivered and skipped
                    pass
            if msgs[-1].metadata.sequence.stream > last_seq:
                sub = await self._drop(sub)
            self._update_ready()
            await self._maybe_snapshot()

    async def _drop(self, sub):
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the broker may be down
                pass
        return None

    async def _is_retention_gap(self, last_seq: int, seq: int) -> bool:
        """A jump in sequence numbers is a retention gap when the stream no longer holds the missing
        messages; otherwise this client lost them on the way and resubscribes."""
        try:
            info = await self._js.stream_info(self.stream)
        except Exception:  # noqa: BLE001
            return False
        if info.state.first_seq <= last_seq + 1:
            return False
        self._gap(f"retention gap: expected log message {last_seq + 1}, the log's next is {seq}: "
                  f"messages {last_seq + 1}..{seq - 1} are lost")
        return True

    def _apply(self, batches, last_seq: int) -> None:
        with self._apply_lock:
            self.applier.apply(batches)
            self.applied_seq = last_seq
        now = time.time_ns()
        for b in batches:
            if b.t_ns:
                self.lags_ms.append((now - b.t_ns) / 1e6)
                self.lag_count += 1

    async def _refresh_pending(self) -> None:
        try:
            info = await self._js.stream_info(self.stream)
            self.pending = max(0, info.state.last_seq - self.applied_seq)
        except Exception:  # noqa: BLE001 - keep the last known lag while the broker is away
            pass

    def _update_ready(self) -> None:
        ready = self.bootstrapped and 0 <= self.pending <= self.config.ready_lag
        if not self.bootstrapped:
            return
        self.state.not_ready_reason = "" if ready else (
            f"replica catching up: {self.pending} log messages behind (ready at {self.config.ready_lag})")
        self.state.ready = ready

    # ------------------------------------------------------------------ snapshots

    async def _maybe_snapshot(self) -> None:
        interval = self.config.snapshot_interval_s
        if interval <= 0 or time.monotonic() - self.last_snapshot < interval or self.applied_seq == self.snapshot_seq:
            return
        try:
            await asyncio.to_thread(self._snapshot)
        except Exception:  # noqa: BLE001 - a failed snapshot must not stop applying
            self.snapshot_errors += 1
            log.exception("replica snapshot failed")
        self.last_snapshot = time.monotonic()

    def _snapshot(self) -> SnapshotRecord | None:
        """Runs between applied messages (the consumer awaits it), so it covers exactly applied_seq."""
        with self._apply_lock:
            if self.applied_seq == self.snapshot_seq and self.snapshot_seq:
                return None
            rec = self.snapshots.write(self.state, self.applied_seq)
            self.snapshot_seq = rec.seq
        log.info("snapshot at seq %d written (%d bytes)", rec.seq, rec.bytes)
        if self._kv is not None and self._nc is not None and self._nc.is_connected:
            loop = self._loop
            asyncio.run_coroutine_threadsafe(self._record(rec), loop)
        return rec

    async def _record(self, rec: SnapshotRecord) -> None:
        try:
            try:
                cur = SnapshotRecord.from_json((await self._kv.get(LATEST)).value)
            except nats.js.errors.KeyNotFoundError:
                cur = None
            if cur is None or cur.seq < rec.seq:
                await self._kv.put(LATEST, rec.to_json())
        except Exception as e:  # noqa: BLE001 - the blob store still lists it
            log.warning("could not record snapshot %d in the KV bucket (%s)", rec.seq, e)

    async def snapshot(self) -> dict[str, str]:
        """An on-demand snapshot (POST /v1/snapshot), taken between applied messages: namespace -> blob."""
        if not self.bootstrapped:
            raise RuntimeError("the replica has not bootstrapped yet")
        await asyncio.to_thread(self._snapshot)
        return {ns: f"{self.blobs.root}/snapshots/{self.snapshot_seq:020d}-{self.id}/{ns}.ngc" for ns in self.state.specs}

    # ------------------------------------------------------------------ external corpora

    async def publish_upload(self, manifest) -> None:
        await self.externals.publish_upload(manifest)

    def publish_remove(self, namespace: str, name: str) -> None:
        self.externals.publish_remove(namespace, name)

    def _on_external(self, ev: list) -> None:
        if self.externals is not None:
            self.externals.apply_upload(ev)

    def _on_remove(self, ev: list) -> None:
        if self.externals is not None:
            self.externals.apply_remove(ev)

    # ------------------------------------------------------------------ status

    def recent_lags(self, n: int) -> list[float]:
        """The newest ``n`` commit-to-visible samples (ms), for benchmarks."""
        lags = list(self.lags_ms)
        return lags[len(lags) - min(n, len(lags)):]

    def status(self, with_digest: bool = False) -> dict:
        lags = sorted(self.lags_ms)
        out = {
            "replica": self.id, "stream": self.stream, "connected": bool(self._nc and self._nc.is_connected),
            "bootstrapped": self.bootstrapped, "ready": bool(self.state.ready), "applied_seq": self.applied_seq,
            "pending": self.pending, "snapshot_seq": self.snapshot_seq, "gaps": self.gaps, "gap_error": self.gap_error,
            "snapshot_errors": self.snapshot_errors, "applied_tokens": self.applier.applied_tokens,
            "lag_count": self.lag_count,
            "lag_ms_p50": lags[len(lags) // 2] if lags else None,
            "lag_ms_p99": lags[min(len(lags) - 1, int(len(lags) * 0.99))] if lags else None,
            **self.publisher.stats(),
        }
        if with_digest:
            with self._apply_lock:  # a digest between two applied messages, and which one
                out["digest_seq"], out["digest"] = self.applied_seq, digest(self.state)
        return out
