"""The rank model under replication (csrc/rank_model.h, replication/replica.py): each replica queues
what its rank model observes, publishes it to the commit log as ``["a", NS, N, W]`` events, and every
replica learns from the log's events in log order, so all hold the same model (no broker needed here:
the log is a list of decoded batches)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from corpus_service._native import RANK_DELTA_WORDS, RANK_DELTA_WORDS_V1
from corpus_service.replication.applier import Applier, digest
from corpus_service.replication.blobstore import FileBlobStore
from corpus_service.replication.events import Batch, decode
from corpus_service.replication.publisher import Publisher
from corpus_service.replication.replica import Replica
from corpus_service.replication.snapshots import Snapshots
from corpus_service.server.config import ServiceConfig
from corpus_service.client import CorpusClient
from corpus_service.server.state import ServiceState
from tests.corpus_service.replication_fixtures import NATS_SERVER, NatsServer, converged, replica, wait_ready

NOOP = lambda ev: None  # noqa: E731 - no external corpora in these logs


def _config(rank: bool = True) -> ServiceConfig:
    spec = "default:flush_tokens=16" + (",rank_model=true" if rank else "")
    return ServiceConfig(admin_port=-1, namespaces=(spec,), worker_threads=1, nats_url="nats://127.0.0.1:4222")


def _decode_steps(state: ServiceState, seed: int, steps: int = 40) -> None:
    """A verifier's steps on this replica: its requests start unlearned, as replicated ones do."""
    rng = np.random.default_rng(seed)
    corpus = state.corpus("default")
    corpus.start_request_unlearned("q", rng.integers(0, 20, 60).tolist())
    for _ in range(steps):
        corpus.draft(["q"], 7)
        corpus.extend("q", rng.integers(0, 20, 2).tolist())
    corpus.finish("q")


def _published(replica: Replica) -> list[Batch]:
    out = []
    while (b := replica.publisher._next_batch()) is not None:
        out.append(decode(b[0]))
        replica.publisher._unacked = None  # acknowledged
    return out


def test_replicas_hold_the_same_model_learned_from_every_replicas_steps(tmp_path):
    states = [ServiceState(_config()) for _ in range(2)]
    replicas = [Replica(s.config, s, tmp_path / f"r{i}") for i, s in enumerate(states)]
    for i, s in enumerate(states):
        assert s.corpus("default").config.rank_learn_local is False  # replicated: learns from the log only
        _decode_steps(s, seed=i)
        assert s.corpus("default").stats()["rank_tested_nodes"] == 0
    log = []
    for r in replicas:
        assert r.publish_rank_deltas() > 0
        assert r.publish_rank_deltas() == 0  # nothing new observed since
        log += _published(r)
    assert [ev[0] for b in log for ev in b.events] == ["a", "a"]
    for s in states:
        Applier(s, NOOP, NOOP).apply(log)
    a, b = (s.corpus("default") for s in states)
    tested = sum(t.size for batch in log for t in batch.tokens) // RANK_DELTA_WORDS
    assert a.stats()["rank_tested_nodes"] == b.stats()["rank_tested_nodes"] == tested > 0
    np.testing.assert_array_equal(a.rank_weights(), b.rank_weights())
    assert digest(states[0]) == digest(states[1])
    # The model is in the digest: a replica that missed an event differs.
    late = ServiceState(_config())
    Applier(late, NOOP, NOOP).apply(log[:1])
    assert digest(late) != digest(states[0])
    # ... and in snapshots: one loaded from a replica's snapshot holds the same model.
    snaps = Snapshots(FileBlobStore(tmp_path / "blobs"), "r0")
    snaps.write(states[0], 2)
    fresh = ServiceState(_config())
    snaps.load(fresh, snaps.records()[0])
    assert digest(fresh) == digest(states[0])
    for s in (*states, late, fresh):
        s.close()


def test_namespaces_without_the_model_publish_nothing(tmp_path):
    state = ServiceState(_config(rank=False))
    replica = Replica(state.config, state, tmp_path)
    _decode_steps(state, seed=0)
    assert replica.publish_rank_deltas() == 0 and _published(replica) == []
    state.close()


def test_a_malformed_rank_event_is_skipped_by_every_replica():
    state = ServiceState(_config())
    before = digest(state)
    bad = Batch("foreign", 1, [["a", "default", 3]], [np.array([1, 2, 3], np.int32)])  # not a whole node
    applier = Applier(state, NOOP, NOOP)
    applier.apply([decode(bad.encode())])
    assert applier.skipped_events == 1 and digest(state) == before
    state.close()


def test_older_rank_events_still_apply():
    # ["a", NS, N] events (before 2026-12-03) carry the older layout's words per node: they apply, and
    # alike on every replica; an event naming a layout this version does not know is skipped.
    words = np.load(Path(__file__).resolve().parents[2] / "data" / "rank_delta_v1.npy")
    old = Batch("old-replica", 1, [["a", "default", int(words.size)]], [words])
    unknown = Batch("foreign", 1, [["a", "default", int(words.size), 7]], [words])
    states = [ServiceState(_config()) for _ in range(2)]
    for s in states:
        applier = Applier(s, NOOP, NOOP)
        applier.apply([decode(old.encode()), decode(unknown.encode())])
        assert applier.skipped_events == 1
        assert s.corpus("default").stats()["rank_tested_nodes"] == words.size // RANK_DELTA_WORDS_V1
    assert digest(states[0]) == digest(states[1])
    for s in states:
        s.close()
    with pytest.raises(ValueError, match="malformed rank model event"):
        decode(Batch("foreign", 1, [["a", "default", 3, "19"]], [np.zeros(3, np.int32)]).encode())


def test_rank_events_round_trip_through_the_wire_format():
    p = Publisher("r1", "s.commits", buffer_tokens=1000, batch_s=0.0)
    words = np.arange(2 * RANK_DELTA_WORDS, dtype=np.int32)
    assert p.add_rank_delta("default", words)
    batch = decode(p._next_batch()[0])
    assert batch.events == [["a", "default", words.size, RANK_DELTA_WORDS]]
    np.testing.assert_array_equal(batch.tokens[0], words)
    assert not p.add_rank_delta("default", np.zeros(2000, np.int32))  # beyond the buffer: dropped, counted
    assert p.dropped_tokens == 2000


def test_two_replica_processes_converge_on_one_rank_model(tmp_path):
    """Two real replicas on a real nats-server: requests decoded on each feed one model, that both hold."""
    if NATS_SERVER is None:
        pytest.skip("nats-server is not installed (.ci/run installs it: apt-get install -y nats-server)")
    nats = NatsServer(tmp_path / "nats").start()
    servers = [replica(tmp_path / n, nats, n, tmp_path / "blobs", "--namespace", "code:flush_tokens=16,rank_model=true")
               for n in ("a", "b")]
    try:
        for s in servers:
            s.start()
        for s in servers:
            wait_ready(s)
        for i, s in enumerate(servers):
            rng = np.random.default_rng(i)
            with CorpusClient(s.target, "code", timeout=10) as c:
                c.start_request("q", rng.integers(0, 20, 60).tolist())
                for _ in range(30):
                    c.draft(["q"], 7)
                    c.extend("q", rng.integers(0, 20, 2).tolist())
                c.finish("q")
                c.flush()

        def learned_alike():
            st = converged(servers)
            stats = []
            for s in servers:
                with CorpusClient(s.target, "code", timeout=10) as c:
                    stats.append(c.stats())
            return st if st[0]["digest"] == st[1]["digest"] and stats[0]["rank_tested_nodes"] > 0 else None

        deadline = time.monotonic() + 60
        while not learned_alike():  # each replica publishes its observations every RANK_DELTA_INTERVAL_S
            assert time.monotonic() < deadline, "the replicas never held one trained rank model"
            time.sleep(0.2)
    finally:
        for s in servers:
            if s.alive():
                s.kill()
        nats.kill()
