"""Replicas on a real nats-server (JetStream) on 127.0.0.1: convergence, restart, late start, broker
outage, retention gap, replicated uploads, round-robin clients. Each replica is a real
``python -m corpus_service serve --log nats://...`` process."""

from __future__ import annotations

import numpy as np
import pytest

from corpus_service.client import CorpusClient, CorpusUnavailable
from tests.corpus_service.replication_fixtures import (NATS_SERVER, TOKEN, NatsServer, converged, replica, replica_cluster, status,
                                                       wait_for, wait_ready)
from tests.corpus_service.service_fixtures import wait_job

pytestmark = pytest.mark.skipif(NATS_SERVER is None, reason="nats-server is not installed (.ci/run installs it: "
                                                            "apt-get install -y nats-server)")


def _commit(target: str, rid: str, prompt: list[int], runs: list[list[int]]) -> None:
    """One request committed through a real client session: start, extend run by run (each step
    also drafts, as a verifier does), finish."""
    with CorpusClient(target, timeout=10) as c:
        c.start_request(rid, prompt)
        for run in runs:
            c.draft([rid], 4)
            c.extend(rid, run)
        c.finish(rid)
        c.flush()


def _runs(seed: int, n: int = 12) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 5000, int(rng.integers(1, 9))).tolist() for _ in range(n)]


@pytest.fixture()
def cluster(tmp_path):
    yield from replica_cluster(tmp_path)


def test_two_replicas_converge_and_draft_from_each_others_commits(cluster):
    nats, start = cluster
    a, b = start("a"), start("b")
    wait_ready(a), wait_ready(b)
    _commit(a.target, "x", list(range(20)), _runs(1))
    _commit(b.target, "y", list(range(30, 60)), _runs(2))
    sa, sb = converged([a, b])
    assert sa["digest"] == sb["digest"] and sa["applied_tokens"] == sb["applied_tokens"] > 100
    # What a committed is drafted on b: a context from x's prompt continues it.
    with CorpusClient(b.target, timeout=10) as c:
        c.start_request("probe", list(range(10)))
        tokens, _, _ = c.draft(["probe"], 4).tree(0)
    assert tokens[:3] == [10, 11, 12]
    # An upload on b is built on a too (through the blob store and a marker in the log).
    with b.http() as http:
        job = http.put("/v1/namespaces/default/corpora/docs?format=ids", content=b"1 2 3 4 5\n6 7 8\n").json()
        assert wait_job(http, job["id"])["state"] == "done"
    with a.http() as http:
        wait_for(lambda: any(c["name"] == "docs" and c["tokens"] == 8
                             for c in http.get("/v1/namespaces/default/corpora").json()), 30, "docs on a")
    sa, sb = converged([a, b])
    assert sa["digest"] == sb["digest"]
    # A client over both replicas (round-robin channel) drafts from either, and fails over to b
    # when a goes away: its session is replayed there.
    with CorpusClient(f"{a.target},{b.target}", timeout=10) as c:
        for i in range(4):
            c.start_request(f"rr{i}", list(range(10)))
            assert c.draft([f"rr{i}"], 4).tree(0)[0][:3] == [10, 11, 12]
        a.kill()

        def drafts_after_failover():
            try:
                return c.draft([f"rr{i}" for i in range(4)], 4).tree(3)[0][:3] == [10, 11, 12]
            except CorpusUnavailable:
                return False  # the broken session; the next call opens one on b
        wait_for(drafts_after_failover, 60, "failover to b")


def test_restarted_and_late_replicas_catch_up_from_snapshot_and_log(cluster):
    nats, start = cluster
    a = start("a", "--snapshot-interval-s", "0.2")
    b = start("b", "--snapshot-interval-s", "0")
    wait_ready(a), wait_ready(b)
    _commit(a.target, "x", list(range(20)), _runs(3))
    converged([a, b])
    wait_for(lambda: status(a)["snapshot_seq"] > 0, 30, "a snapshot")
    a.kill()  # kill -9: no shutdown snapshot
    _commit(b.target, "y", list(range(40, 70)), _runs(4))
    a.start()
    wait_ready(a)
    assert "loaded snapshot at seq" in a.log()
    sa, sb = converged([a, b])
    assert sa["digest"] == sb["digest"] and sa["snapshot_seq"] > 0
    late = start("late", "--snapshot-interval-s", "0")
    wait_ready(late)
    assert "loaded snapshot at seq" in late.log()
    s = converged([a, b, late])
    assert len({x["digest"] for x in s}) == 1


def test_broker_outage_lookups_go_on_and_replicas_resume(cluster):
    nats, start = cluster
    a, b = start("a"), start("b")
    wait_ready(a), wait_ready(b)
    _commit(a.target, "x", list(range(20)), _runs(5))
    converged([a, b])
    nats.kill()
    wait_for(lambda: not status(a)["connected"] and not status(b)["connected"], 30, "disconnect")
    # Lookups and commits never fail while the broker is down; commits are buffered.
    for srv, rid, seed in ((a, "p", 6), (b, "q", 7)):
        _commit(srv.target, rid, list(range(100, 120)), _runs(seed))
    assert status(a)["buffered_tokens"] > 0 and status(b)["buffered_tokens"] > 0
    nats.start()
    sa, sb = converged([a, b], timeout=90)
    assert sa["digest"] == sb["digest"] and sa["dropped_tokens"] == sb["dropped_tokens"] == 0
    assert sa["applied_tokens"] == sb["applied_tokens"] > 2 * 20  # the buffered commits arrived


def test_retention_gap_is_detected(cluster):
    nats, start = cluster
    a = start("a", "--snapshot-interval-s", "0", "--log-max-msgs", "3")
    wait_ready(a)

    def commit_messages(first: int, n: int) -> None:
        for i in range(first, first + n):  # one request each, published as separate messages
            _commit(a.target, f"x{i}", list(range(i, i + 20)), [])
            wait_for(lambda: status(a)["published_batches"] == i + 1, 30, "publish")

    commit_messages(0, 4)  # the stream keeps messages 2..4
    late = start("late", "--snapshot-interval-s", "0", "--log-max-msgs", "3")  # retention is the cluster's
    wait_ready(late)
    st = status(late)
    assert st["gaps"] == 1 and "no snapshot" in st["gap_error"] and "messages 1..1 are lost" in st["gap_error"]
    # A snapshot at seq 4, then the log moves past it: a new replica loads it and says what is lost.
    with a.http() as http:
        assert "default" in http.post("/v1/snapshot").json()["snapshots"]
    assert status(a)["snapshot_seq"] == 4
    commit_messages(4, 5)  # the stream keeps messages 7..9
    later = start("later", "--snapshot-interval-s", "0", "--log-max-msgs", "3")
    wait_ready(later)
    st = status(later)
    assert st["gaps"] == 1 and "snapshot covers seq 4 but the log starts at seq 7" in st["gap_error"]
    assert "messages 5..6 are lost" in st["gap_error"] and "retention gap" in later.log()
    assert st["applied_seq"] == status(a)["applied_seq"] == 9


def test_snapshots_and_uploads_through_the_nats_object_store(cluster, tmp_path):
    """``--blob-store nats-object://BUCKET``: no shared directory; a late replica starts from a
    snapshot in the broker's object store and builds an upload whose data is there too."""
    nats, start = cluster
    obj = ("--blob-store", "nats-object://corpus-blobs")
    a = start("a", *obj, "--snapshot-interval-s", "0")
    wait_ready(a)
    _commit(a.target, "x", list(range(20)), _runs(8))
    with a.http() as http:
        job = http.put("/v1/namespaces/default/corpora/docs?format=ids", content=b"1 2 3 4 5\n6 7 8\n").json()
        assert wait_job(http, job["id"])["state"] == "done"
        wait_for(lambda: status(a)["applied_seq"] >= 2 and status(a)["buffered_tokens"] == 0, 30, "applied")
        snap = http.post("/v1/snapshot").json()["snapshots"]["default"]
    assert snap.startswith("nats-object://corpus-blobs/snapshots/")
    with a.http() as http:  # an upload after the snapshot: the late replica builds it from the log marker
        job = http.put("/v1/namespaces/default/corpora/more?format=ids", content=b"9 9 9\n").json()
        assert wait_job(http, job["id"])["state"] == "done"
    late = start("late", *obj, "--snapshot-interval-s", "0")
    wait_ready(late)
    assert "loaded snapshot at seq" in late.log() and not (tmp_path / "blobs").exists()
    sa, sl = converged([a, late])
    assert sa["digest"] == sl["digest"]
    with late.http() as http:
        names = {c["name"]: c["tokens"] for c in http.get("/v1/namespaces/default/corpora").json()}
    assert names == {"docs": 8, "more": 3}


def test_replication_status_needs_a_token_when_tokens_are_configured(tmp_path):
    """/v1/replication covers every namespace: with client tokens it needs read on all of them."""
    import json

    import httpx

    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"clients": [
        {"name": "ops", "token": "tok-ops-read-all-6b1d9e2c7a40f3e8", "namespaces": ["*"], "role": "read"},
        {"name": "one", "token": "tok-one-ns-only-1c5a8e3f9d2b7046", "namespaces": ["default"], "role": "read"}]}))
    nats = NatsServer(tmp_path / "nats").start()
    srv = replica(tmp_path / "r", nats, "r", tmp_path / "blobs", "--client-tokens", str(tokens)).start()
    try:
        url = f"{srv.admin_url}/v1/replication"
        assert httpx.get(url, timeout=30).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer tok-one-ns-only-1c5a8e3f9d2b7046"},
                         timeout=30).status_code == 403
        r = httpx.get(url, headers={"Authorization": "Bearer tok-ops-read-all-6b1d9e2c7a40f3e8"}, timeout=30)
        assert r.status_code == 200 and isinstance(r.json(), dict), r.text
    finally:
        srv.stop()
        nats.kill()
