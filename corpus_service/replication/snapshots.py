"""Snapshots tagged with the stream sequence they cover, in the blob store, recorded in a KV bucket.

    snapshots/SEQ-REPLICA/NS.ngc       NgramCorpus.save of namespace NS after applying messages 1..SEQ
    snapshots/SEQ-REPLICA/record.json  {"seq", "namespaces": {NS: KEY}, "replica", "time", "bytes"};
                                       written last, so a record means a complete snapshot
    KV BUCKET["latest"]                the newest record (where a new replica starts)

A replica takes a snapshot between two applied messages (the applier thread does it), so a snapshot
at SEQ holds exactly messages 1..SEQ; loading it and replaying SEQ+1.. gives every other replica's
state. Each replica writes its own directories (two replicas may snapshot the same sequence) and
keeps its newest ``KEEP``.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from corpus_service.replication.blobstore import FileBlobStore
from corpus_service.service_state import ServiceState

log = logging.getLogger("corpus_service.replication")
KEEP = 3
LATEST = "latest"


@dataclass(slots=True)
class SnapshotRecord:
    seq: int
    namespaces: dict[str, str] = field(default_factory=dict)  # namespace -> blob key
    replica: str = ""
    time: float = 0.0
    bytes: int = 0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "SnapshotRecord":
        d = json.loads(data)
        return cls(int(d["seq"]), dict(d.get("namespaces", {})), str(d.get("replica", "")),
                   float(d.get("time", 0.0)), int(d.get("bytes", 0)))


def _dir(seq: int, replica: str) -> str:
    return f"snapshots/{seq:020d}-{replica}"


class Snapshots:
    def __init__(self, blobs: FileBlobStore, replica: str) -> None:
        self.blobs, self.replica = blobs, replica

    def write(self, state: ServiceState, seq: int) -> SnapshotRecord:
        """Saves every namespace as of ``seq`` (the caller holds the applier: nothing else applies)."""
        rec = SnapshotRecord(seq, replica=self.replica, time=time.time())
        for ns in sorted(state.specs):
            key = f"{_dir(seq, self.replica)}/{ns}.ngc"
            path = self.blobs.write_path(key)
            if path is not None:
                state.corpus(ns).save(path)  # atomic (tmp + rename) in the engine
                rec.bytes += path.stat().st_size
            else:  # an object store: save locally, upload
                with tempfile.TemporaryDirectory(prefix="ngram-snapshot-") as tmp:
                    local = Path(tmp) / f"{ns}.ngc"
                    state.corpus(ns).save(local)
                    rec.bytes += self.blobs.put_file(key, local)
            rec.namespaces[ns] = key
        self.blobs.put_bytes(f"{_dir(seq, self.replica)}/record.json", rec.to_json())
        self.prune()
        return rec

    def records(self) -> list[SnapshotRecord]:
        """Complete snapshots in the blob store, newest first."""
        out = []
        for key in self.blobs.list("snapshots"):
            if key.endswith("/record.json"):
                try:
                    out.append(SnapshotRecord.from_json(self.blobs.read_bytes(key)))
                except (OSError, ValueError, KeyError) as e:
                    log.error("snapshot record %s is unreadable (%s); skipped", key, e)
        return sorted(out, key=lambda r: r.seq, reverse=True)

    def prune(self) -> None:
        mine = [r for r in self.records() if r.replica == self.replica]
        for rec in mine[KEEP:]:
            self.blobs.delete_prefix(_dir(rec.seq, rec.replica))

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
