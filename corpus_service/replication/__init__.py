"""Replication: corpus replicas that all apply one ordered NATS JetStream commit log.

    events.py      the log's message format (a batch of events: learned chunks, external corpora)
    chunker.py     turns a replica's committed tokens into learned-corpus chunks, as the engine does
    publisher.py   batches events and publishes them; buffers (bounded) while the broker is down
    applier.py     applies messages to the engines in stream order; the replica digest
    blobstore.py   snapshots and uploads every replica can read (a shared directory, or the
                   broker's object store)
    snapshots.py   snapshots tagged with the stream position they cover, recorded in a KV bucket;
                   written by a forked child; garbage-collected across replica ids
    snapshot_writer.py  when snapshots are written (jittered), off the apply loop
    stream.py      the stream: retention applied at every start, incarnations, the base snapshot
    bootstrap.py   which snapshot a replica starts from and where it applies from (pure rules)
    recovery.py    a lost or recreated stream: detected, recreated, followed again
    visibility.py  read-your-writes (BatchPut synchronize) and the status
    externals.py   uploaded external corpora and deletions as log markers
    replica.py     one replica: connect (or serve a snapshot read-only), bootstrap, consume
    service.py     wires a replica into the corpus process; routes.py: GET /v1/replication
"""

from corpus_service.replication.applier import digest

__all__ = ["digest"]
