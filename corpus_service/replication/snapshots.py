"""Snapshots tagged with the stream position they cover, in the blob store, recorded in a KV bucket.

    snapshots/TAG-SEQ-REPLICA/NS.ngc       NgramCorpus.save of namespace NS after applying messages
                                           1..SEQ of the stream incarnation TAG names
    snapshots/TAG-SEQ-REPLICA/record.json  {"seq", "incarnation", "namespaces": {NS: KEY}, "replica",
                                           "time", "bytes"}; written last: a record means a complete snapshot
    KV BUCKET["latest"]                    the newest record (where a new replica starts)

A snapshot is taken between two applied messages, so it holds exactly messages 1..SEQ; loading it
and replaying SEQ+1.. gives every other replica's state. It is written by a forked child
(``fork_snapshot``): the replica pauses for the fork only and goes on applying while the child
writes. Records older than incarnations (``snapshots/SEQ-REPLICA``) are still read. Garbage
collection runs across replica ids (each restart is a new id): the newest ``keep`` snapshots stay,
older ones and those older than ``max_age_s`` go, except the ones the stream still needs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from corpus_service._native import fork_snapshot
from corpus_service.replication.blobstore import FileBlobStore
from corpus_service.server.state import ServiceState

log = logging.getLogger("corpus_service.replication")
LATEST = "latest"
STALE_PARTIAL_S = 3600.0  # a snapshot directory without a record this old was left by a dead writer


@dataclass(slots=True)
class SnapshotRecord:
    seq: int
    namespaces: dict[str, str] = field(default_factory=dict)  # namespace -> blob key
    replica: str = ""
    time: float = 0.0
    bytes: int = 0
    incarnation: str = ""  # the stream incarnation ``seq`` counts in ("" = written before incarnations)
    dir: str = ""  # its directory in the blob store

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "SnapshotRecord":
        d = json.loads(data)
        return cls(int(d["seq"]), dict(d.get("namespaces", {})), str(d.get("replica", "")),
                   float(d.get("time", 0.0)), int(d.get("bytes", 0)), str(d.get("incarnation", "")),
                   str(d.get("dir", "")))


def snapshot_dir(seq: int, replica: str, incarnation: str) -> str:
    tag = hashlib.sha256(incarnation.encode()).hexdigest()[:12]
    return f"snapshots/{tag}-{seq:020d}-{replica}"


@dataclass(slots=True)
class PendingSnapshot:
    """A snapshot whose writer runs: the forked child's pid and error pipe, and what it writes."""
    record: SnapshotRecord
    pid: int
    error_fd: int
    pause_s: float  # how long applying and drafting were held for the fork
    files: dict[str, Path]  # namespace -> the file the child writes
    tmp: str | None  # a local directory to upload from (object stores)
    started: float


class Snapshots:
    def __init__(self, blobs: FileBlobStore, replica: str) -> None:
        self.blobs, self.replica = blobs, replica

    # ------------------------------------------------------------------ writing

    def start(self, state: ServiceState, seq: int, incarnation: str) -> PendingSnapshot:
        """Forks the writer of every namespace as of ``seq``; the caller holds the applier (nothing
        applies during the fork) and calls ``finish`` (blocking) off the event loop."""
        d = snapshot_dir(seq, self.replica, incarnation)
        rec = SnapshotRecord(seq, replica=self.replica, time=time.time(), incarnation=incarnation, dir=d)
        tmp = None
        files = {}
        for ns in sorted(state.specs):
            key = f"{d}/{ns}.ngc"
            path = self.blobs.write_path(key)
            if path is None:  # an object store: the child writes locally, finish uploads
                tmp = tmp or tempfile.mkdtemp(prefix="ngram-snapshot-")
                path = Path(tmp) / f"{ns}.ngc"
            files[ns] = path
            rec.namespaces[ns] = key
        natives = [state.corpus(ns)._native for ns in files]  # the engine objects the child serializes
        t0 = time.monotonic()
        try:
            pid, fd, pause = fork_snapshot(natives, [os.fspath(p) for p in files.values()])
        except BaseException:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return PendingSnapshot(rec, pid, fd, pause, files, tmp, t0)

    def finish(self, p: PendingSnapshot) -> SnapshotRecord:
        """Waits for the writer, uploads (object stores), writes the record. OSError says why not."""
        try:
            _, status = os.waitpid(p.pid, 0)
            with os.fdopen(p.error_fd, "rb") as f:
                why = f.read().decode(errors="replace")
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                raise OSError(f"snapshot writer exited with {code}: {why or 'no message (killed?)'}")
            for ns, path in p.files.items():
                if p.tmp is not None:
                    p.record.bytes += self.blobs.put_file(p.record.namespaces[ns], path)
                else:
                    p.record.bytes += path.stat().st_size
            self.blobs.put_bytes(f"{p.record.dir}/record.json", p.record.to_json())
            return p.record
        finally:
            if p.tmp:
                shutil.rmtree(p.tmp, ignore_errors=True)

    def write(self, state: ServiceState, seq: int, incarnation: str = "") -> SnapshotRecord:
        """``start`` + ``finish`` (tests, benchmarks, tools); the caller holds the applier."""
        return self.finish(self.start(state, seq, incarnation))

    # ------------------------------------------------------------------ reading

    def records(self) -> list[SnapshotRecord]:
        """Complete snapshots in the blob store, newest first."""
        out = []
        for key in self.blobs.list("snapshots"):
            if key.endswith("/record.json"):
                try:
                    rec = SnapshotRecord.from_json(self.blobs.read_bytes(key))
                except (OSError, ValueError, KeyError) as e:
                    log.error("snapshot record %s is unreadable (%s); skipped", key, e)
                    continue
                rec.dir = key[:-len("/record.json")]
                out.append(rec)
        return sorted(out, key=lambda r: (r.time, r.seq), reverse=True)

    def record_at(self, directory: str) -> SnapshotRecord:
        """The record of the snapshot in ``directory``; FileNotFoundError/ValueError if it is not there."""
        rec = SnapshotRecord.from_json(self.blobs.read_bytes(f"{directory}/record.json"))
        rec.dir = directory
        return rec

    def load(self, state: ServiceState, rec: SnapshotRecord) -> None:
        """Replaces every namespace's learned and external corpora with the snapshot's."""
        for ns in sorted(state.specs):
            key = rec.namespaces.get(ns)
            corpus = state.corpus(ns)
            if key is None:
                log.warning("snapshot at seq %d has no namespace '%s'; it starts empty", rec.seq, ns)
                corpus.reset()
                continue
            path = self.blobs.local_path(key)
            if path is not None:
                corpus.load(path)
                continue
            with tempfile.TemporaryDirectory(prefix="ngram-snapshot-") as tmp:
                local = Path(tmp) / f"{ns}.ngc"
                self.blobs.get_file(key, local)  # FileNotFoundError names the key
                corpus.load(local)

    # ------------------------------------------------------------------ garbage collection

    def collect(self, keep: int, max_age_s: float, protect: set[str]) -> list[str]:
        """Deletes snapshots of every replica id beyond the newest ``keep``, and those older than
        ``max_age_s`` (0 = no age limit) but the newest; never one in ``protect`` (directories the
        stream still needs). Also removes directories a dead writer left without a record.
        Returns the deleted directories."""
        recs = self.records()
        now = time.time()
        gone = []
        for i, rec in enumerate(recs):
            if rec.dir in protect or i == 0:
                continue
            if i >= keep or (max_age_s and now - rec.time > max_age_s):
                self.blobs.delete_prefix(rec.dir)
                gone.append(rec.dir)
        complete = {r.dir for r in recs}
        for d in self.blobs.dirs("snapshots") if isinstance(self.blobs, FileBlobStore) else []:
            if d not in complete and self.blobs.age_s(d) > STALE_PARTIAL_S:
                self.blobs.delete_prefix(d)
                gone.append(d)
        if gone:
            log.info("snapshots garbage-collected: %s", ", ".join(gone))
        return gone
