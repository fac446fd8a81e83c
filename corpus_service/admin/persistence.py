"""The data directory: snapshots of each namespace's engine and the manifests of uploaded corpora.

    DATA_DIR/snapshots/NS.ngc          NgramCorpus.save (atomic, versioned, checksummed)
    DATA_DIR/uploads/NS/NAME.data      an acknowledged upload, byte for byte
    DATA_DIR/uploads/NS/NAME.json      its manifest (state, format, sizes, job, error)

An upload is acknowledged only after its data file and manifest are fsync'd and renamed into
place (and the directory fsync'd), so it survives kill -9. Uploaded corpora are rebuilt from their
data file when a restart finds them missing from the restored snapshot. A deleted corpus keeps a
tombstone manifest until a snapshot without it has been written, so an older snapshot cannot bring
it back. A corrupt snapshot is reported and moved aside (``*.corrupt-TIMESTAMP``), never half-loaded.
A manifest that does not parse, or a data file whose size is not the manifest's, is reported as a
``damaged`` corpus (never skipped: an acknowledged upload must not vanish without a word).

    DATA_DIR/ngram-corpus.lock         held (flock) by the one server using the directory

Two servers writing one directory would overwrite each other's snapshots and manifests: the server
takes an exclusive lock at start (``DataDir.lock``) and refuses to start when another holds it. The
kernel releases the lock when its process ends, however it ends (kill -9 leaves no stale lock).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from corpus_service.exceptions import CorruptSnapshotError
from corpus_service.names import is_valid_name

log = logging.getLogger("corpus_service.persistence")

# Manifest states.
ACKNOWLEDGED = "acknowledged"  # data durable, corpus not built yet (or being built)
READY = "ready"  # built and committed in the engine
FAILED = "failed"  # the build failed; the error says why
DELETED = "deleted"  # tombstone until the next snapshot
DAMAGED = "damaged"  # never written: an unreadable manifest, or a data file that is not the manifest's


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Writes a small file atomically and durably: tmp file, fsync, rename, fsync the directory.
    The tmp file is unique per writer (two writers of one name must not share it) and removed if
    anything fails; leftovers of a crash are hidden ('.'-prefixed) and removed at start."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
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
    source: str = "upload"  # 'upload' (REST) or 'grpc' (LoadExternalCorpus + CommitExternalCorpus)
    # The last snapshot may hold an older corpus of this name (a replacement, a load over an old
    # name): a restart rebuilds from the data file instead of trusting the snapshot. Cleared by
    # the next snapshot taken after the build.
    stale_in_snapshot: bool = False

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Manifest":
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object, got {type(data).__name__}")
        m = cls(**{k: data[k] for k in cls.__slots__ if k in data})
        if not isinstance(m.name, str) or not isinstance(m.bytes, int) or m.state not in _STATES:
            raise ValueError("fields of the wrong type or an unknown state")
        return m

    @classmethod
    def damaged(cls, namespace: str, name: str, reason: str) -> "Manifest":
        return cls(namespace, name, "", 0, DAMAGED, error=reason)


_STATES = (ACKNOWLEDGED, READY, FAILED, DELETED)
LOCK_NAME = "ngram-corpus.lock"
# Descriptors of held locks. A forked child (a replica's snapshot writer) shares them, and a flock lasts
# until every descriptor of it is closed: the child closes its copies at once, so a server killed
# while a child runs does not leave its directory locked behind it.
_HELD_LOCKS: set[int] = set()


def _drop_locks_in_child() -> None:
    for fd in _HELD_LOCKS:
        try:
            os.close(fd)  # the parent's descriptor keeps the lock
        except OSError:
            pass
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_drop_locks_in_child)


class DataDirInUse(RuntimeError):
    """Another process holds the data directory's lock."""


class DataDir:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.snapshots = self.root / "snapshots"
        self.uploads = self.root / "uploads"
        self._lock_fd: int | None = None
        for d in (self.root, self.snapshots, self.uploads):
            d.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ the lock

    def lock(self) -> None:
        """Takes the directory's exclusive lock for this process (until ``unlock`` or its end);
        ``DataDirInUse`` naming the holder's pid when another process has it."""
        if self._lock_fd is not None:
            return
        path = self.root / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            try:
                holder = path.read_text().strip() or "unknown"
            except OSError:
                holder = "unknown"
            raise DataDirInUse(f"data directory {self.root} is in use by another ngram-corpus server (pid {holder}); "
                               "stop it, or give this one another --data-dir (NGRAM_CORPUS_DATA_DIR)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        _HELD_LOCKS.add(fd)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            _HELD_LOCKS.discard(self._lock_fd)
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

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
            log.error("snapshot %s refused (%s); moved to %s, namespace '%s' starts empty", path, e, aside.name, namespace)
            # What the API shows (GET /v1/namespaces/NS) names files, never the server's paths.
            why = str(e).replace(str(path), path.name)  # the engine's message names the file it read
            return f"snapshot {path.name} refused ({why}); moved to {aside.name}, namespace '{namespace}' starts empty"
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
        """Every manifest of the namespace; an unreadable one as a ``damaged`` entry."""
        out = []
        for path in sorted(self.upload_dir(namespace).glob("*.json")):
            name = path.name[:-len(".json")]
            if not is_valid_name(name):  # not written by this service: no API name could reach it
                log.warning("ignoring %s: not a corpus manifest name", path)
                continue
            m = self._read_manifest(namespace, name, path)
            if m is not None:
                out.append(m)
        return out

    def manifest(self, namespace: str, name: str) -> Manifest | None:
        """The manifest of ``name`` (``damaged`` if unreadable), or None."""
        return self._read_manifest(namespace, name, self.upload_dir(namespace) / f"{name}.json")

    def _read_manifest(self, namespace: str, name: str, path: Path) -> Manifest | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            return Manifest.damaged(namespace, name, f"manifest unreadable ({e.strerror})")
        try:
            m = Manifest.from_json(json.loads(data))
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            reason = "empty" if not data else f"truncated or not a manifest ({len(data)} bytes; {type(e).__name__})"
            return Manifest.damaged(namespace, name, f"manifest {reason}")
        if m.namespace != namespace or m.name != name:
            return Manifest.damaged(namespace, name, f"manifest names another corpus ({m.namespace!r:.80}/{m.name!r:.80})")
        return m

    def data_damage(self, m: Manifest) -> str:
        """Why the data file of a live manifest cannot rebuild its corpus ("" if it can)."""
        if m.state in (DELETED, DAMAGED):
            return ""
        try:
            size = self.data_path(m.namespace, m.name).stat().st_size
        except FileNotFoundError:
            return "data file missing"
        if size != m.bytes:
            return f"data file holds {size} bytes, the manifest {m.bytes} (truncated or overwritten)"
        return ""

    def drop_upload(self, namespace: str, name: str) -> None:
        """Removes the data file and manifest (after a snapshot made the tombstone unnecessary)."""
        d = self.upload_dir(namespace)
        for path in (d / f"{name}.data", d / f"{name}.json"):
            path.unlink(missing_ok=True)
        fsync_dir(d)

    def clean_incoming(self) -> None:
        """Partial uploads never acknowledged (the server died mid-upload) and the tmp files of
        interrupted manifest writes are discarded."""
        for path in self.uploads.glob("*/.*.incoming"):
            log.warning("discarding unacknowledged partial upload %s", path)
            path.unlink(missing_ok=True)
        for path in self.uploads.glob("*/.*.tmp"):
            path.unlink(missing_ok=True)
