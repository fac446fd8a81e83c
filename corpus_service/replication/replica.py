"""One corpus replica of a replicated cluster (``serve --nats-url nats://HOST:PORT``).

Start: connect to NATS (retrying: lookups are served meanwhile; if the broker cannot be reached,
the newest snapshot in the blob store is loaded and served read-only until it can), make sure the
stream (with the configured retention) and the KV bucket exist, pick the state to start from
(``bootstrap.plan``), replay the log from there, and report ready once at most ``ready_lag``
messages are left. Then: apply every message in stream order (one applier), publish this
replica's commits (``Publisher``), and write snapshots in the background (``SnapshotWriter``).

The stream is watched whenever the log is idle or failing: if the broker says it is gone (deleted,
or lost with the broker's storage), the replica turns not-ready, writes a snapshot of what it
applied, recreates the stream with that snapshot as the new incarnation's base, and applies the
new incarnation from its first message; a replica that finds the stream recreated by another loads
the base the stream names. Commits made meanwhile wait in the publisher's buffer and land in the
new incarnation, so every replica ends up with them.
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

from corpus_service.replication.applier import Applier
from corpus_service.replication.blobstore import open_blob_store
from corpus_service.replication.bootstrap import plan
from corpus_service.replication.chunker import Chunker
from corpus_service.replication.events import CHUNK, POLICY, RANK, ROLLOUT, decode
from corpus_service.replication.publisher import Publisher
from corpus_service.replication.recovery import watch_stream
from corpus_service.replication.snapshot_writer import SnapshotWriter
from corpus_service.replication.snapshots import LATEST, SnapshotRecord, Snapshots
from corpus_service.replication.stream import CommitStream, StreamView
from corpus_service.replication.visibility import lag_seconds, status, wait_visible
from corpus_service.server.config import ServiceConfig
from corpus_service.server.state import ServiceState

log = logging.getLogger("corpus_service.replication")
FETCH_BATCH = 512  # messages applied together at most
MAX_UNAPPLIED = 4096  # messages the broker sends ahead of the acknowledged one
# Acknowledgements (AckAll: one covers every message before it) go out every ACK_EVERY_MSGS applied
# messages or ACK_EVERY_S seconds, and when the log is idle: one per applied batch cost a publish and a
# flusher turn on the serving loop each (per-core lookups with replication, bench/replication.py).
# Both stay far inside what the broker allows (MAX_UNAPPLIED unacknowledged, ack_wait 30 s).
ACK_EVERY_MSGS = 256
ACK_EVERY_S = 0.25
# A batch of at most this many tokens, made only of engine events, is applied on the serving loop itself
# (when no snapshot holds the applier's lock): a small chunk's insert costs less than the hop to a worker
# thread and back. External corpora and resets go to a thread (an upload's blob is fetched through the
# broker, on this loop).
INLINE_APPLY_TOKENS = 16384
INLINE_EVENTS = frozenset((CHUNK, ROLLOUT, RANK, POLICY))
# How often the rank models' observations go to the log: a few hundred nodes per namespace per round at
# a busy replica, and the model a fraction of a second behind the commits on every replica.
RANK_DELTA_INTERVAL_S = 0.25
OFFLINE_AFTER_S = 3.0  # a broker unreachable this long at start: serve the newest snapshot meanwhile


class Replica:
    def __init__(self, config: ServiceConfig, state: ServiceState, data_root: Path, externals=None) -> None:
        self.config, self.state = config, state
        self.id = config.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.stream_name = config.log_stream
        self.subject = f"{self.stream_name}.commits"
        self.bucket = f"{self.stream_name}-snapshots"
        self.stream = CommitStream(config, self.subject)
        self.blobs = open_blob_store(config.blob_store or Path(data_root) / "blobs")
        self.snapshots = Snapshots(self.blobs, self.id)
        self.publisher = Publisher(self.id, self.subject, config.log_buffer_tokens, config.log_batch_ms / 1000)
        self.chunkers = {s.name: Chunker(s.name, s.corpus.flush_tokens, s.corpus.learn_prompts, self.publisher.add_chunk)
                         for s in config.parsed_namespaces}
        self.externals = externals  # replicated external corpora (ExternalCorpora), set by the service
        self.applier = Applier(state, self._on_external, self._on_remove)
        self._apply_lock = threading.Lock()  # applying, loading and forking a snapshot writer take turns
        self.writer = SnapshotWriter(self.snapshots, state, self._apply_lock, config.snapshot_interval_s,
                                     config.snapshot_keep, config.snapshot_max_age_s)
        self.incarnation = ""  # the stream incarnation applied_seq counts in
        self.applied_seq = 0
        self.pending = -1  # messages the stream holds beyond applied_seq (-1: unknown yet)
        self.stream_last = 0
        self.base = None  # the snapshot directory the current incarnation starts from
        self.bootstrapped = False
        self.read_only = False  # serving a snapshot while the broker has been unreachable since start
        self._offline_loading = False
        self._has_state = False  # a snapshot was loaded or the log applied (the engines hold a position)
        self.stream_ok = True  # False from finding the stream lost until this replica follows its new incarnation
        self.stream_losses = 0
        self.gaps = 0
        self.gap_error = ""
        self.lags_ms: deque[float] = deque(maxlen=65536)  # commit-to-visible (ms), per applied batch
        self.lag_count = 0  # batches measured so far (the deque keeps the newest)
        self._last_commit_ns = 0  # commit time of the newest applied batch
        self.metrics = None  # ReplicationMetrics, set by the service
        self._nc = None
        self._js = None
        self._kv = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = asyncio.Event()
        self._applied = asyncio.Event()  # set (and replaced) after every applied batch
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
        self.publish_rank_deltas()  # what the rank models observed since the last round
        while self.publisher.pending() and self.publisher.connected is not False and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._stopping.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.bootstrapped and self.stream_ok:
            try:
                await self.writer.write(self._position, self._written)
            except Exception:  # noqa: BLE001 - logged by the writer
                pass
        if self._nc is not None:
            try:
                await asyncio.wait_for(self._nc.close(), 2.0)
            except Exception:  # noqa: BLE001 - the broker may be down
                pass

    async def _main(self) -> None:
        await self._connect()
        self._tasks.append(asyncio.create_task(self.publisher.run(self._js, self._stopping), name="replica-publish"))
        self._tasks.append(asyncio.create_task(self._rank_loop(), name="replica-rank"))
        while True:
            try:
                await self._bootstrap()
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - e.g. the broker went away mid-bootstrap: retry
                log.warning("replica bootstrap failed (%s: %s); retrying", type(e).__name__, e)
                if not self.read_only:
                    self.state.not_ready_reason = f"replica bootstrapping: {e}"
                await asyncio.sleep(0.5)
        self._tasks.append(asyncio.create_task(self._snapshot_loop(), name="replica-snapshots"))
        await self._consume()

    def publish_rank_deltas(self) -> int:
        """Moves what each namespace's rank model observed (its engine learns nothing locally when
        replicated: ``rank_learn_local`` is off) into the log, where every replica, this one included,
        learns it in log order: so all hold the same model. Returns the words queued."""
        words = 0
        for spec in self.config.parsed_namespaces:
            if not spec.corpus.rank_model:
                continue
            delta = self.state.corpus(spec.name).export_rank_delta()
            if delta.size:
                self.publisher.add_rank_delta(spec.name, delta)
                words += int(delta.size)
        return words

    async def _rank_loop(self) -> None:
        while not self._stopping.is_set():
            await asyncio.sleep(RANK_DELTA_INTERVAL_S)
            self.publish_rank_deltas()

    async def _connect(self) -> None:
        servers = [u.strip() for u in self.config.nats_url.split(",")]
        # nats-py keeps trying an unreachable broker inside connect(); meanwhile, after a few seconds,
        # the newest snapshot is served read-only.
        offline = asyncio.create_task(self._serve_newest_snapshot(OFFLINE_AFTER_S), name="replica-offline")
        while True:
            try:
                self._nc = await nats.connect(servers=servers, name=f"ngram-corpus {self.id}", connect_timeout=2,
                                              allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=0.25,
                                              disconnected_cb=self._disconnected, reconnected_cb=self._reconnected,
                                              error_cb=self._error)
                break
            except asyncio.CancelledError:
                offline.cancel()
                raise
            except Exception as e:  # noqa: BLE001 - not up yet: lookups are served meanwhile
                log.warning("commit log %s unreachable (%s); retrying", self.config.nats_url, e)
                await asyncio.sleep(0.5)
        if not self._offline_loading:
            offline.cancel()
        await asyncio.gather(offline, return_exceptions=True)  # a load under way finishes first
        self._js = self._nc.jetstream(timeout=2.0)
        log.info("replica %s connected to the commit log %s (stream %s)", self.id, self.config.nats_url, self.stream_name)

    async def _serve_newest_snapshot(self, after_s: float) -> None:
        """The broker is unreachable at start: serve the newest snapshot in the blob store, read-only
        (commits are buffered), until the broker is back and the replica can follow the stream."""
        await asyncio.sleep(after_s)
        self._offline_loading = True
        log.warning("commit log %s unreachable for %.0fs: looking for a snapshot to serve meanwhile",
                    self.config.nats_url, after_s)
        try:
            recs = await asyncio.to_thread(self.snapshots.records)  # an object store needs the broker: none
        except OSError as e:
            recs = []
            log.warning("no snapshot readable without the broker (%s)", e)
        for rec in recs:
            try:
                await asyncio.to_thread(self._load, rec, rec.seq, rec.incarnation)
            except (OSError, ValueError) as e:
                log.error("snapshot %s not loaded: %s", rec.dir, e)
                continue
            self.read_only = True
            self.state.ready, self.state.not_ready_reason = True, ""
            log.warning("commit log unreachable: serving the snapshot at seq %d (replica %s, %.0fs old) read-only; "
                        "commits are buffered until the broker is back", rec.seq, rec.replica, time.time() - rec.time)
            return
        self.state.not_ready_reason = "replica bootstrapping: the commit log is unreachable and no snapshot is in the blob store"

    async def _disconnected(self) -> None:
        if not self._stopping.is_set():  # logged and counted once per outage (server/outages.py)
            self.state.outages.down("commit log", "disconnected from the broker; lookups go on, commits are buffered")

    async def _reconnected(self) -> None:
        self.state.outages.up("commit log")

    async def _error(self, e: Exception) -> None:
        log.debug("nats: %s", e)

    async def _attach_stores(self) -> None:
        """The KV bucket (and the object store, if blobs live there), created if missing."""
        if hasattr(self.blobs, "attach"):
            await self.blobs.attach(self._js)
        want = int(self.config.log_replicas)
        try:
            self._kv = await self._js.key_value(self.bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            self._kv = await self._js.create_key_value(bucket=self.bucket, history=5, replicas=want or 1)
            return
        if want:  # the bucket is a stream (KV_<bucket>): its copies follow log_replicas like the log's
            info = await self._js.stream_info(f"KV_{self.bucket}")
            if (info.config.num_replicas or 1) != want:
                cfg = info.config
                log.warning("snapshot bucket %s: replicas changed from %d to %d", self.bucket, cfg.num_replicas or 1, want)
                cfg.num_replicas = want
                await self._js.update_stream(cfg)

    async def _records(self) -> list[SnapshotRecord]:
        """Complete snapshots: the blob store's, and the KV bucket's record of the newest (which may
        name one this replica cannot list, if the blob store is not shared)."""
        recs = await asyncio.to_thread(self.snapshots.records)
        try:
            kv = SnapshotRecord.from_json((await self._kv.get(LATEST)).value)
            if all((r.seq, r.replica, r.incarnation) != (kv.seq, kv.replica, kv.incarnation) for r in recs):
                recs.append(kv)
        except nats.js.errors.KeyNotFoundError:
            pass
        return recs

    async def _bootstrap(self) -> None:
        if not self.read_only:
            self.state.not_ready_reason = "replica bootstrapping: loading the newest snapshot"
        view = await self.stream.ensure(self._js)
        await self._attach_stores()
        await self._adopt(view)
        if self.read_only:
            log.info("commit log reachable again: the replica follows the stream (it served a snapshot read-only)")
        self.bootstrapped, self.read_only = True, False
        self.writer.schedule(first=True)
        self._update_ready()

    async def _adopt(self, view: StreamView) -> None:
        """Follows ``view``'s incarnation: keeps the state, or loads the snapshot ``bootstrap.plan`` picks."""
        base = None
        if view.base:
            try:
                base = await asyncio.to_thread(self.snapshots.record_at, view.base)
            except (OSError, ValueError) as e:
                log.error("the stream's base snapshot %s cannot be read (%s)", view.base, e)
        current = (self.incarnation, self.applied_seq) if self._has_state else None
        p = plan(view, await self._records(), current, base)
        if p.gap:
            self._gap(p.gap)
        loaded = None
        for rec, position in p.candidates:
            t0 = time.perf_counter()
            try:
                await asyncio.to_thread(self._load, rec, position, view.incarnation)
            except (OSError, ValueError) as e:  # missing blob, corrupt file: try the next older one
                log.error("snapshot at seq %d (replica %s) not loaded: %s", rec.seq, rec.replica, e)
                continue
            loaded = rec
            log.info("loaded snapshot at seq %d (%d bytes) in %.2fs", rec.seq, rec.bytes, time.perf_counter() - t0)
            break
        if loaded is None and not p.keep:
            if p.candidates:
                self._gap(f"no snapshot could be loaded: this replica starts at seq {p.position} of the log without "
                          f"messages 1..{p.position}" if p.position else "no snapshot could be loaded; replaying the log")
            await asyncio.to_thread(self._start_at, p.position, view.incarnation, p.reset)
        elif p.keep:
            await asyncio.to_thread(self._start_at, p.position, view.incarnation, False)
        self.base = view.base
        self.stream_last = view.last
        self.pending = max(0, view.last - self.applied_seq)

    def _load(self, rec: SnapshotRecord, position: int, incarnation: str) -> None:
        with self._apply_lock:
            self.snapshots.load(self.state, rec)
            self.applied_seq, self.incarnation, self._has_state = position, incarnation, True
        self.writer.loaded(rec)

    def _start_at(self, position: int, incarnation: str, reset: bool) -> None:
        with self._apply_lock:
            if reset:
                log.warning("the replica's state belongs to another stream incarnation: starting empty")
                for ns in self.state.specs:
                    corpus = self.state.corpus(ns)
                    corpus.reset()
                    for name in list(corpus.list_external_corpora()):
                        corpus.remove_external_corpus(name)
            self.applied_seq, self.incarnation, self._has_state = position, incarnation, True

    def _gap(self, msg: str) -> None:
        self.gaps += 1
        self.gap_error = msg
        log.error("%s", msg)

    # ------------------------------------------------------------------ consuming

    async def _subscribe(self, start_seq: int) -> tuple[object, "_Inbox"]:
        """A push consumer from ``start_seq``: messages arrive as soon as they are stored. An
        acknowledgement of the last applied message (AckAll) lets the next ``MAX_UNAPPLIED`` through:
        the broker never floods a replica that is applying a backlog. Messages go to an ``_Inbox``
        (a fresh one per subscription) by the subscription's callback."""
        cfg = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(1, start_seq),
                                 ack_policy=api.AckPolicy.ALL, max_ack_pending=MAX_UNAPPLIED, ack_wait=30.0,
                                 inactive_threshold=30.0)
        inbox = _Inbox()
        sub = await self._js.subscribe(self.subject, stream=self.stream_name, config=cfg, manual_ack=True, cb=inbox.put,
                                       pending_msgs_limit=4 * MAX_UNAPPLIED)
        return sub, inbox

    async def _consume(self) -> None:
        sub = inbox = None
        idle_behind = 0
        acker = _Acker()
        while not self._stopping.is_set():
            try:
                if sub is None:
                    sub, inbox = await self._subscribe(self.applied_seq + 1)
                    acker = _Acker()
                msgs = await inbox.take(0.5, FETCH_BATCH)
            except asyncio.CancelledError:
                raise
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                await acker.flush()  # the log is idle: acknowledge what was applied
                if await self._watch_stream():
                    sub = await self._drop(sub)  # the stream was recreated: follow its new incarnation
                    continue
                # Messages exist that the consumer does not deliver (it was lost with a broker
                # restart, or ran into the slow-consumer limit): subscribe again from applied+1.
                idle_behind = idle_behind + 1 if self.pending > 0 else 0
                if idle_behind >= 2 and sub is not None:
                    sub, idle_behind = await self._drop(sub), 0
                self._update_ready()
                continue
            except Exception as e:  # noqa: BLE001 - broker down, consumer or stream gone: look, subscribe again
                log.debug("commit log consumer failed (%s: %s); resubscribing", type(e).__name__, e)
                sub = await self._drop(sub)
                if not await self._watch_stream():
                    await asyncio.sleep(0.25)
                continue
            idle_behind = 0
            batches, last_seq, pending, last_msg, tokens = [], self.applied_seq, self.pending, None, 0
            out_of_order, inline = False, True
            for m in msgs:
                meta = m.metadata
                seq = meta.sequence.stream
                if seq <= last_seq:
                    continue  # already applied (redelivered, or a resubscription repeats the start)
                if seq != last_seq + 1 and not await self._is_retention_gap(last_seq, seq):
                    out_of_order = True
                    break  # this client dropped messages: apply what came in order, resubscribe below
                try:
                    b = decode(m.data)
                    batches.append(b)
                    tokens += b.num_tokens()
                    inline = inline and all(ev[0] in INLINE_EVENTS for ev in b.events)
                except ValueError as e:
                    log.error("log message %d skipped: %s", seq, e)
                last_seq, pending, last_msg = seq, meta.num_pending, m
            if last_msg is not None:
                if inline and tokens <= INLINE_APPLY_TOKENS and self._apply_lock.acquire(blocking=False):
                    try:
                        self._apply_locked(batches, last_seq)
                    finally:
                        self._apply_lock.release()
                else:
                    await asyncio.to_thread(self._apply, batches, last_seq)
                self.pending = pending
                self.stream_last = max(self.stream_last, last_seq + pending)
                self._applied.set()
                self._applied = asyncio.Event()
                await acker.applied(last_msg, len(msgs))
            if out_of_order:
                sub = await self._drop(sub)
            self._update_ready()

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
            info = await self._js.stream_info(self.stream_name)
        except Exception:  # noqa: BLE001
            return False
        if info.state.first_seq <= last_seq + 1:
            return False
        self._gap(f"retention gap: expected log message {last_seq + 1}, the log's next is {seq}: "
                  f"messages {last_seq + 1}..{seq - 1} are lost")
        return True

    def _apply(self, batches, last_seq: int) -> None:
        with self._apply_lock:
            self._apply_locked(batches, last_seq)

    def _apply_locked(self, batches, last_seq: int) -> None:
        self.applier.apply(batches)
        self.applied_seq = last_seq
        now = time.time_ns()
        for b in batches:
            if b.t_ns:
                self.lags_ms.append((now - b.t_ns) / 1e6)
                self.lag_count += 1
                self._last_commit_ns = max(self._last_commit_ns, b.t_ns)
                if self.metrics is not None:
                    self.metrics.visible.observe((now - b.t_ns) / 1e9)

    # ------------------------------------------------------------------ the stream's health

    async def _watch_stream(self) -> bool:
        """True if this replica's position changed (the stream was lost or recreated): ``recovery``."""
        return await watch_stream(self)

    def _update_ready(self) -> None:
        if not self.stream_ok:
            self.state.ready = False
            self.state.not_ready_reason = "commit log stream lost: recovering (see GET /v1/replication)"
            return
        if not self.bootstrapped:
            return
        ready = 0 <= self.pending <= self.config.ready_lag
        self.state.not_ready_reason = "" if ready else (
            f"replica catching up: {self.pending} log messages behind (ready at {self.config.ready_lag})")
        self.state.ready = ready

    # ------------------------------------------------------------------ snapshots

    def _position(self) -> tuple[int, str]:
        return self.applied_seq, self.incarnation  # read under the applier's lock

    async def _written(self, rec: SnapshotRecord) -> set[str]:
        """Records a new snapshot in the KV bucket; returns what garbage collection must keep."""
        if self.metrics is not None:
            self.metrics.snapshot_seconds.observe(self.writer.last_duration_s)
            self.metrics.snapshot_pause.observe(self.writer.last_pause_s)
        if self._kv is not None and self._nc is not None and self._nc.is_connected:
            await self._record(rec)
        return {d for d in (self.base, self.writer.dir) if d}

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            if self.stream_ok and self.writer.due(self.applied_seq, self.incarnation):
                try:
                    await self.writer.write(self._position, self._written)
                except Exception:  # noqa: BLE001 - counted and logged by the writer; applying goes on
                    pass

    async def _record(self, rec: SnapshotRecord) -> None:
        try:
            try:
                cur = SnapshotRecord.from_json((await self._kv.get(LATEST)).value)
            except nats.js.errors.KeyNotFoundError:
                cur = None
            if cur is None or cur.incarnation != rec.incarnation or cur.seq < rec.seq:
                await self._kv.put(LATEST, rec.to_json())
        except Exception as e:  # noqa: BLE001 - the blob store still lists it
            log.warning("could not record snapshot %d in the KV bucket (%s)", rec.seq, e)

    async def snapshot(self) -> dict[str, str]:
        """An on-demand snapshot (POST /v1/snapshot) of the applied state: namespace -> blob."""
        if not self.bootstrapped:
            raise RuntimeError("the replica has not bootstrapped yet")
        rec = await self.writer.write(self._position, self._written)
        d = rec.dir if rec is not None else self.writer.dir
        return {ns: f"{self.blobs.root}/{d}/{ns}.ngc" for ns in self.state.specs}

    # ------------------------------------------------------------------ read-your-writes

    async def wait_visible(self, timeout: float) -> int:
        """Read-your-writes (``BatchPut(synchronize=True)``): see ``visibility.wait_visible``."""
        return await wait_visible(self, timeout)

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

    def lag_seconds(self) -> float:
        return lag_seconds(self)

    def status(self, with_digest: bool = False) -> dict:
        return status(self, with_digest)


class _Inbox:
    """A subscription's delivered messages, appended by its callback: the apply loop takes all that
    arrived at once. (``next_msg`` would cost two asyncio tasks per message in nats-py 2.16, on the
    loop that serves lookups.) Bounded by the consumer: the broker stops at ``MAX_UNAPPLIED``
    unacknowledged messages."""

    def __init__(self) -> None:
        self.msgs: deque = deque()
        self._arrived = asyncio.Event()

    async def put(self, msg) -> None:
        self.msgs.append(msg)
        self._arrived.set()

    async def take(self, timeout: float, limit: int) -> list:
        """Up to ``limit`` messages, waiting at most ``timeout`` s for the first (TimeoutError)."""
        if not self.msgs:
            self._arrived.clear()
            async with asyncio.timeout(timeout):
                await self._arrived.wait()
        n = min(limit, len(self.msgs))
        return [self.msgs.popleft() for _ in range(n)]


class _Acker:
    """Acknowledges applied messages (AckAll) every ``ACK_EVERY_MSGS`` messages or ``ACK_EVERY_S``
    seconds, and when the log goes idle. An unacknowledged applied message costs nothing but its
    redelivery after a reconnect, which the sequence check skips."""

    def __init__(self) -> None:
        self._last = None  # the newest applied message not acknowledged yet
        self._count = 0
        self._since = time.monotonic()

    async def applied(self, msg, n: int) -> None:
        self._last = msg
        self._count += n
        if self._count >= ACK_EVERY_MSGS or time.monotonic() - self._since >= ACK_EVERY_S:
            await self.flush()

    async def flush(self) -> None:
        msg, self._last, self._count, self._since = self._last, None, 0, time.monotonic()
        if msg is not None:
            try:
                await msg.ack()
            except Exception:  # noqa: BLE001 - an unacknowledged message is redelivered and skipped
                pass
