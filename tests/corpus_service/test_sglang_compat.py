"""Conformance of the SGLang-compatible methods: shapes, dtypes, padding, masks, window de-duplication."""

from __future__ import annotations

import numpy as np

from corpus_service import NgramCorpus


def has_path(tokens: list[int], parents: list[int], path: list[int]) -> bool:
    node = -1
    for t in path:
        nxt = [i for i, (tok, par) in enumerate(zip(tokens, parents)) if par == node and tok == t]
        if not nxt:
            return False
        node = nxt[0]
    return True


def check_flat(drafts: np.ndarray, mask: np.ndarray, bs: int, k: int) -> None:
    assert drafts.dtype == np.int64 and drafts.shape == (bs * k,)
    assert mask.dtype == np.int64 and mask.shape == (bs * k * k,)
    m = mask.reshape(bs, k, k)
    for b in range(bs):
        assert m[b, 0].tolist() == [1] + [0] * (k - 1)
        for i in range(k):
            assert m[b, i, i] == 1 and m[b, i, 0] == 1
            assert not m[b, i, i + 1:].any()  # parents come before children
            # Ancestor sets are closed: the parent's row is contained in the child's.
            ancestors = np.nonzero(m[b, i, :i])[0]
            parent = ancestors.max() if len(ancestors) else None
            if parent is not None and i > 0:
                assert (m[b, i, : i] >= m[b, parent, : i]).all()


def test_batch_get_after_batch_put():
    c = NgramCorpus(draft_token_num=8)
    c.batch_put([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 44, 55, 66, 77, 88, 99, 100]])
    c.synchronize()
    drafts, mask = c.batch_get(["q0", "q1", "q2"], [[1, 2, 3], [3, 44], [3, 6, 999]], [3, 2, 3])
    check_flat(drafts, mask, 3, 8)
    d = drafts.reshape(3, 8)
    assert d[0, 0] == 3 and set(d[0, 1:3].tolist()) == {4, 44}  # both continuations of "1 2 3"
    assert d[1, 0] == 44 and d[1, 1] == 55
    assert d[2, 0] == 999 and (d[2, 1:] == 0).all()  # nothing matches: zero padding under the root
    assert (mask.reshape(3, 8, 8)[2].sum(axis=1)[1:] == 2).all()


def test_stateful_windows_track_the_request():
    c = NgramCorpus(draft_token_num=4)
    seq = [7, 8, 9, 1, 2, 3, 4, 7, 8, 9, 1, 2]
    for t in range(4, len(seq) + 1):
        window = seq[max(0, t - 5):t]  # the worker sends only the last few tokens
        drafts, mask = c.batch_get(["r"], [window], [t])
        check_flat(drafts, mask, 1, 4)
    # The request's own context now holds all of seq, so "1 2" continues with "3 4".
    assert drafts[1:3].tolist() == [3, 4]
    c.erase_match_state(["r"])
    assert not c.has_request("r")


def test_overlapping_windows_count_each_occurrence_once():
    c = NgramCorpus(learn_prompts=False)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 1000, 60).tolist() for _ in range(3)]
    for t in range(18, 61, 3):  # SGLang re-sends the last 18 tokens after every step
        c.batch_put([s[t - 18:t] for s in seqs])
    for _ in range(3):
        c.batch_put([[1]])  # later steps without these requests: their documents close
    c.synchronize()
    assert c.stats()["learned_tokens"] == 3 * 60 + 3
    for i, s in enumerate(seqs):  # the joined documents continue across every window boundary
        for start in range(0, 50, 7):
            c.start_request(f"p{i}-{start}", s[start:start + 8])
            toks, parents, _ = c.draft([f"p{i}-{start}"], 6).tree(0)
            assert has_path(toks, parents, s[start + 8:start + 11]), (toks, parents, s[start + 8:start + 11])


def test_external_corpus_methods():
    c = NgramCorpus(draft_token_num=4)
    n = c.load_external_corpus_named("manual", iter([[10, 11, 12, 13], np.array([20, 21], dtype=np.int32)]))
    assert n == 6
    assert c.list_external_corpora() == {}
    c.commit_external_corpus_load("manual", n)
    assert c.list_external_corpora() == {"manual": 6}
    drafts, _ = c.batch_get(["r"], [[10, 11]], [2])
    assert drafts.tolist()[:3] == [11, 12, 13]
    c.remove_external_corpus("manual")
    assert c.list_external_corpora() == {}


def test_reset_keeps_external_corpora():
    c = NgramCorpus()
    c.load_external_corpus_named("x", [[1, 2]])
    c.commit_external_corpus_load("x", 2)
    c.batch_put([[5, 6, 7]])
    c.reset()
    assert c.stats()["learned_tokens"] == 0 and c.list_external_corpora() == {"x": 2}
