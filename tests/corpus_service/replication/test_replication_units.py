"""Replication pieces without a broker: the log format, chunking, deterministic apply, the buffer bound."""

from __future__ import annotations

import numpy as np
import pytest

from corpus_service import NgramCorpus
from corpus_service.replication.applier import Applier, digest
from corpus_service.replication.blobstore import FileBlobStore
from corpus_service.replication.chunker import Chunker
from corpus_service.replication.events import Batch, decode
from corpus_service.replication.publisher import Publisher
from corpus_service.replication.snapshots import Snapshots
from corpus_service.server.config import ServiceConfig
from corpus_service.server.state import ServiceState


def _batch(origin: str, chunks: list[list[int]], extra: list | None = None) -> Batch:
    b = Batch(origin, 123)
    for c in chunks:
        b.events.append(["c", "default", len(c)])
        b.tokens.append(np.array(c, np.int32))
    b.events.extend(extra or [])
    return b


def test_batch_roundtrip_and_bad_messages():
    b = _batch("r1", [[1, 2, 3], [], [7] * 5], [["r", "default", "docs"]])
    d = decode(b.encode())
    assert d.origin == "r1" and d.t_ns == 123 and d.events == b.events
    assert [t.tolist() for t in d.tokens] == [[1, 2, 3], [], [7] * 5]
    payload = b.encode()
    for bad, why in ((b"no newline", "no header"), (b"{]\n", "not JSON"), (b'{"v": 9}\n', "version"),
                     (payload + b"\0", "multiple of 4"), (payload + b"\0\0\0\0", "not claimed"),
                     (b'{"v":1,"ev":[["c","default",5]]}\n' + b"\0" * 8, "overruns"),
                     (b'{"v":1,"ev":[["q"]]}\n', "unknown event")):
        with pytest.raises(ValueError, match=why):
            decode(bad)


def test_chunker_flushes_like_the_engine():
    out = []
    ch = Chunker("default", flush_tokens=8, learn_prompts=True, emit=lambda ns, t: out.append(t.tolist()))
    ch.start("a", np.arange(5))
    ch.extend("a", np.arange(10, 13))  # 5 + 3 = 8 pending: one chunk
    ch.extend("a", np.arange(20, 22))
    ch.start("b", np.arange(100, 103), learn_prompt=False)
    ch.extend_packed(["b", "a"], np.array([2, 1]), np.array([7, 8, 9], np.int32))
    ch.finish("a")
    ch.finish("b")
    ch.finish("b")  # twice: nothing more
    assert out == [[0, 1, 2, 3, 4, 10, 11, 12], [20, 21, 9], [7, 8]]
    assert ch.live() == 0


def test_chunker_refuses_inconsistent_steps():
    ch = Chunker("default", flush_tokens=8, learn_prompts=True, emit=lambda ns, t: None)
    ch.start("a", np.arange(3))
    with pytest.raises(ValueError, match="sum"):
        ch.extend_packed(["a"], np.array([2]), np.arange(3, dtype=np.int32))
    with pytest.raises(ValueError, match="one int per request"):
        ch.extend_packed(["a", "b"], np.array([2]), np.arange(2, dtype=np.int32))
    with pytest.raises(ValueError, match=">= 0"):
        ch.extend_packed(["a"], np.array([-1]), np.arange(0, dtype=np.int32))
    with pytest.raises(ValueError, match="token ids"):
        ch.extend_packed(["a"], np.array([1]), np.array([-5], np.int32))
    assert ch.live() == 1


def test_chunker_matches_a_plain_model_on_random_steps():
    """The native chunker against the rule written out request by request: runs of any length,
    unknown ids ignored, many requests."""
    rng = np.random.default_rng(1)
    got, want = [], []
    ch = Chunker("default", flush_tokens=16, learn_prompts=True, emit=lambda ns, t: got.append(t.tolist()))
    pending: dict[str, list[int]] = {}
    for step in range(400):
        if step % 5 == 0:
            rid = f"r{step}"
            prompt = rng.integers(0, 100, int(rng.integers(0, 40))).tolist()
            ch.start(rid, np.array(prompt, np.int32))
            if len(prompt) >= 16:
                want.append(prompt)
                prompt = []
            pending[rid] = prompt
        live = list(pending)
        ids = [r for r in live if rng.random() < 0.7] + (["gone"] if step % 7 == 0 else [])
        lens = rng.integers(0, 5, len(ids))
        lens[rng.random(len(ids)) < 0.02] = 400  # a long run
        toks = rng.integers(0, 100, int(lens.sum())).astype(np.int32)
        ch.extend_packed(ids, lens, toks)
        pos = 0
        for rid, n in zip(ids, lens.tolist()):
            if rid in pending:
                pending[rid] += toks[pos:pos + n].tolist()
                if len(pending[rid]) >= 16:
                    want.append(pending[rid])
                    pending[rid] = []
            pos += n
        for rid in live:
            if rng.random() < 0.05:
                ch.finish(rid)
                if pending[rid]:
                    want.append(pending.pop(rid))
                else:
                    pending.pop(rid)
    assert sorted(got) == sorted(want) and len(got) > 100


def _state(**ns) -> ServiceState:
    return ServiceState(ServiceConfig(admin_port=-1, namespaces=("default:flush_tokens=16",), worker_threads=1))


def test_apply_is_deterministic_across_a_snapshot(tmp_path):
    """The same log applied from the start, or from a snapshot taken midway, gives the same digest."""
    rng = np.random.default_rng(0)
    log = [_batch("r", [rng.integers(0, 50, int(rng.integers(1, 40))).tolist() for _ in range(3)]) for _ in range(40)]
    a, b = _state(), _state()
    noop = lambda ev: None  # noqa: E731 - no external corpora in this log
    Applier(a, noop, noop).apply(log)
    snaps = Snapshots(FileBlobStore(tmp_path), "b")
    Applier(b, noop, noop).apply(log[:17])
    rec = snaps.write(b, 17)
    c = _state()
    snaps.load(c, snaps.records()[0])
    assert rec.seq == 17 and digest(c) == digest(b)
    Applier(b, noop, noop).apply(log[17:])
    Applier(c, noop, noop).apply(log[17:])
    assert digest(a) == digest(b) == digest(c)
    assert a.corpus("default").stats()["learned_tokens"] > 1000
    Applier(c, noop, noop).apply([_batch("r", [[1, 2, 3]])])
    assert digest(c) != digest(a)
    for s in (a, b, c):
        s.close()


def test_publisher_buffer_is_bounded_and_counts_drops():
    p = Publisher("r", "s.commits", buffer_tokens=10, batch_s=0.001)
    for _ in range(3):
        p.add_chunk("default", np.arange(3, dtype=np.int32))
    p.add_chunk("default", np.arange(6, dtype=np.int32))  # 15 > 10: dropped
    p.add_marker(["z", "default"])  # markers are never dropped
    assert p.buffered_tokens() == 9 and p.dropped_tokens == 6 and p.dropped_chunks == 1
    batch = decode(p._next_batch()[0])  # taken, not yet acknowledged: still held
    assert batch.events == [["c", "default", 3]] * 3 + [["z", "default"]] and p.buffered_tokens() == 9
    p.add_chunk("default", np.arange(2, dtype=np.int32))  # 9 held + 2 > 10: dropped
    assert p.buffered_tokens() == 9 and p.dropped_chunks == 2 and p.dropped_tokens == 8


def test_unlearned_requests_do_not_feed_the_learned_corpus():
    c = NgramCorpus(flush_tokens=4)
    c.start_request_unlearned("a", [1, 2, 3, 4, 5])
    c.extend("a", list(range(10, 40)))
    c.finish("a")
    assert c.learned_tokens().size == 0
    c.start_request_unlearned("b", [1])
    with pytest.raises(ValueError, match="already live"):
        c.start_request_unlearned("b", [1])


@pytest.mark.parametrize("field, value, why", [("log", "http://x:1", "nats://"), ("log_stream", "a.b", "log_stream"),
                                               ("replica_id", "a/b", "replica_id"), ("log_batch_ms", 0, "log_batch_ms"),
                                               ("log_buffer_tokens", -1, "log_buffer_tokens")])
def test_replication_config_is_validated(field, value, why):
    with pytest.raises(ValueError, match=why):
        ServiceConfig(**{field: value})
    assert ServiceConfig(log="nats://127.0.0.1:4222,nats://10.0.0.2:4222").replicated
    assert not ServiceConfig().replicated


def test_blob_keys_are_checked(tmp_path):
    store = FileBlobStore(tmp_path)
    for bad in ("../x", "a//b", "/abs", ".hidden", ""):
        with pytest.raises(ValueError, match="blob key"):
            store.path(bad)
    with pytest.raises(FileNotFoundError, match="not in the blob store"):
        store.get_file("snapshots/none.ngc", tmp_path / "out")


# ---------------------------------------------------------------------- where a replica starts

def _rec(seq: int, inc: str = "i1", t: float = 0.0, replica: str = "r") -> "SnapshotRecord":
    from corpus_service.replication.snapshots import SnapshotRecord
    return SnapshotRecord(seq, {"default": "k"}, replica, t or float(seq), 1, inc, f"snapshots/{inc}-{seq}-{replica}")


def test_bootstrap_plan_covers_each_case():
    from corpus_service.replication.bootstrap import plan
    from corpus_service.replication.stream import StreamView

    v = StreamView("i1", 1, 10, None)
    assert plan(v, [], None, None).position == 0 and not plan(v, [], None, None).candidates  # a fresh replica
    p = plan(v, [_rec(4), _rec(8), _rec(3, "i0")], None, None)
    assert [(r.seq, pos) for r, pos in p.candidates] == [(8, 8), (4, 4)] and not p.gap  # newest first, other incarnations never
    assert plan(v, [_rec(8)], ("i1", 6), None).keep  # its own state reaches the log: kept
    # Retention moved past the newest snapshot: it is loaded anyway and the gap reported.
    p = plan(StreamView("i1", 7, 10, None), [_rec(4)], None, None)
    assert [(r.seq, pos) for r, pos in p.candidates] == [(4, 6)] and "messages 5..6 are lost" in p.gap
    assert "messages 1..6 are lost" in plan(StreamView("i1", 7, 10, None), [], None, None).gap
    # A recreated stream (incarnation i2) starts from its base, an i1 snapshot, at message 1 ...
    base = _rec(9, "i1")
    p = plan(StreamView("i2", 1, 3, base.dir), [_rec(4), base], ("i1", 7), base)
    assert [(r.seq, pos) for r, pos in p.candidates] == [(9, 0)] and p.reset
    assert plan(StreamView("i2", 1, 3, base.dir), [base], ("i1", 9), base).keep  # ... the state is the base
    # ... and a snapshot of i2 itself wins once there is one.
    p = plan(StreamView("i2", 1, 3, base.dir), [base, _rec(2, "i2")], None, base)
    assert [(r.seq, pos) for r, pos in p.candidates] == [(2, 2)]
    # No base and a state of another incarnation: start empty (every replica does the same).
    p = plan(StreamView("i2", 1, 3, None), [_rec(9)], ("i1", 9), None)
    assert not p.candidates and p.reset and p.position == 0


def test_snapshot_collection_keeps_the_newest_across_replica_ids_and_the_protected(tmp_path):
    import time

    store = FileBlobStore(tmp_path)
    now = time.time()
    for i, (rid, age) in enumerate([("a", 500), ("b", 400), ("c", 300), ("d", 200), ("e", 10)]):
        rec = _rec(i + 1, "i1", now - age, rid)
        store.put_bytes(f"{rec.dir}/record.json", rec.to_json())
    snaps = Snapshots(store, "e")
    gone = snaps.collect(keep=3, max_age_s=0, protect={"snapshots/i1-1-a"})
    assert sorted(gone) == ["snapshots/i1-2-b"]  # beyond the newest 3, but the protected one stays
    assert {r.replica for r in snaps.records()} == {"a", "c", "d", "e"}
    gone = snaps.collect(keep=10, max_age_s=250, protect=set())
    assert sorted(gone) == ["snapshots/i1-1-a", "snapshots/i1-3-c"]  # older than 250 s
    assert snaps.collect(keep=1, max_age_s=1, protect=set()) == ["snapshots/i1-4-d"]  # the newest always stays
    assert [r.replica for r in snaps.records()] == ["e"]


def test_snapshot_times_are_jittered():
    import threading
    import time

    state = _state()
    from corpus_service.replication.snapshot_writer import SnapshotWriter as W

    writers = [W(None, state, threading.Lock(), 100.0, 3, 0) for _ in range(20)]
    t0 = time.monotonic()
    for w in writers:
        w.schedule(first=True)
    firsts = [w.next_due - t0 for w in writers]
    assert all(49 <= f <= 151 for f in firsts) and len({round(f, 3) for f in firsts}) == 20
    for w in writers:
        w.schedule()
    assert all(79 <= w.next_due - t0 <= 121 for w in writers)
    off = W(None, state, threading.Lock(), 0.0, 3, 0)
    off.schedule(first=True)
    assert off.next_due == float("inf") and not off.due(5, "i")  # interval 0: only on demand and at shutdown
    state.close()


def test_forked_snapshot_equals_a_save_and_reports_failures(tmp_path):
    from corpus_service import _native

    state = _state()
    Applier(state, lambda ev: None, lambda ev: None).apply([_batch("r", [list(range(i, i + 30)) for i in range(50)])])
    state.corpus("default").save(tmp_path / "inline.ngc")
    rec = Snapshots(FileBlobStore(tmp_path / "blobs"), "r").write(state, 1, "i1")
    assert (tmp_path / "blobs" / rec.namespaces["default"]).read_bytes() == (tmp_path / "inline.ngc").read_bytes()
    assert rec.bytes > 0 and rec.incarnation == "i1"
    import os
    pid, fd, pause = _native.fork_snapshot([state.corpus("default")._native], [str(tmp_path / "no" / "x.ngc")])
    _, st = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(st) == 1 and b"cannot create" in os.read(fd, 4096) and pause >= 0
    os.close(fd)
    with pytest.raises(ValueError, match="one path per corpus"):
        _native.fork_snapshot([state.corpus("default")._native], [])
    state.close()


def test_publisher_marks_and_drop_episodes(caplog):
    p = Publisher("r", "s.commits", buffer_tokens=10, batch_s=0.001)
    assert p.add_chunk("default", np.arange(6, dtype=np.int32)) and p.mark() == 1
    with caplog.at_level("ERROR", logger="corpus_service.replication"):
        assert not p.add_chunk("default", np.arange(6, dtype=np.int32))
        assert not p.add_chunk("default", np.arange(6, dtype=np.int32))
    assert caplog.text.count("commit log buffer full") == 1  # once per episode
    assert p.mark() == 1 and p.drop_episodes == 1 and p.stats()["dropping"]  # dropped chunks take no serial


@pytest.mark.parametrize("kw, why", [
    ({"nats_url": "nats://a:1", "log": "nats://b:1"}, "deprecated alias"),
    ({"nats_url": "http://a:1"}, "nats_url"),
    ({"log_max_bytes": -1}, "log_max_bytes"), ({"snapshot_keep": 0}, "snapshot_keep"),
    ({"log_max_age_s": float("inf")}, "log_max_age_s"), ({"snapshot_max_age_s": -1}, "snapshot_max_age_s"),
    ({"grpc_max_connection_age_s": -1}, "grpc_max_connection_age_s"),
    ({"nats_url": "nats://a:1", "snapshot_interval_s": 600, "log_max_age_s": 900}, "two snapshot intervals")])
def test_new_replication_settings_are_validated(kw, why):
    with pytest.raises(ValueError, match=why):
        ServiceConfig(**kw)


def test_deprecated_log_setting_is_an_alias():
    from corpus_service.server.main import connection_age_options
    from corpus_service.server.config import deprecations

    cfg = ServiceConfig(log="nats://127.0.0.1:4222")
    assert cfg.nats_url == "nats://127.0.0.1:4222" and cfg.replicated and len(deprecations(cfg)) == 1
    assert not deprecations(ServiceConfig(nats_url="nats://127.0.0.1:4222"))
    assert connection_age_options(0) == []
    assert dict(connection_age_options(300)) == {"grpc.max_connection_age_ms": 300_000,
                                                 "grpc.max_connection_age_grace_ms": 30_000}
    assert dict(connection_age_options(2))["grpc.max_connection_age_grace_ms"] == 200
