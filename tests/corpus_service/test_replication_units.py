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
from corpus_service.service_config import ServiceConfig
from corpus_service.service_state import ServiceState


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


def test_chunker_matches_a_plain_model_on_random_steps():
    """The vectorized chunker against the rule written out request by request: runs of any length
    (longer than the buffer too), unknown ids ignored, many requests (the buffer grows)."""
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
