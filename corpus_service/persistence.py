"""The data directory: snapshots of each namespace's engine and the manifests of uploaded corpora.

    DATA_DIR/snapshots/NS.ngc          NgramCorpus.save (atomic, versioned, checksummed)
    DATA_DIR/uploads/NS/NAME.data      an acknowledged upload, byte for byte
    DATA_DIR/uploads/NS/NAME.json      its manifest (state, format, sizes, job, error)

An upload is acknowledged only after its data file and manifest are fsync'd and renamed into
place (and the directory fsync'd), so it survives kill -9. Uploaded corpora are rebuilt from their
data file when a restart finds them missing from the restored snapshot. A deleted corpus keeps a
tombstone manifest until a snapshot without it has been written, so an older snapshot cannot bring
it back. A corrupt snapshot is reported and moved aside (``*.corrupt-TIMESTAMP``), never half-loaded.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from corpus_service.exceptions import CorruptSnapshotError
from corpus_service.namespaces import check_namespace_name

log = logging.getLogger("corpus_service.persistence")

# Manifest states.
ACKNOWLEDGED = "acknowledged"  # data durable, corpus not built yet (or being built)
READY = "ready"  # built and committed in the engine
FAILED = "failed"  # the build failed; the error says why
DELETED = "deleted"  # tombstone until the next snapshot


def check_corpus_name(name: object) -> str:
    """Corpus names become file names here: the namespace rule (no '/', no leading '.')."""
    try:
        return check_namespace_name(name)
    except ValueError:
        raise ValueError(f"corpus name: expected 1-64 characters of letters, digits, '_', '.', '-' "
                         f"(not starting with a symbol), got {name!r:.80}") from None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Writes a small file atomically and durably: tmp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


@dataclass(slots=True)
class Manifest:
    namespace: str
    name: str
    format: str
    bytes: int
    state: str = ACKNOWLEDGED
    job_id: str = ""
    created_at: float = field(default_factory=time.time)
    tokens: int = 0
    documents: int = 0
    error: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Manifest":
        return cls(**{k: data[k] for k in cls.__slots__ if k in data})


class DataDir:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.snapshots = self.root / "snapshots"
        self.uploads = self.root / "uploads"
        for d in (self.root, self.snapshots, self.uploads):
            d.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ snapshots

    def snapshot_path(self, namespace: str) -> Path:
        return self.snapshots / f"{namespace}.ngc"

    def restore(self, namespace: str, corpus) -> str | None:
        """Loads the namespace's snapshot if there is one. Returns the error if it was refused."""
        path = self.snapshot_path(namespace)
        if not path.exists():
            return None
        try:
            corpus.load(path)
        except CorruptSnapshotError as e:
            aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
            os.replace(path, aside)
            msg = f"snapshot {path} refused ({e}); moved to {aside.name}, namespace '{namespace}' starts empty"
            log.error(msg)
            return msg
        log.info("restored namespace '%s' from %s", namespace, path)
        return None

    def save(self, namespace: str, corpus) -> Path:
        path = self.snapshot_path(namespace)
        corpus.save(path)
        fsync_dir(path.parent)
        return path

    # ------------------------------------------------------------------ uploads

    def upload_dir(self, namespace: str) -> Path:
        d = self.uploads / namespace
        d.mkdir(parents=True, exist_ok=True)
        return d

    def data_path(self, namespace: str, name: str) -> Path:
        return self.upload_dir(namespace) / f"{name}.data"

    def incoming_path(self, namespace: str, name: str, job_id: str) -> Path:
        return self.upload_dir(namespace) / f".{name}.{job_id}.incoming"

    def write_manifest(self, m: Manifest) -> None:
        write_durable(self.upload_dir(m.namespace) / f"{m.name}.json", json.dumps(asdict(m)).encode())

    def manifests(self, namespace: str) -> list[Manifest]:
        out = []
        for path in sorted(self.upload_dir(namespace).glob("*.json")):
            try:
                out.append(Manifest.from_json(json.loads(path.read_text())))
            except (ValueError, TypeError, KeyError) as e:
                log.error("manifest %s is unreadable (%s); skipped", path, e)
        return out

    def manifest(self, namespace: str, name: str) -> Manifest | None:
        path = self.upload_dir(namespace) / f"{name}.json"
        if not path.exists():
            return None
        return Manifest.from_json(json.loads(path.read_text()))

    def drop_upload(self, namespace: str, name: str) -> None:
        """Removes the data file and manifest (after a snapshot made the tombstone unnecessary)."""
        d = self.upload_dir(namespace)
        for path in (d / f"{name}.data", d / f"{name}.json"):
            path.unlink(missing_ok=True)
        fsync_dir(d)

    def clean_incoming(self) -> None:
        """Partial uploads never acknowledged (the server died mid-upload) are discarded."""
        for path in self.uploads.glob("*/.*.incoming"):
            log.warning("discarding unacknowledged partial upload %s", path)
            path.unlink(missing_ok=True)
