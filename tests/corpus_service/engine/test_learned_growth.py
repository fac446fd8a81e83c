"""The learned corpus growing while drafts run: the insert thread builds a grown copy of the index
(larger hash-head tables, more storage, storage compacted after evictions) under the shared lock
and swaps it in (Corpus::grow_learned), so drafts never wait for the rehash or the copy. The index
must stay intact and keep finding what it learned, across many doublings and under a memory bound,
with drafts, resets and snapshot loads racing the growth."""

import contextlib
import threading

import numpy as np
import pytest

from corpus_service import CorpusConfig, NgramCorpus


def documents(n_docs: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 5000, length).tolist() for _ in range(n_docs)]


def feed(c: NgramCorpus, docs: list[list[int]], prefix: str) -> None:
    for i, d in enumerate(docs):
        c.start_request(f"{prefix}{i}", d[:20])
        c.extend(f"{prefix}{i}", d[20:])
        c.finish(f"{prefix}{i}")


@contextlib.contextmanager
def drafting(c: NgramCorpus):
    """A thread drafting for a live request in a closed loop until the block ends (the learned
    corpus' queue applied first); the block must not leave errors in the yielded list."""
    c.start_request("live", [1, 2, 3, 4, 5, 6, 7, 8])
    stop = threading.Event()
    errors: list[BaseException] = []

    def drafter() -> None:
        try:
            while not stop.is_set():
                c.draft(["live"], 15)
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    th = threading.Thread(target=drafter)
    th.start()
    try:
        yield errors
    finally:
        c.synchronize()
        stop.set()
        th.join()


def test_growth_across_many_doublings_with_drafts_running():
    c = NgramCorpus(CorpusConfig())
    with drafting(c) as errors:
        docs = documents(600, 400, seed=1)  # 240k tokens: the head tables double 9 times
        for k in range(0, len(docs), 50):
            feed(c, docs[k:k + 50], f"d{k}_")
    assert not errors
    c.check_integrity()
    assert c.stats()["learned_tokens"] >= 600 * 400
    # What was learned early (before every rebuild) and late is found: a context ending in a
    # document's 12 tokens drafts the token that followed them.
    for d in (docs[0], docs[300], docs[-1]):
        c.start_request("probe", d[100:112])
        tokens, parents, _ = c.draft(["probe"], 4).tree(0)
        assert tokens and tokens[0] == d[112] and parents[0] == -1
        c.finish("probe")


def test_reset_and_load_racing_the_growth_leave_a_sound_index(tmp_path):
    c = NgramCorpus(CorpusConfig())
    docs = documents(300, 400, seed=2)
    feed(c, docs[:100], "a")
    c.synchronize()
    snap = tmp_path / "learned.ngc"
    c.save(snap)
    feed(c, docs[100:200], "b")  # queued: the insert thread may be growing the tables now
    c.reset()
    c.check_integrity()
    feed(c, docs[200:], "c")
    c.load(snap)  # replaces the learned index while the "c" requests may still be applied
    c.synchronize()
    c.check_integrity()
    c.start_request("probe", docs[5][200:212])
    assert c.draft(["probe"], 4).tree(0)[0][:1] == [docs[5][212]]


@pytest.mark.parametrize("copy_growth", [True, False])
def test_growth_under_a_memory_bound_with_drafts_running(copy_growth):
    """Evictions keep the store at its bound; the compactions they call for happen in prepared
    copies (or in place, learned_copy_growth=False). The newest documents stay findable, the
    storage within ~1.25x of the bound."""
    cfg = CorpusConfig(learned_max_bytes=int(CorpusConfig().bytes_per_token() * 20_000), learned_copy_growth=copy_growth)
    c = NgramCorpus(cfg)
    docs = documents(400, 300, seed=3)  # 120k tokens through a 20k-token bound: six turnovers
    with drafting(c) as errors:
        for k in range(0, len(docs), 20):
            feed(c, docs[k:k + 20], f"m{k}_")
            if k % 100 == 0:
                c.synchronize()
                c.check_integrity()
    assert not errors
    c.check_integrity()
    st = c.stats()
    bound = cfg.to_native().learned_max_tokens
    assert 0.9 * bound <= st["learned_stored_tokens"] <= bound
    assert st["learned_bytes"] <= 1.3 * cfg.learned_max_bytes + (1 << 20)
    d = docs[-1]
    c.start_request("probe", d[100:112])
    assert c.draft(["probe"], 4).tree(0)[0][:1] == [d[112]]
    c.finish("probe")
    c.start_request("old", docs[0][100:112])  # evicted long ago
    assert c.draft(["old"], 4).tree(0)[0][:1] != [docs[0][112]]


def test_copy_growth_setting_is_validated():
    with pytest.raises(ValueError, match="learned_copy_growth: expected a bool"):
        CorpusConfig(learned_copy_growth="yes")
    assert CorpusConfig().to_native().learned_copy_growth is True
    assert CorpusConfig(learned_copy_growth=False).to_native().learned_copy_growth is False
