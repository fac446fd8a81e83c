"""Blobs every replica can read: snapshots (tagged with the stream sequence) and uploaded corpora.

``FileBlobStore`` is a directory (a shared volume: a host directory for docker-compose, a
ReadWriteMany PVC on Kubernetes); a blob appears atomically (temporary name, fsync, rename), so a
reader never sees half of one. ``NatsObjectBlobStore`` (``--blob-store nats-object://BUCKET``) keeps
them in a JetStream object store on the same broker, for replicas without a shared volume. Keys are
relative paths of safe segments.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import shutil
import time
from pathlib import Path

from corpus_service.admin.persistence import fsync_dir

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def check_key(key: str) -> str:
    parts = key.split("/") if isinstance(key, str) else [None]
    if not all(isinstance(p, str) and _SEGMENT.match(p) for p in parts):
        raise ValueError(f"blob key: expected '/'-separated segments of letters, digits, '_', '.', '-', got {key!r:.120}")
    return key


class FileBlobStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put_file(self, key: str, src: str | os.PathLike[str]) -> int:
        """Copies a local file in as blob KEY; returns its size."""
        dst = self.path(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        with open(src, "rb") as f, open(tmp, "wb") as g:
            shutil.copyfileobj(f, g, 1 << 20)
            g.flush()
            os.fsync(g.fileno())
        os.replace(tmp, dst)
        fsync_dir(dst.parent)
        return dst.stat().st_size

    def get_file(self, key: str, dst: str | os.PathLike[str]) -> int:
        """Copies blob KEY to a local file; FileNotFoundError names the key if it is missing."""
        src = self.path(key)
        if not src.is_file():
            raise FileNotFoundError(f"blob '{key}' is not in the blob store {self.root}")
        tmp = Path(dst).with_name(Path(dst).name + ".tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
        return Path(dst).stat().st_size

    def write_path(self, key: str) -> Path:
        """Where a writer that renames into place itself (``NgramCorpus.save``) puts blob KEY."""
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def put_bytes(self, key: str, data: bytes) -> None:
        dst = self.write_path(key)
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dst)
        fsync_dir(dst.parent)

    def read_bytes(self, key: str) -> bytes:
        return self.path(key).read_bytes()

    def local_path(self, key: str) -> Path | None:
        """The blob's own file when it can be read in place (no copy), else None."""
        p = self.path(key)
        return p if p.is_file() else None

    def list(self, prefix: str) -> list[str]:
        base = self.path(prefix)
        if not base.is_dir():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file() and not p.name.startswith("."))

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self.path(prefix), ignore_errors=True)

    def dirs(self, prefix: str) -> list[str]:
        """The directories right under ``prefix``, as keys."""
        base = self.path(prefix)
        return sorted(f"{prefix}/{p.name}" for p in base.iterdir() if p.is_dir()) if base.is_dir() else []

    def age_s(self, prefix: str) -> float:
        """Seconds since anything under ``prefix`` was last written (0 if it is gone)."""
        try:
            newest = max((p.stat().st_mtime for p in self.path(prefix).rglob("*")), default=None)
            return time.time() - (newest if newest is not None else self.path(prefix).stat().st_mtime)
        except OSError:
            return 0.0


class NatsObjectBlobStore:
    """Blobs in a JetStream object store bucket. The methods block: they run from worker threads
    (the applier, ``asyncio.to_thread``) and hand the work to the event loop that owns the connection."""

    def __init__(self, bucket: str) -> None:
        if not re.match(r"^[A-Za-z0-9_-]{1,64}$", bucket):
            raise ValueError(f"blob store: expected nats-object://BUCKET with 1-64 letters, digits, '_' or '-', got {bucket!r}")
        self.bucket = bucket
        self.root = f"nats-object://{bucket}"
        self._obs = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def attach(self, js) -> None:
        import nats.js.errors

        try:
            self._obs = await js.object_store(self.bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            self._obs = await js.create_object_store(self.bucket)
        self._loop = asyncio.get_running_loop()

    def _run(self, coro, timeout: float = 600.0):
        if self._obs is None or self._loop is None:
            coro.close()
            raise OSError(f"blob store {self.root}: not connected to the broker yet")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def write_path(self, key: str) -> None:
        return None  # no file to write in place: put_file uploads one

    def put_file(self, key: str, src: str | os.PathLike[str]) -> int:
        with open(src, "rb") as f:
            self._run(self._obs.put(check_key(key), f))
        return os.path.getsize(src)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._run(self._obs.put(check_key(key), data))

    def get_file(self, key: str, dst: str | os.PathLike[str]) -> int:
        import nats.js.errors

        tmp = Path(dst).with_name(Path(dst).name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                self._run(self._obs.get(check_key(key), writeinto=f))
        except nats.js.errors.NotFoundError:
            tmp.unlink(missing_ok=True)
            raise FileNotFoundError(f"blob '{key}' is not in the blob store {self.root}") from None
        os.replace(tmp, dst)
        return Path(dst).stat().st_size

    def read_bytes(self, key: str) -> bytes:
        buf = io.BytesIO()
        self._run(self._obs.get(check_key(key), writeinto=buf))
        return buf.getvalue()

    def local_path(self, key: str) -> None:
        return None

    def list(self, prefix: str) -> list[str]:
        import nats.js.errors

        try:
            infos = self._run(self._obs.list(ignore_deletes=True))
        except nats.js.errors.NotFoundError:
            return []
        return sorted(i.name for i in infos if i.name.startswith(check_key(prefix) + "/"))

    def delete_prefix(self, prefix: str) -> None:
        for name in self.list(prefix):
            self._run(self._obs.delete(name))


def open_blob_store(spec: str | os.PathLike[str]):
    """``nats-object://BUCKET`` or a directory."""
    spec = str(spec)
    if spec.startswith("nats-object://"):
        return NatsObjectBlobStore(spec[len("nats-object://"):])
    return FileBlobStore(spec)
