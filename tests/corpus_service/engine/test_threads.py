"""Lookups from many threads while others insert (the native calls release the GIL)."""

from __future__ import annotations

import threading

import numpy as np

from corpus_service import NgramCorpus


def test_concurrent_drafts_inserts_and_loads():
    c = NgramCorpus(flush_tokens=8)
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(w: int) -> None:
        rng = np.random.default_rng(w)
        try:
            for r in range(150):
                rid = f"w{w}-{r}"
                c.start_request(rid, rng.integers(0, 40, 20))
                for _ in range(5):
                    c.extend(rid, rng.integers(0, 40, 4))
                    c.draft([rid], 8)
                c.finish(rid)
                c.batch_put([rng.integers(0, 40, 18).tolist()])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def reader(k: int) -> None:
        rng = np.random.default_rng(100 + k)
        try:
            rid = f"reader{k}"
            c.start_request(rid, rng.integers(0, 40, 30))
            while not stop.is_set():
                d = c.draft([rid], 15)
                assert d.counts[0] <= 15
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def loader() -> None:
        try:
            for i in range(20):
                c.load_external_corpus_named(f"ext{i}", [np.arange(i, i + 200) % 40])
                c.commit_external_corpus_load(f"ext{i}")
                if i % 2:
                    c.remove_external_corpus(f"ext{i - 1}")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    threads += [threading.Thread(target=reader, args=(k,)) for k in range(2)]
    threads.append(threading.Thread(target=loader))
    for t in threads:
        t.start()
    for t in threads[:3] + threads[-1:]:
        t.join()
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors
    c.synchronize()
    c.check_integrity()
    assert c.stats()["learned_tokens"] > 3 * 150 * 20


def test_inserts_progress_under_continuous_drafting():
    """Readers that always overlap must not starve the insert thread (synchronize returns)."""
    c = NgramCorpus()
    rng = np.random.default_rng(7)
    ids = [f"r{i}" for i in range(64)]
    c.start_requests(ids, [rng.integers(0, 50, 200) for _ in ids])
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            c.draft(ids, 15)

    readers = [threading.Thread(target=reader, daemon=True) for _ in range(3)]
    for t in readers:
        t.start()
    done = threading.Event()

    def writer() -> None:
        for _ in range(20):
            c.batch_put([rng.integers(0, 50, 100).tolist()])
            c.synchronize()
        done.set()

    w = threading.Thread(target=writer, daemon=True)
    w.start()
    w.join(timeout=60)
    stop.set()
    for t in readers:
        t.join(timeout=10)
    assert done.is_set(), "inserts starved by concurrent drafts"
