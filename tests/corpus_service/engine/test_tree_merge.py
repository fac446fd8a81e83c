"""merge_with_earlier: a fresh draft tree united with an earlier one re-rooted along the tokens
committed since (the verifier's pipelined remote drafts)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from corpus_service.engine.corpus import DraftBatch, merge_with_earlier


def batch(trees, width):
    """trees: [(tokens, parents, probs)] -> a padded DraftBatch."""
    n = len(trees)
    t = np.full((n, width), -1, np.int32)
    p = np.full((n, width), -1, np.int32)
    q = np.zeros((n, width), np.float32)
    c = np.zeros(n, np.int32)
    for i, (tok, par, prob) in enumerate(trees):
        k = len(tok)
        t[i, :k], p[i, :k], q[i, :k], c[i] = tok, par, prob, k
    return DraftBatch(t, p, q, c)


def paths(b: DraftBatch, i: int) -> dict[tuple[int, ...], float]:
    tok, par, prob = b.tree(i)
    out, seen = {}, []
    for t, p, q in zip(tok, par, prob):
        assert -1 <= p < len(seen), "parents come before children"
        path = (seen[p] if p >= 0 else ()) + (t,)
        seen.append(path)
        out[path] = q
    return out


FRESH = ([5, 6, 7], [-1, 0, -1], [0.8, 0.5, 0.1])  # 5 -> 6, and 7
# Drafted one step earlier: 1 -> 2 -> {3 -> 4, 9}; the step committed 1, 2.
EARLIER = ([1, 2, 3, 9, 4], [-1, 0, 1, 1, 2], [0.9, 0.6, 0.48, 0.06, 0.3])


def test_rerooted_subtree_is_united_with_the_fresh_tree():
    out = merge_with_earlier(batch([FRESH], 4), batch([EARLIER], 6), [[1, 2]], 8)
    got = paths(out, 0)
    # Below 1, 2 (probability 0.6): 3 (0.48 / 0.6), 3 -> 4 (0.3 / 0.6), 9 (0.06 / 0.6).
    want = {(5,): 0.8, (5, 6): 0.5, (7,): 0.1, (3,): 0.8, (3, 4): 0.5, (9,): 0.1}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6)


def test_shared_paths_keep_the_larger_probability_and_the_budget_keeps_the_best():
    fresh = ([3, 4], [-1, 0], [0.5, 0.2])
    out = merge_with_earlier(batch([fresh], 2), batch([EARLIER], 6), [[1, 2]], 3)
    got = paths(out, 0)
    assert got == pytest.approx({(3,): 0.8, (3, 4): 0.5, (9,): 0.1})
    out = merge_with_earlier(batch([fresh], 2), batch([EARLIER], 6), [[1, 2]], 2)
    assert paths(out, 0) == pytest.approx({(3,): 0.8, (3, 4): 0.5})


def test_a_path_the_earlier_tree_lacks_leaves_the_fresh_tree_alone():
    fresh = batch([FRESH], 4)
    for since in ([1, 7], [8], [1, 2, 3, 4, 5]):
        out = merge_with_earlier(fresh, batch([EARLIER], 6), [since], 4)
        assert paths(out, 0) == paths(fresh, 0)


def test_no_committed_tokens_merges_the_earlier_tree_as_is_and_empty_rows_pass_through():
    out = merge_with_earlier(batch([FRESH, FRESH], 4), batch([EARLIER, ([], [], [])], 6), [[], [1]], 16)
    assert paths(out, 0).keys() == set(paths(batch([FRESH], 4), 0)) | set(paths(batch([EARLIER], 6), 0))
    assert paths(out, 1) == paths(batch([FRESH], 4), 0)
    assert out.tokens.shape == (2, 16)


def test_bad_inputs_raise_value_error():
    f, e = batch([FRESH], 4), batch([EARLIER], 6)
    with pytest.raises(ValueError, match="fresh trees"):
        merge_with_earlier(f, e, [[1], [2]], 4)
    with pytest.raises(ValueError, match="budget"):
        merge_with_earlier(f, e, [[1]], 0)
    bad = DraftBatch(e.tokens, e.parents, e.probs, np.array([7], np.int32))
    with pytest.raises(ValueError, match="count"):
        merge_with_earlier(f, bad, [[1]], 4)
    with pytest.raises(ValueError, match="since"):  # the binding reads since itself
        merge_with_earlier(f, e, [[1, -2]], 4)
    with pytest.raises(ValueError, match="since"):
        merge_with_earlier(f, e, [[1, 1 << 40]], 4)
    with pytest.raises(TypeError):
        merge_with_earlier(f, e, [[1.5]], 4)
    with pytest.raises(TypeError):
        merge_with_earlier(f, e, [7], 4)


def test_since_may_be_any_sequence_and_arrays_any_dtype():
    """numpy ints, tuples and arrays of other dtypes are accepted as the numpy path accepted them."""
    f, e = batch([FRESH], 4), batch([EARLIER], 6)
    want = merge_with_earlier(f, e, [[1, 2]], 8)
    e64 = DraftBatch(e.tokens.astype(np.int64), e.parents.astype(np.int64), e.probs.astype(np.float64), e.counts)
    for since, earlier in (([np.array([1, 2])], e), ([(np.int64(1), 2)], e), ([[1, 2]], e64)):
        got = merge_with_earlier(f, earlier, since, 8)
        assert got.tree(0) == want.tree(0)


@st.composite
def trees(draw, width):
    n = draw(st.integers(0, width))
    tok, par, prob = [], [], []
    for i in range(n):
        p = draw(st.integers(-1, i - 1))
        q = draw(st.floats(0.0, 1.0 if p < 0 else prob[p], allow_nan=False, width=32))
        tok.append(draw(st.integers(0, 5)))
        par.append(p)
        prob.append(q)
    return tok, par, prob


@settings(max_examples=200, deadline=None)
@given(trees(8), trees(12), st.lists(st.integers(0, 5), max_size=3), st.integers(1, 10))
def test_merged_trees_are_valid_and_their_paths_come_from_the_sources(fresh, earlier, since, budget):
    out = merge_with_earlier(batch([fresh], 8), batch([earlier], 12), [since], budget)
    got = paths(out, 0)  # asserts parents before children
    assert len(got) <= budget and int(out.counts[0]) == len(got)
    # Best first, as the corpus ranks its own trees: the verifier sizes and prunes rows without sorting.
    row = out.probs[0, :len(got)]
    assert np.all(row[1:] <= row[:-1])
    src = paths(batch([fresh], 8), 0)
    old = paths(batch([earlier], 12), 0)
    mask = int(out.earlier_only[0])
    for k, (path, q) in enumerate(got.items()):
        assert 0.0 <= q <= 1.0
        if len(path) > 1:
            assert q <= got[path[:-1]] + 1e-6, "probabilities never grow along a path"
        assert path in src or tuple(since) + path in old
        # earlier_only marks exactly the nodes the fresh tree does not have
        assert bool(mask >> k & 1) == (path not in src)
    assert mask >> len(got) == 0
    # Accepting any path of the merged tree counts its nodes the fresh tree lacks.
    for path in got:
        assert out.earlier_accepted([0], [list(path)]).tolist() == [sum(path[:j] not in src for j in range(1, len(path) + 1))]


def test_draft_merged_is_the_corpus_draft_merged_with_the_earlier_trees():
    """NgramCorpus.draft_merged (one native call) gives what draft() then merge_with_earlier() give,
    for requests whose earlier tree holds the committed path, lacks it, or is empty."""
    from corpus_service import NgramCorpus

    corpus = NgramCorpus()
    corpus.start_request("a", [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2])
    corpus.start_request("b", [7, 8, 9, 7, 8, 9, 7, 8])
    corpus.start_request("c", [4, 4, 4])
    earlier = batch([EARLIER, ([9, 7], [-1, 0], [0.9, 0.8]), ([], [], [])], 6)
    since = [[1, 2], [5], []]
    for budget in (1, 4, 9):
        want = merge_with_earlier(corpus.draft(["a", "b", "c"], budget), earlier, since, budget)
        got = corpus.draft_merged(["a", "b", "c"], budget, earlier, since)
        for w, g in zip((want.tokens, want.parents, want.probs, want.counts, want.earlier_only),
                        (got.tokens, got.parents, got.probs, got.counts, got.earlier_only)):
            assert np.array_equal(w, g)
    assert got.earlier_only.dtype == np.uint64 and corpus.draft(["a"], 4).earlier_only is None
    with pytest.raises(ValueError, match="3 request ids, 2 earlier trees"):
        corpus.draft_merged(["a", "b", "c"], 4, batch([EARLIER, EARLIER], 6), since)
    with pytest.raises(ValueError, match="budget"):
        corpus.draft_merged(["a", "b", "c"], 0, earlier, since)


def test_pooled_draft_merged_equals_the_serial_merge():
    """With a draft pool (batches of at least 8 requests per thread), each row is merged on the
    thread that drafted it: the same trees as draft() then merge_with_earlier()."""
    from corpus_service import NgramCorpus
    from corpus_service.engine.config import CorpusConfig

    corpus = NgramCorpus(CorpusConfig(draft_threads=2))
    rng = np.random.default_rng(7)
    ids = [f"r{i}" for i in range(40)]
    for rid in ids:
        corpus.start_request(rid, rng.integers(0, 12, 60).tolist())
    old = corpus.draft(ids, 12)  # the "earlier" trees, then a few committed tokens each
    since = [rng.integers(0, 12, int(rng.integers(0, 3))).tolist() for _ in ids]
    corpus.extend_runs(ids, since)
    for budget in (3, 9):
        want = merge_with_earlier(corpus.draft(ids, budget), old, since, budget)
        got = corpus.draft_merged(ids, budget, old, since)
        for w, g in zip((want.tokens, want.parents, want.probs, want.counts), (got.tokens, got.parents, got.probs, got.counts)):
            assert np.array_equal(w, g)


def test_since_from_reroots_along_the_requests_own_tokens():
    """draft_merged(since_from=...) re-roots each earlier tree along the tokens its request
    committed after the given context length: the same trees as the explicit ``since`` paths; a
    length the request does not hold (-1: not live when asked, or longer than its context) merges
    nothing, so the fresh tree stands alone."""
    from corpus_service import NgramCorpus

    corpus = NgramCorpus()
    corpus.start_request("a", [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2])
    corpus.start_request("b", [7, 8, 9, 7, 8, 9, 7, 8])
    lengths = corpus.context_lengths(["a", "b", "gone"])
    assert lengths.tolist() == [14, 8, -1] and lengths.dtype == np.int64
    earlier = corpus.draft(["a", "b"], 12)
    corpus.extend_runs(["a", "b"], [[3, 4], [9]])
    assert corpus.context_tail("a", 3).tolist() == [2, 3, 4] and corpus.context_tail("b", 0).tolist() == []
    for budget in (2, 7):
        want = corpus.draft_merged(["a", "b"], budget, earlier, [[3, 4], [9]])
        got = corpus.draft_merged(["a", "b"], budget, earlier, since_from=lengths[:2])
        for w, g in zip((want.tokens, want.parents, want.probs, want.counts), (got.tokens, got.parents, got.probs, got.counts)):
            assert np.array_equal(w, g)
        alone = corpus.draft(["a", "b"], budget)
        far = corpus.draft_merged(["a", "b"], budget, earlier, since_from=np.array([-1, 10**6]))
        for w, g in zip((alone.tokens, alone.parents, alone.probs, alone.counts), (far.tokens, far.parents, far.probs, far.counts)):
            assert np.array_equal(w, g)
    with pytest.raises(ValueError, match="since or since_from"):
        corpus.draft_merged(["a", "b"], 4, earlier)
    with pytest.raises(ValueError, match="since or since_from"):
        corpus.draft_merged(["a", "b"], 4, earlier, [[], []], since_from=lengths[:2])
    with pytest.raises(ValueError, match="since"):
        corpus.draft_merged(["a", "b"], 4, earlier, since_from=lengths)
    with pytest.raises(ValueError, match="holds 16 tokens"):
        corpus.context_tail("a", 17)
    with pytest.raises(ValueError, match="unknown request"):
        corpus.context_tail("gone", 1)


def test_earlier_accepted_counts_the_accepted_nodes_only_the_earlier_tree_drafted():
    """What the pipelined drafter scores its remote asks by: of the tokens a request accepted, the
    nodes of the merged tree that came from the earlier (remote) tree alone."""
    out = merge_with_earlier(batch([FRESH, FRESH], 4), batch([EARLIER, ([], [], [])], 6), [[1, 2], []], 8)
    # Row 0: fresh 5 -> 6 and 7; the re-rooted earlier tree adds 3 -> 4 and 9.
    assert out.earlier_accepted([0], [[5, 6]]).tolist() == [0]
    assert out.earlier_accepted([0], [[3, 4]]).tolist() == [2]
    assert out.earlier_accepted([0], [[3, 8]]).tolist() == [1]  # the walk stops at the first token it lacks
    got = out.earlier_accepted([0, 1, 0], [[9], [3], []])  # row 1 merged nothing
    assert got.tolist() == [1, 0, 0] and got.dtype == np.int64
    assert out.earlier_accepted([], []).tolist() == []
    assert int(out.earlier_only[1]) == 0
    assert batch([FRESH], 4).earlier_accepted([0], [[5]]).tolist() == [0]  # not a merged batch
    with pytest.raises(ValueError, match="rows"):
        out.earlier_accepted([2], [[5]])
    with pytest.raises(ValueError, match="2 rows but 1 paths"):
        out.earlier_accepted([0, 1], [[5]])
    with pytest.raises(ValueError, match="paths"):
        out.earlier_accepted([0], [[-5]])
