"""The external corpora of every namespace as operators see them: uploads (durable, rebuilt after
a restart), corpora loaded over gRPC (kept by snapshots), deletions, and snapshots themselves."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator

from corpus_service.jobs import Job, Jobs, new_job_id
from corpus_service.persistence import ACKNOWLEDGED, DELETED, READY, DataDir, Manifest, fsync_dir
from corpus_service.service_state import ServiceState
from corpus_service.tokenizer import Tokenizers
from corpus_service.uploads import UploadError, UploadSink

log = logging.getLogger("corpus_service.catalog")


class CorpusConflict(ValueError):
    """The name is taken (-> 409)."""


class Catalog:
    def __init__(self, state: ServiceState, data: DataDir, persistent: bool) -> None:
        self.state, self.data, self.persistent = state, data, persistent
        self.tokenizers = Tokenizers({n: s.tokenizer for n, s in state.specs.items()})
        self.jobs = Jobs(state, data, self.tokenizers)
        self._names_lock = threading.Lock()  # reserves names between "is it free?" and the manifest
        self._reserved: set[tuple[str, str]] = set()
        self._snapshot_lock = asyncio.Lock()
        self.replication = None  # replicated (--log): the Replica publishes uploads, deletions; snapshots

    # ------------------------------------------------------------------ start-up

    def restore(self) -> None:
        """Loads snapshots, applies tombstones, and queues builds of uploads the snapshots lack."""
        self.data.clean_incoming()
        for ns in self.state.specs:
            corpus = self.state.corpus(ns)
            if self.persistent:
                err = self.data.restore(ns, corpus)
                if err:
                    self.state.snapshot_errors[ns] = err
            loaded = corpus.list_external_corpora()
            for m in self.data.manifests(ns):
                if m.state == DELETED:
                    if m.name in loaded:
                        corpus.remove_external_corpus(m.name)
                elif m.state in (ACKNOWLEDGED, READY) and m.name not in loaded:
                    log.info("rebuilding uploaded corpus '%s/%s' (%s, acknowledged but not in the snapshot)",
                             ns, m.name, m.state)
                    m.job_id = new_job_id()
                    self.jobs.submit(m)

    # ------------------------------------------------------------------ uploads

    async def upload(self, namespace: str, name: str, fmt: str, chunks: AsyncIterator[bytes]) -> Job:
        """Streams an upload to disk, checks it, fsyncs it, records the manifest, queues the build.
        Returns once the upload is durable (the 202 acknowledgement)."""
        corpus = self.state.corpus(namespace)
        key = (namespace, name)
        with self._names_lock:
            if key in self._reserved or self._taken(namespace, name):
                raise CorpusConflict(f"corpus '{name}' already exists in namespace '{namespace}'; delete it first")
            self._reserved.add(key)
        try:
            job_id = new_job_id()
            incoming = self.data.incoming_path(namespace, name, job_id)
            sink = UploadSink(incoming, fmt, self.state.config.max_upload_bytes, corpus.config.vocab_size,
                              self.tokenizers.has(namespace))
            try:
                async for chunk in chunks:
                    if chunk:
                        await asyncio.to_thread(sink.write, chunk)
                        self.state.metrics.upload_bytes.inc(len(chunk))
                await asyncio.to_thread(sink.close)
            except BaseException:
                sink.discard()
                raise
            old = self.data.manifest(namespace, name)
            if old is not None and old.state == DELETED and self.persistent:
                # The last snapshot may still hold the deleted corpus of this name; a restart would
                # take it for this upload. A fresh snapshot retires the tombstone first.
                await self.snapshot()
            manifest = Manifest(namespace, name, fmt, sink.bytes, ACKNOWLEDGED, job_id)
            await asyncio.to_thread(self._acknowledge, incoming, manifest)
            job = self.jobs.submit(manifest)
            if self.replication is not None:
                await self.replication.publish_upload(manifest)
            return job
        finally:
            with self._names_lock:
                self._reserved.discard(key)

    def _acknowledge(self, incoming, manifest: Manifest) -> None:
        os.replace(incoming, self.data.data_path(manifest.namespace, manifest.name))
        fsync_dir(incoming.parent)
        self.data.write_manifest(manifest)

    def _taken(self, namespace: str, name: str) -> bool:
        if name in self.state.corpus(namespace).list_external_corpora():
            return True
        if self.state.corpus(namespace).is_loading_external_corpus(name):
            return True
        m = self.data.manifest(namespace, name)
        return m is not None and m.state != DELETED

    # ------------------------------------------------------------------ inspection, deletion

    def list(self, namespace: str) -> list[dict]:
        corpus = self.state.corpus(namespace)
        loaded = corpus.list_external_corpora()
        out: dict[str, dict] = {n: {"name": n, "namespace": namespace, "state": READY, "tokens": t, "source": "grpc"}
                                for n, t in loaded.items()}
        for m in self.data.manifests(namespace):
            if m.state == DELETED:
                continue
            entry = {"name": m.name, "namespace": namespace, "state": m.state, "tokens": loaded.get(m.name, m.tokens),
                     "source": "upload", "format": m.format, "bytes": m.bytes, "job_id": m.job_id,
                     "created_at": m.created_at, "error": m.error}
            job = self.jobs.active(namespace, m.name)
            if job is not None:
                entry["state"], entry["job_id"] = "building", job.id
            out[m.name] = entry
        return [out[k] for k in sorted(out)]

    def get(self, namespace: str, name: str) -> dict:
        for entry in self.list(namespace):
            if entry["name"] == name:
                return entry
        raise KeyError(f"no corpus '{name}' in namespace '{namespace}'")

    async def delete(self, namespace: str, name: str) -> None:
        corpus = self.state.corpus(namespace)
        m = self.data.manifest(namespace, name)
        loaded = name in corpus.list_external_corpora()
        if not loaded and (m is None or m.state == DELETED):
            raise KeyError(f"no corpus '{name}' in namespace '{namespace}'")
        if m is not None:
            self.jobs.cancel(namespace, name)
            m.state = DELETED
            await asyncio.to_thread(self.data.write_manifest, m)  # the tombstone first: crash-safe
            self.data.data_path(namespace, name).unlink(missing_ok=True)
        if loaded:
            await self.state.run(corpus.remove_external_corpus, name)
        if self.replication is not None:
            self.replication.publish_remove(namespace, name)

    # ------------------------------------------------------------------ snapshots

    async def snapshot(self) -> dict[str, str]:
        """Saves every namespace; tombstones older than the snapshot are then dropped."""
        if self.replication is not None:  # tagged with the log position, in the blob store
            return await self.replication.snapshot()
        if not self.persistent:
            raise RuntimeError("no --data-dir: snapshots are disabled")
        async with self._snapshot_lock:
            done = {}
            for ns in self.state.specs:
                # A tombstone may go once the snapshot cannot hold its corpus: one still loaded
                # now (a delete between its tombstone and its removal) may be in this snapshot,
                # and dropping its tombstone would bring the deleted corpus back after a restart.
                loaded = set(self.state.corpus(ns).list_external_corpora())
                tombstones = [m.name for m in self.data.manifests(ns) if m.state == DELETED and m.name not in loaded]
                try:
                    path = await self.state.run(self.data.save, ns, self.state.corpus(ns))
                except Exception:
                    self.state.metrics.snapshots.labels(ns, "error").inc()
                    raise
                self.state.metrics.snapshots.labels(ns, "ok").inc()
                for name in tombstones:
                    self.data.drop_upload(ns, name)
                done[ns] = str(path)
            return done
