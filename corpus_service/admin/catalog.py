"""The external corpora of every namespace, one catalog for every surface: REST uploads, gRPC loads
(LoadExternalCorpus + CommitExternalCorpus), deletions from either, atomic replacements, damaged
files, and snapshots. What the engine drafts from, what ``GET /v1/.../corpora`` lists, what the data
directory persists and what ``/v1/integrity`` checks are kept the same here.

Every change of a corpus' manifest and of its visibility in the engine happens under ``lock`` (API
calls, builds, gRPC commits): two DELETEs of one name, or a DELETE and a build's commit, cannot
interleave, so one wins and the other gets a clear 404/409."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from corpus_service.admin.jobs import Job, Jobs, new_job_id
from corpus_service.admin.persistence import ACKNOWLEDGED, DAMAGED, DELETED, READY, DataDir, Manifest, fsync_dir
from corpus_service.admin.uploads import UploadSink
from corpus_service.engine.tokenizer import Tokenizers
from corpus_service.exceptions import AlreadyExistsError, NotFoundError
from corpus_service.server.state import ServiceState

log = logging.getLogger("corpus_service.catalog")


class CorpusConflict(AlreadyExistsError):
    """The name is taken, or another call is writing it (-> 409 / ALREADY_EXISTS)."""


@dataclass
class _GrpcLoad:
    """A gRPC load between its first chunk and its commit: the engine stages the corpus, this
    file keeps its documents (format ``ids``) so a restart can rebuild it once committed."""

    path: Path
    file: object
    job_id: str
    documents: int = 0
    bytes: int = 0


class Catalog:
    def __init__(self, state: ServiceState, data: DataDir, persistent: bool) -> None:
        self.state, self.data, self.persistent = state, data, persistent
        self.tokenizers: Tokenizers = state.tokenizers
        self.lock = threading.RLock()  # see the module docstring
        self.jobs = Jobs(state, data, self.tokenizers, self.lock)
        self._reserved: set[tuple[str, str]] = set()  # names an upload or a gRPC load is writing
        self._loads: dict[tuple[str, str], _GrpcLoad] = {}
        self._damage_reported: dict[tuple[str, str], str] = {}  # logged and counted once per episode
        self._snapshot_lock = asyncio.Lock()
        self.replication = None  # replicated (--log): the Replica publishes uploads, deletions; snapshots

    # ------------------------------------------------------------------ start-up

    def restore(self) -> None:
        """Loads snapshots, applies tombstones, and queues builds of uploads the snapshots lack (or
        hold an older corpus of the name); damaged entries are reported, never built."""
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
                    continue
                if m.state == DAMAGED:
                    self._report_damage(ns, m.name, m.error)
                    continue
                if m.state not in (ACKNOWLEDGED, READY):
                    continue
                if m.name in loaded and not m.stale_in_snapshot:
                    continue
                if m.name in loaded:  # the snapshot's corpus of this name is older than the manifest's
                    corpus.remove_external_corpus(m.name)
                damage = self.data.data_damage(m)
                if damage:  # a rebuild would build a partial corpus, or nothing: report it instead
                    self._report_damage(ns, m.name, damage)
                    continue
                log.info("rebuilding corpus '%s/%s' (%s; the snapshot lacks it or holds an older one)", ns, m.name,
                         m.state)
                m.job_id = m.job_id or new_job_id()
                self.jobs.submit(m)

    # ------------------------------------------------------------------ uploads

    async def upload(self, namespace: str, name: str, fmt: str, chunks: AsyncIterator[bytes],
                     replace: bool = False) -> Job:
        """Streams an upload to disk, checks it, fsyncs it, records the manifest, queues the build.
        Returns once the upload is durable (the 202 acknowledgement). ``replace``: an existing
        corpus of the name keeps serving drafts until the new one is built, then is swapped out."""
        corpus = self.state.corpus(namespace)
        key = (namespace, name)
        if replace and self.replication is not None:
            raise CorpusConflict(f"corpus '{name}': a replicated corpus cannot replace a corpus in place; "
                                 "DELETE it, then upload")
        with self.lock:
            self._check_free(namespace, name, replace)
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
            try:
                job, manifest = await asyncio.to_thread(self._acknowledge_upload, incoming,
                                                        Manifest(namespace, name, fmt, sink.bytes, ACKNOWLEDGED, job_id),
                                                        replace)
            except BaseException:
                incoming.unlink(missing_ok=True)
                raise
            if self.replication is not None:
                await self.replication.publish_upload(manifest)
            return job
        finally:
            with self.lock:
                self._reserved.discard(key)

    def check_upload(self, namespace: str, name: str, replace: bool) -> dict:
        """What a PUT would meet before its body is sent (``?dry_run=true``, the CLI's pre-flight):
        CorpusConflict if the name is taken (without ``replace``) or being written."""
        self.state.corpus(namespace)
        with self.lock:
            self._check_free(namespace, name, replace)
            exists = self._taken(namespace, name)
        return {"namespace": namespace, "name": name, "replace": replace, "exists": exists}

    def _acknowledge_upload(self, incoming: Path, manifest: Manifest, replace: bool) -> tuple[Job, Manifest]:
        ns, name = manifest.namespace, manifest.name
        with self.lock:
            if not replace:  # a gRPC load may have committed the name while this upload streamed
                self._check_free(ns, name, replace, own=True)
            old = self.data.manifest(ns, name)
            if replace:
                self.jobs.cancel(ns, name)  # an older build of the name must not commit after this one
            # Any earlier corpus of the name may be in the last snapshot: a restart must not take it
            # for this one (cleared by the next snapshot that holds this build).
            manifest.stale_in_snapshot = old is not None or name in self.state.corpus(ns).list_external_corpora()
            os.replace(incoming, self.data.data_path(ns, name))
            fsync_dir(incoming.parent)
            self.data.write_manifest(manifest)
            self._damage_reported.pop((ns, name), None)
            return self.jobs.submit(manifest), manifest

    def _check_free(self, namespace: str, name: str, replace: bool, own: bool = False) -> None:
        """Caller holds ``lock``."""
        if (namespace, name) in self._reserved and not own:
            raise CorpusConflict(f"corpus '{name}' in namespace '{namespace}' is being uploaded or loaded by "
                                 "another call; try again once it is acknowledged")
        if replace or not self._taken(namespace, name):
            return
        m = self.data.manifest(namespace, name)
        damage = "" if m is None else m.error if m.state == DAMAGED else self.data.data_damage(m)
        if damage:
            raise CorpusConflict(f"corpus '{name}' already exists in namespace '{namespace}' but is damaged "
                                 f"({damage}); replace it (PUT ...?replace=true) or delete it")
        raise CorpusConflict(f"corpus '{name}' already exists in namespace '{namespace}'; delete it first or "
                             "replace it (PUT ...?replace=true, ngram-corpus upload --replace)")

    def _taken(self, namespace: str, name: str) -> bool:
        if name in self.state.corpus(namespace).list_external_corpora():
            return True
        m = self.data.manifest(namespace, name)
        return m is not None and m.state != DELETED

    # ------------------------------------------------------------------ gRPC loads

    def begin_load(self, namespace: str, name: str) -> None:
        """LoadExternalCorpus' first chunk: stages ``name`` in the engine and opens its data file."""
        corpus = self.state.corpus(namespace)
        key = (namespace, name)
        with self.lock:
            if key in self._loads:
                raise CorpusConflict(f"corpus '{name}' in namespace '{namespace}' is already being loaded; "
                                     "commit it first")
            self._check_free(namespace, name, replace=False)
            corpus.begin_external_corpus(name)
            job_id = new_job_id()
            path = self.data.incoming_path(namespace, name, job_id)
            try:
                f = open(path, "wb")
            except BaseException:
                corpus.abort_external_corpus(name)
                raise
            self._loads[key] = _GrpcLoad(path, f, job_id)
            self._reserved.add(key)

    def load_chunk(self, namespace: str, name: str, tokens: np.ndarray) -> None:
        """One document of a gRPC load (off the event loop: engine work and a file write)."""
        load = self._loads.get((namespace, name))
        if load is None:
            raise NotFoundError(f"external corpus '{name}' is not being loaded")
        self.state.corpus(namespace).add_external_chunk(name, tokens)
        if tokens.size:
            line = (" ".join(map(str, tokens.tolist())) + "\n").encode()
            load.file.write(line)
            load.bytes += len(line)
            load.documents += 1

    def abort_load(self, namespace: str, name: str) -> None:
        with self.lock:
            load = self._loads.pop((namespace, name), None)
            self._reserved.discard((namespace, name))
            corpus = self.state.corpus(namespace)
            if corpus.is_loading_external_corpus(name):
                corpus.abort_external_corpus(name)
        if load is not None:
            load.file.close()
            load.path.unlink(missing_ok=True)

    def commit_load(self, namespace: str, name: str, expected_tokens: int) -> int:
        """CommitExternalCorpus: visible in the engine and durable (data file and manifest) before
        it answers. ``expected_tokens`` >= 0 and different: the load is discarded (ValueError)."""
        corpus = self.state.corpus(namespace)
        key = (namespace, name)
        with self.lock:
            load = self._loads.get(key)
            if load is None:
                raise NotFoundError(f"external corpus '{name}' was never started (nothing to commit)")
            try:
                count = corpus.commit_external_corpus(name)
                if 0 <= expected_tokens != count:
                    corpus.remove_external_corpus(name)
                    raise ValueError(f"CommitExternalCorpus: corpus '{name}' holds {count} tokens, caller expected "
                                     f"{expected_tokens}; the load was discarded")
                try:
                    load.file.flush()
                    os.fsync(load.file.fileno())
                    load.file.close()
                    old = self.data.manifest(namespace, name)
                    os.replace(load.path, self.data.data_path(namespace, name))
                    fsync_dir(load.path.parent)
                    self.data.write_manifest(Manifest(namespace, name, "ids", load.bytes, READY, load.job_id,
                                                      tokens=count, documents=load.documents, source="grpc",
                                                      stale_in_snapshot=old is not None))
                except BaseException:
                    corpus.remove_external_corpus(name)  # not durable: not committed either
                    raise
                self._damage_reported.pop(key, None)
                return count
            finally:
                self._loads.pop(key, None)
                self._reserved.discard(key)
                if not load.file.closed:
                    load.file.close()
                load.path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ inspection, deletion

    def list(self, namespace: str) -> list[dict]:
        corpus = self.state.corpus(namespace)
        loaded = corpus.list_external_corpora()
        # Committed in the engine without a manifest: loaded over gRPC before manifests recorded
        # gRPC loads, or restored from such a snapshot.
        out: dict[str, dict] = {n: {"name": n, "namespace": namespace, "state": READY, "tokens": t, "source": "grpc"}
                                for n, t in loaded.items()}
        for m in self.data.manifests(namespace):
            if m.state == DELETED:  # a delete between its tombstone and the engine's removal: gone
                out.pop(m.name, None)
                continue
            entry = {"name": m.name, "namespace": namespace, "state": m.state, "tokens": loaded.get(m.name, m.tokens),
                     "source": m.source, "format": m.format or None, "bytes": m.bytes, "job_id": m.job_id or None,
                     "created_at": m.created_at, "error": m.error}
            job = self.jobs.active(namespace, m.name)
            damage = m.error if m.state == DAMAGED else self.data.data_damage(m)
            if m.state == DAMAGED:
                entry.update(source="unknown", tokens=loaded.get(m.name, 0), created_at=None)
            if damage:
                self._report_damage(namespace, m.name, damage)
                entry["state"] = DAMAGED
                entry["error"] = damage + self._damage_hint(m.name in loaded)
            elif job is not None:
                entry["state"], entry["job_id"] = "building", job.id
            elif m.state == READY and m.name not in loaded:
                entry["state"] = DAMAGED
                entry["error"] = "listed as ready but not loaded in the engine" + self._damage_hint(False)
                self._report_damage(namespace, m.name, entry["error"])
            out[m.name] = entry
        return [out[k] for k in sorted(out)]

    @staticmethod
    def _damage_hint(drafting: bool) -> str:
        still = "the loaded corpus still drafts, but a restart cannot rebuild it" if drafting else "nothing drafts from it"
        return f" ({still}; replace it with PUT ...?replace=true or delete it)"

    def problems(self, namespace: str) -> dict[str, str]:
        """name -> what is wrong, for /v1/integrity: damaged entries and catalog/engine disagreements."""
        return {e["name"]: e["error"] for e in self.list(namespace) if e["state"] == DAMAGED}

    def _report_damage(self, namespace: str, name: str, reason: str) -> None:
        key = (namespace, name)
        if self._damage_reported.get(key) == reason:
            return
        self._damage_reported[key] = reason
        log.error("corpus '%s/%s' is damaged: %s", namespace, name, reason)
        self.state.metrics.damaged_corpora.labels(namespace).inc()

    def get(self, namespace: str, name: str) -> dict:
        for entry in self.list(namespace):
            if entry["name"] == name:
                return entry
        raise KeyError(f"no corpus '{name}' in namespace '{namespace}'")

    async def delete(self, namespace: str, name: str) -> None:
        """Removes a corpus whatever loaded it (REST or gRPC) and whatever its state (damaged too):
        a tombstone first (crash-safe), then the data file, then the engine's copy."""
        await asyncio.to_thread(self._delete, namespace, name)
        if self.replication is not None:
            self.replication.publish_remove(namespace, name)

    def _delete(self, namespace: str, name: str) -> None:
        corpus = self.state.corpus(namespace)
        key = (namespace, name)
        with self.lock:
            if key in self._reserved:
                raise CorpusConflict(f"corpus '{name}' in namespace '{namespace}' is being uploaded or loaded; "
                                     "delete it once that call is done")
            m = self.data.manifest(namespace, name)
            loaded = name in corpus.list_external_corpora()
            if not loaded and (m is None or m.state == DELETED):
                raise KeyError(f"no corpus '{name}' in namespace '{namespace}'")
            self.jobs.cancel(namespace, name)
            # A tombstone even for a corpus only the snapshot holds: a restart must not bring it back.
            self.data.write_manifest(Manifest(namespace, name, "", 0, DELETED, m.job_id if m is not None else ""))
            self.data.data_path(namespace, name).unlink(missing_ok=True)
            if loaded:
                corpus.remove_external_corpus(name)
            self._damage_reported.pop(key, None)

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
                # Read before the save: a corpus committed before it began is in it.
                loaded = set(self.state.corpus(ns).list_external_corpora())
                manifests = self.data.manifests(ns)
                tombstones = [m.name for m in manifests if m.state == DELETED and m.name not in loaded]
                fresh = [(m.name, m.job_id) for m in manifests
                         if m.stale_in_snapshot and m.state == READY and m.name in loaded
                         and self.jobs.active(ns, m.name) is None]
                try:
                    path = await self.state.run(self.data.save, ns, self.state.corpus(ns))
                except Exception:
                    self.state.metrics.snapshots.labels(ns, "error").inc()
                    raise
                self.state.metrics.snapshots.labels(ns, "ok").inc()
                await asyncio.to_thread(self._after_snapshot, ns, tombstones, fresh)
                done[ns] = path.name
            return done

    def _after_snapshot(self, ns: str, tombstones: list[str], fresh: list[tuple[str, str]]) -> None:
        with self.lock:
            for name in tombstones:
                m = self.data.manifest(ns, name)
                if m is not None and m.state == DELETED:  # not re-uploaded during the save
                    self.data.drop_upload(ns, name)
            for name, job_id in fresh:  # the snapshot holds this build: a restart may trust it
                m = self.data.manifest(ns, name)
                if m is not None and m.job_id == job_id and m.state == READY and m.stale_in_snapshot:
                    m.stale_in_snapshot = False
                    self.data.write_manifest(m)
