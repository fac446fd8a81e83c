"""Replicas recover from losing the log: the stream deleted, the broker's storage lost, the broker
down when a replica starts. Real ``nats-server -js`` and real corpus server processes on 127.0.0.1."""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest

from tests.corpus_service.replication_fixtures import (NATS_SERVER, commit, converged, delete_stream,
                                                       drafts_continuation, metrics, replica_cluster, status, wait_for,
                                                       wait_ready)

pytestmark = pytest.mark.skipif(NATS_SERVER is None, reason="nats-server is not installed (.ci/run installs it: "
                                                            "apt-get install -y nats-server)")


@pytest.fixture()
def cluster(tmp_path):
    yield from replica_cluster(tmp_path, "--snapshot-interval-s", "0")


def _docs(seed: int, n: int) -> list[list[int]]:
    """Documents of distinct random tokens: a draft continues one only if its commit is visible."""
    rng = np.random.default_rng(seed)
    return [rng.choice(5000, 40, replace=False).tolist() for _ in range(n)]


def _check_recovered(servers, before: list[list[int]], after: list[list[int]]) -> list[dict]:
    st = converged(servers, timeout=120)
    assert len({s["digest"] for s in st}) == 1
    for srv in servers:
        for d in after:  # every commit made after the loss, on every replica
            assert drafts_continuation(srv.target, d), f"a commit made after the loss is not visible on {srv.target}"
        for d in before:  # and what the base snapshot held
            assert drafts_continuation(srv.target, d)
    return st


def test_a_deleted_stream_is_recreated_and_every_replica_gets_the_commits_after_it(cluster):
    nats, start = cluster
    a, b = start("a"), start("b")
    wait_ready(a), wait_ready(b)
    before = _docs(1, 2)
    for i, d in enumerate(before):
        commit(a.target, f"before{i}", d[:20], [d[20:]])
    converged([a, b])
    delete_stream(nats)
    after = _docs(2, 6)
    for i, d in enumerate(after):  # right after the loss, on both replicas: buffered until the stream is back
        commit((a, b)[i % 2].target, f"after{i}", d[:20], [d[20:]])
    st = _check_recovered([a, b], before, after)
    # The metrics count the loss on both (readiness is red only for the moment of the recovery here;
    # the storage-loss test below holds the broker in a state where it cannot recover).
    for srv, s in zip((a, b), st):
        assert s["stream_losses"] >= 1 and s["stream_healthy"] and s["stream_base"]
        m = metrics(srv)
        assert m["ngram_corpus_replication_stream_losses_total"] >= 1
        assert m["ngram_corpus_replication_stream_healthy"] == 1
        assert "commit log stream ngram-corpus is gone" in srv.log() or "was recreated" in srv.log()
    # A replica started afterwards starts from the new stream's base snapshot and its log.
    late = start("late")
    wait_ready(late)
    _check_recovered([a, b, late], before, after)


def test_broker_storage_loss_is_detected_and_replicas_recover(cluster):
    nats, start = cluster
    a, b = start("a"), start("b")
    wait_ready(a), wait_ready(b)
    before = _docs(3, 2)
    for i, d in enumerate(before):
        commit(b.target, f"before{i}", d[:20], [d[20:]])
    converged([a, b])
    nats.kill()
    shutil.rmtree(nats.store / "jetstream")  # the broker's volume is lost: stream, KV bucket, everything
    after = _docs(4, 6)
    for i, d in enumerate(after[:2]):  # while the broker is down: buffered
        commit((a, b)[i % 2].target, f"down{i}", d[:20], [d[20:]])
    # Back first with a storage too small for the stream: the loss is seen, the stream cannot be
    # recreated yet, and readiness and the metrics say so until it can.
    nats.start(max_file_store=1 << 20)

    def red(srv) -> bool:
        r = httpx.get(f"{srv.admin_url}/readyz", timeout=10)
        return r.status_code == 503 and "stream lost" in r.json()["error"]["message"]
    wait_for(lambda: red(a) and red(b), 60, "readiness to turn red")
    assert metrics(a)["ngram_corpus_replication_stream_healthy"] == 0 and not status(b)["stream_healthy"]
    nats.kill()
    nats.start()
    for i, d in enumerate(after[2:]):  # as soon as it is back (empty)
        commit((a, b)[i % 2].target, f"after{i}", d[:20], [d[20:]])
    st = _check_recovered([a, b], before, after)
    assert all(s["stream_losses"] >= 1 for s in st)
    assert st[0]["stream_incarnation"] == st[1]["stream_incarnation"]


def test_a_replica_started_while_the_broker_is_down_serves_the_newest_snapshot(cluster):
    nats, start = cluster
    a = start("a")
    wait_ready(a)
    old, new = _docs(5, 2)
    commit(a.target, "old", old[:20], [old[20:]])
    converged([a])
    assert a.stop() == 0  # SIGTERM: a last snapshot
    nats.kill()
    b = start("b")
    wait_ready(b, timeout=60)  # ready without the broker: it serves the newest snapshot
    st = status(b)
    assert st["read_only"] and not st["connected"] and "serving the snapshot" in b.log()
    assert drafts_continuation(b.target, old)
    commit(b.target, "new", new[:20], [new[20:]])  # read-only: buffered, not applied yet
    assert status(b)["buffered_tokens"] > 0 and not drafts_continuation(b.target, new)
    nats.start()
    wait_for(lambda: drafts_continuation(b.target, new), 90, "the buffered commit after the broker came back")
    st = status(b)
    assert not st["read_only"] and st["bootstrapped"] and st["dropped_tokens"] == 0
    assert drafts_continuation(b.target, old)
