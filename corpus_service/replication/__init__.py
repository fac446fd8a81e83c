"""Replication: corpus replicas that all apply one ordered NATS JetStream commit log.

    events.py      the log's message format (a batch of events: learned chunks, external corpora)
    chunker.py     turns a replica's committed tokens into learned-corpus chunks, as the engine does
    publisher.py   batches events and publishes them; buffers (bounded) while the broker is down
    applier.py     applies messages to the engines in stream order; the replica digest
    blobstore.py   snapshots and uploads every replica can read (a shared directory, or the
                   broker's object store)
    snapshots.py   snapshots tagged with the stream sequence they cover, recorded in a KV bucket
    externals.py   uploaded external corpora and deletions as log markers
    replica.py     one replica: bootstrap (snapshot + replay), consume, snapshot, status
    service.py     wires a replica into the corpus process; routes.py: GET /v1/replication
"""

from corpus_service.replication.applier import digest

__all__ = ["digest"]
