"""What an operator relies on with replicas: retention applied to an existing stream, dropped
commits refused, counted and logged once per episode, snapshots that do not stop applying and are
collected across replica ids, read-your-writes, Prometheus metrics, the deprecated ``--log`` flag
and the gRPC connection age. Real ``nats-server -js`` and corpus server processes on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from corpus_service.client import CorpusClient, CorpusUnavailable
from corpus_service.client.sglang import RemoteNgramCorpus
from corpus_service.protocol.status import CorpusResourceExhausted
from tests.corpus_service.replication_fixtures import (NATS_SERVER, NatsServer, commit, converged, drafts_continuation,
                                                       metrics, replica_cluster, status, stream_config, wait_for, wait_ready)
from tests.corpus_service.service_fixtures import ServerProcess

pytestmark = pytest.mark.skipif(NATS_SERVER is None, reason="nats-server is not installed (.ci/run installs it: "
                                                            "apt-get install -y nats-server)")


@pytest.fixture()
def cluster(tmp_path):
    yield from replica_cluster(tmp_path)


def test_retention_limits_apply_to_an_existing_stream(cluster):
    nats, start = cluster
    a = start("a", "--log-max-msgs", "0", "--log-max-bytes", "0", "--log-max-age-s", "0")
    wait_ready(a)
    cfg = stream_config(nats)
    assert (cfg.max_msgs, cfg.max_bytes, cfg.max_age or 0) == (-1, -1, 0)
    assert a.stop() == 0
    b = start("b", "--log-max-msgs", "1000", "--log-max-bytes", str(1 << 30), "--log-max-age-s", "7200")
    wait_ready(b)
    cfg = stream_config(nats)
    assert (cfg.max_msgs, cfg.max_bytes, cfg.max_age) == (1000, 1 << 30, 7200.0)
    assert "retention changed" in b.log()


def test_commits_beyond_the_buffer_are_refused_counted_and_logged_once_per_episode(cluster):
    """A healthy broker, commits faster than they are published (a 64-token buffer, batches every
    200 ms): BatchPut beyond the buffer is refused, every dropped token counted, each episode logged once."""
    nats, start = cluster
    a = start("a", "--log-buffer-tokens", "64", "--log-batch-ms", "200")
    wait_ready(a)
    rng = np.random.default_rng(0)
    c = RemoteNgramCorpus(a.target, draft_token_num=4, timeout=10)
    refused = 0
    for _ in range(4):
        for _ in range(3):  # 120 tokens into a 64-token buffer: the second and third are dropped
            c.batch_put([rng.integers(0, 5000, 40).tolist()])
        try:
            c.synchronize()
        except CorpusResourceExhausted as e:
            assert "commit log buffer is full" in str(e)
            refused += 1
        wait_for(lambda: status(a)["buffered_tokens"] == 0, 30, "the buffer to drain")
    c.close()
    commit(a.target, "long", list(range(100)), [])  # a session's chunk larger than the buffer: dropped, counted
    st = status(a)
    assert refused == 4 and st["dropped_chunks"] >= 9 and st["dropped_tokens"] >= 8 * 40 + 100
    assert 1 <= st["drop_episodes"] <= 5 and a.log().count("commit log buffer full") == st["drop_episodes"]
    m = metrics(a)
    assert m["ngram_corpus_replication_dropped_tokens_total"] == st["dropped_tokens"]
    assert m["ngram_corpus_replication_drop_episodes_total"] == st["drop_episodes"]


def test_synchronize_after_batch_put_is_read_your_writes(cluster):
    """20 trials: batch_put, synchronize, and the replica it talks to drafts the tokens at once."""
    nats, start = cluster
    a, b = start("a"), start("b")
    wait_ready(a), wait_ready(b)
    rng = np.random.default_rng(1)
    c = RemoteNgramCorpus(a.target, draft_token_num=4, timeout=10)
    misses = 0
    for _ in range(20):
        doc = rng.choice(5000, 24, replace=False).tolist()
        c.batch_put([doc])
        c.synchronize()
        misses += not drafts_continuation(a.target, doc)
    c.close()
    assert misses == 0


def test_a_snapshot_does_not_stop_applying(cluster):
    """While a snapshot of a corpus of ~12M tokens is being written, a commit still becomes visible."""
    nats, start = cluster
    a = start("a", "--snapshot-interval-s", "0")
    wait_ready(a)
    rng = np.random.default_rng(2)
    c = RemoteNgramCorpus(a.target, draft_token_num=4, timeout=60)
    for _ in range(12):  # 12 x 1M tokens, within the default buffer of 4M
        c.batch_put([rng.integers(0, 5000, 1 << 17).tolist() for _ in range(8)])
        c.synchronize()
    with a.http() as http:
        done = threading.Event()
        t = threading.Thread(target=lambda: (http.post("/v1/snapshot"), done.set()))
        t.start()
        wait_for(lambda: status(a)["snapshot_writing"] or done.is_set(), 30, "the snapshot writer")
        doc = rng.choice(5000, 24, replace=False).tolist()
        c.batch_put([doc])
        c.synchronize()  # returns once applied
        still_writing = status(a)["snapshot_writing"]
        t.join(120)
    c.close()
    st = status(a)
    assert still_writing, f"the commit became visible only after the snapshot ({st})"
    assert drafts_continuation(a.target, doc)
    assert st["snapshots_written"] == 1 and st["snapshot_pause_ms"] < 1000 * st["snapshot_duration_s"]


def test_snapshots_are_collected_across_replica_ids(cluster, tmp_path):
    """Every restart is a new replica id; with --snapshot-keep 2 the blob store keeps two snapshots."""
    nats, start = cluster
    for i in range(4):
        r = start(f"r{i}", "--snapshot-keep", "2", "--snapshot-interval-s", "0")
        wait_ready(r)
        commit(r.target, f"x{i}", list(range(100 * i, 100 * i + 20)), [[1, 2, 3]])
        converged([r])
        assert r.stop() == 0  # SIGTERM: a snapshot
    records = sorted((tmp_path / "blobs" / "snapshots").glob("*/record.json"))
    assert len(records) == 2 and all("-r2" in str(p) or "-r3" in str(p) for p in records), records
    late = start("late")
    wait_ready(late)
    assert "loaded snapshot at seq" in late.log()


def test_replication_metrics_follow_the_status(cluster):
    nats, start = cluster
    a = start("a")
    wait_ready(a)
    commit(a.target, "x", list(range(20)), [[5, 6, 7]])
    st = converged([a])[0]
    m = metrics(a)
    for name, key in (("applied_seq", "applied_seq"), ("published_seq", "published_seq"),
                      ("lag_messages", "pending"), ("buffered_tokens", "buffered_tokens")):
        assert m[f"ngram_corpus_replication_{name}"] == st[key], name
    assert m["ngram_corpus_replication_stream_healthy"] == 1 and m["ngram_corpus_replication_connected"] == 1
    assert m["ngram_corpus_replication_published_tokens_total"] == st["published_tokens"] > 0
    assert m["ngram_corpus_replication_visible_seconds_count"] >= 1
    for name in ("lag_seconds", "snapshot_age_seconds", "publish_errors_total", "dropped_tokens_total",
                 "snapshot_seconds_count", "snapshot_pause_seconds_count", "stream_losses_total"):
        assert f"ngram_corpus_replication_{name}" in m, name


def test_the_deprecated_log_flag_still_works_and_warns_once(tmp_path):
    nats = NatsServer(tmp_path / "nats").start()
    srv = ServerProcess(tmp_path / "r", "--log", nats.url, "--replica-id", "r", "--blob-store", str(tmp_path / "blobs"))
    (tmp_path / "r").mkdir()
    try:
        srv.start()
        wait_ready(srv)
        assert srv.log().count("--log / NGRAM_CORPUS_LOG is deprecated") == 1
        assert status(srv)["connected"]
    finally:
        srv.stop()
        nats.kill()


def test_max_connection_age_makes_clients_reconnect(tmp_path):
    """--grpc-max-connection-age-s 1: the server ends connections after about a second (plus its
    grace for open streams), the client opens new sessions, and drafting goes on."""
    (tmp_path / "s").mkdir()
    srv = ServerProcess(tmp_path / "s", "--grpc-max-connection-age-s", "1").start()
    try:
        with CorpusClient(srv.target, timeout=5) as c:
            c.start_request("r", list(range(30)))
            ok = 0
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    c.draft(["r"], 4)
                    ok += 1
                except CorpusUnavailable:
                    pass  # the step on the stream being cut; the next one opens a new session
                time.sleep(0.05)
        m = metrics(srv)
        assert ok >= 40 and m["ngram_corpus_sessions_total"] >= 3
    finally:
        srv.stop()
