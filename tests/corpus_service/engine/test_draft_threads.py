"""CorpusConfig.draft_threads: a batch's requests drafted by a pool of threads (csrc/draft_pool.h)
give exactly the serial drafts, padded and compact, with groups, external corpora and the learned
corpus; concurrent batches (the pool busy: the later caller drafts alone) and inserts stay safe."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corpus_service import CorpusConfig, NgramCorpus


def _twins(seed: int, n_requests: int, threads: int) -> tuple[NgramCorpus, NgramCorpus, list[str]]:
    """Two corpora fed the same operations: one drafting serially, one with ``threads`` threads."""
    rng = np.random.default_rng(seed)
    serial, pooled = NgramCorpus(flush_tokens=16), NgramCorpus(flush_tokens=16, draft_threads=threads)
    ops = []
    for r in range(20):  # finished requests: the learned corpus
        ops.append(("run", f"old{r}", rng.integers(0, 24, int(rng.integers(5, 60))).tolist(), None))
    ext = rng.integers(0, 24, 400).tolist()
    ids = []
    for r in range(n_requests):
        group = f"g{r % 3}" if r % 4 == 0 else None  # some requests in groups (siblings draft from each other)
        ops.append(("live", f"r{r}", rng.integers(0, 24, int(rng.integers(1, 80))).tolist(), group))
        ids.append(f"r{r}")
    for c in (serial, pooled):
        c.load_external_corpus_named("ext", [ext])
        c.commit_external_corpus_load("ext")
        for kind, rid, toks, group in ops:
            c.start_request(rid, toks[: len(toks) // 2 + 1], group=group)
            c.extend(rid, toks[len(toks) // 2 + 1:])
            if kind == "run":
                c.finish(rid)
        c.synchronize()
    return serial, pooled, ids


def _same(a, b) -> None:
    for x, y in zip(a, b):
        assert np.array_equal(np.asarray(x), np.asarray(y))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), threads=st.integers(2, 4), budget=st.integers(1, 40))
def test_pooled_drafts_equal_serial_drafts(seed, threads, budget):
    serial, pooled, ids = _twins(seed, 70, threads)
    rng = np.random.default_rng(seed + 1)
    for size in (1, 8 * threads - 1, 8 * threads, 70):  # below and above the pool's threshold
        batch = [ids[i] for i in rng.permutation(len(ids))[:size]]
        a, b = serial.draft(batch, budget), pooled.draft(batch, budget)
        _same((a.tokens, a.parents, a.probs, a.counts), (b.tokens, b.parents, b.probs, b.counts))
        _same(serial.draft_compact(batch, budget), pooled.draft_compact(batch, budget))
    assert pooled.stats()["drafts"] == serial.stats()["drafts"]


def test_concurrent_batches_and_inserts_on_one_pool():
    _, pooled, ids = _twins(7, 64, 2)
    errors: list[BaseException] = []
    results: list = []
    stop = threading.Event()

    def drafter() -> None:
        try:
            for _ in range(40):
                results.append(pooled.draft(ids, 15))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def inserter() -> None:
        rng = np.random.default_rng(3)
        try:
            k = 0
            while not stop.is_set():
                pooled.start_request(f"x{k}", rng.integers(0, 24, 30))
                pooled.finish(f"x{k}")
                k += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=drafter) for _ in range(3)]
    ins = threading.Thread(target=inserter)
    ins.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    ins.join()
    assert not errors, errors
    assert len(results) == 120 and all(len(r) == 64 for r in results)
    assert all(int(r.counts.max()) <= 15 for r in results)
    pooled.synchronize()
    pooled.check_integrity()


def test_draft_threads_is_validated():
    for bad in (0, 65, True, 2.0):
        with pytest.raises(ValueError, match="draft_threads"):
            CorpusConfig(draft_threads=bad)
    assert NgramCorpus(draft_threads=64).draft([], 4).counts.shape == (0,)
