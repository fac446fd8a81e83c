"""External corpora across replicas: an upload lands in the blob store and a marker in the log tells
every replica to build it; a deletion is a marker too.

The replica that took the upload builds it at once (as a single node does) and publishes the marker
after copying the data to the blob store. Every replica applies the marker in stream order and
waits for the build before the next message, so a snapshot taken after the marker holds the corpus
and a replica that starts from an older snapshot builds it when it replays the marker.
"""

from __future__ import annotations

import asyncio
import logging

from corpus_service.admin.catalog import Catalog
from corpus_service.admin.persistence import ACKNOWLEDGED, DELETED, FAILED, Manifest
from corpus_service.replication.blobstore import FileBlobStore
from corpus_service.replication.events import EXTERNAL, REMOVE
from corpus_service.replication.publisher import Publisher

log = logging.getLogger("corpus_service.replication")


class ExternalCorpora:
    def __init__(self, catalog: Catalog, blobs: FileBlobStore, publisher: Publisher) -> None:
        self.catalog, self.blobs, self.publisher = catalog, blobs, publisher

    # ------------------------------------------------------------------ on the replica that took the request

    async def publish_upload(self, m: Manifest) -> None:
        key = f"uploads/{m.namespace}/{m.name}/{m.job_id}.data"
        await asyncio.to_thread(self.blobs.put_file, key, self.catalog.data.data_path(m.namespace, m.name))
        self.publisher.add_marker([EXTERNAL, m.namespace, m.name, key, m.format, m.bytes, m.job_id])

    def publish_remove(self, namespace: str, name: str) -> None:
        self.publisher.add_marker([REMOVE, namespace, name])

    # ------------------------------------------------------------------ on every replica (applier thread)

    def apply_upload(self, ev: list) -> None:
        _, ns, name, key, fmt, nbytes, job_id = ev
        corpus = self.catalog.state.corpus(ns)
        jobs = self.catalog.jobs
        if name in corpus.list_external_corpora():
            return  # built here already (the origin), or in the snapshot this replica loaded
        if jobs.active(ns, name) is not None:
            jobs.wait_idle()  # the origin's own build: the marker is applied once it is done
            return
        old = self.catalog.data.manifest(ns, name)
        if old is not None and old.job_id == job_id and old.state == FAILED:
            return  # the same upload failed to build here before
        try:
            self.blobs.get_file(key, self.catalog.data.data_path(ns, name))
        except FileNotFoundError as e:
            log.error("external corpus '%s/%s' not built: %s", ns, name, e)
            return
        manifest = Manifest(ns, name, fmt, int(nbytes), ACKNOWLEDGED, job_id)
        self.catalog.data.write_manifest(manifest)
        jobs.submit(manifest)
        jobs.wait_idle()

    def apply_remove(self, ev: list) -> None:
        _, ns, name = ev
        corpus = self.catalog.state.corpus(ns)
        self.catalog.jobs.cancel(ns, name)
        m = self.catalog.data.manifest(ns, name)
        if m is not None and m.state != DELETED:
            m.state = DELETED
            self.catalog.data.write_manifest(m)
            self.catalog.data.data_path(ns, name).unlink(missing_ok=True)
        if name in corpus.list_external_corpora():
            corpus.remove_external_corpus(name)
