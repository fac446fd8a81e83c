"""Wires a Replica into one corpus process: commits of its sessions go to the log, uploads and
deletions become log markers, and the applier builds what other replicas uploaded."""

from __future__ import annotations

from corpus_service.admin.catalog import Catalog
from corpus_service.admin.persistence import DataDir
from corpus_service.replication.externals import ExternalCorpora
from corpus_service.replication.replica import Replica
from corpus_service.server.config import ServiceConfig
from corpus_service.server.metrics import ReplicationMetrics
from corpus_service.server.state import ServiceState


def make_replica(config: ServiceConfig, state: ServiceState, catalog: Catalog, data: DataDir) -> Replica:
    replica = Replica(config, state, data.root)
    replica.externals = ExternalCorpora(catalog, replica.blobs, replica.publisher)
    replica.metrics = ReplicationMetrics(state.metrics, replica.status)
    catalog.replication = replica  # uploads, deletions and snapshots go through the replica
    state.chunkers = replica.chunkers
    state.replica = replica
    return replica
