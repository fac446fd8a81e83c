"""Conformance of the SGLang-compatible methods: shapes, dtypes, padding, masks, window de-duplication
and gaps; the drop-in's draft modes (in process and remote); its MAT under SGLang's calling pattern
against the reference reimplementation of SGLang's corpus (bench/sglang_reference.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

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


# ---------------------------------------------------------------------- draft modes of the drop-in

def test_default_mode_is_score_whatever_match_type_sglang_passes(caplog):
    for match_type in ("BFS", "PROB", "bfs", None):
        assert NgramCorpus(draft_token_num=16, match_type=match_type).config.mode == "score"
    with caplog.at_level(logging.INFO, logger="corpus_service.engine.corpus"):
        NgramCorpus(match_type="PROB")
    assert "match_type='PROB' is accepted for SGLang compatibility; drafting in mode 'score'" in caplog.text
    # SGLang's orderings on request: match_type picks them (BFS when it is not given, as in SGLang).
    assert NgramCorpus(draft_token_num=16, match_type="BFS", sglang_ordering=True).config.mode == "bfs"
    assert NgramCorpus(draft_token_num=16, match_type="PROB", sglang_ordering=True).config.mode == "prob"
    assert NgramCorpus(sglang_ordering=True).config.mode == "bfs"
    assert NgramCorpus(match_type="BFS", mode="prob").config.mode == "prob"  # an explicit mode still wins
    with pytest.raises(ValueError, match="sglang_ordering.*mode='score'"):
        NgramCorpus(match_type="PROB", sglang_ordering=True, mode="score")
    with pytest.raises(ValueError, match="sglang_ordering: expected a bool"):
        NgramCorpus(sglang_ordering="yes")
    with pytest.raises(ValueError, match="match_type"):
        NgramCorpus(match_type="DFS", sglang_ordering=True)


def _recency_vs_frequency(corpus: NgramCorpus) -> int:
    """The node drafted after "1 2 3" when "4" followed it twice and then "9" once, most recently."""
    corpus.batch_put([[50, 1, 2, 3, 4, 70], [51, 1, 2, 3, 4, 71]])
    corpus.synchronize()
    corpus.batch_put([[52, 1, 2, 3, 9, 72]])
    corpus.synchronize()
    drafts, mask = corpus.batch_get(["q"], [[1, 2, 3]], [3])
    check_flat(drafts, mask, 1, 2)
    return int(drafts[1])


def test_sglang_orderings_stay_reachable_and_keep_their_behaviour():
    # BFS: the most recent continuation first; PROB: the most frequent one.
    assert _recency_vs_frequency(NgramCorpus(draft_token_num=2, match_type="BFS", sglang_ordering=True)) == 9
    assert _recency_vs_frequency(NgramCorpus(draft_token_num=2, match_type="PROB", sglang_ordering=True)) == 4


def test_default_trees_are_not_cut_at_sglangs_trie_depth():
    seq = list(range(300, 340))
    for ordered, depth in ((False, 31), (True, 18)):
        c = NgramCorpus(draft_token_num=32, match_type="BFS", max_trie_depth=18, sglang_ordering=ordered)
        c.batch_put([seq])
        c.synchronize()
        drafts, mask = c.batch_get(["q"], [seq[:5]], [5])
        check_flat(drafts, mask, 1, 32)
        assert drafts[1:depth + 1].tolist() == seq[5:5 + depth]  # one chain, as deep as the tree may go
        assert mask.reshape(32, 32).sum(axis=1).max() == depth + 1


# ---------------------------------------------------------------------- window handling

def test_a_step_that_commits_more_than_the_window_keeps_the_request_history():
    # draft_token_num above the window: one step can commit more tokens than the next window shows.
    c = NgramCorpus(draft_token_num=4, learn_prompts=False)
    history = list(range(100, 140))                      # the request's first 40 tokens
    c.batch_get(["r"], [history[-18:]], [40])            # the corpus sees history[22:40]
    later = list(range(200, 222)) + history[24:27]       # 25 tokens later, ending as history[24:27] did
    drafts, _ = c.batch_get(["r"], [later[-18:]], [65])  # 25 new tokens, an 18-token window: a gap
    # Its own history still drafts (only the windows reached it: nothing was put).
    assert drafts[1:4].tolist() == history[27:30]
    # ... and the window after the gap goes on as usual.
    drafts, _ = c.batch_get(["r"], [later[-16:] + history[27:29]], [67])
    assert drafts[1:3].tolist() == history[29:31]


def test_put_windows_reach_other_requests_within_eight_tokens():
    # A batch's requests draft from each other's fresh output (SGLang puts every request's window
    # after every step); the joined windows become visible 8 tokens at a time.
    c = NgramCorpus(draft_token_num=8)
    seq = list(range(500, 560))
    for t in range(18, 27, 2):  # the first window, then 2 tokens per step: 8 after it
        c.batch_put([seq[t - 18:t]])
    c.synchronize()
    drafts, _ = c.batch_get(["other"], [[1, 2] + seq[16:20]], [6])
    assert drafts[1:7].tolist() == seq[20:26]
    assert c.stats()["learned_tokens"] == 26  # each token once


# ---------------------------------------------------------------------- SGLang's calling pattern

def test_sglang_reference_reproduces_sglangs_example_and_orderings():
    """The peer of the replay: SGLang's own example (its ngram_corpus.py) and its two orderings."""
    from bench.sglang_reference import SGLangNgramReference

    c = SGLangNgramReference(8, "BFS", max_trie_depth=12, max_bfs_breadth=8)
    c.batch_put([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 44, 55, 66, 77, 88, 99, 100]])
    drafts, mask = c.batch_get(["q0", "q1", "q2"], [[1, 2, 3], [3, 44], [3, 6, 999]], [3, 2, 3])
    check_flat(drafts, mask, 3, 8)
    d, m = drafts.reshape(3, 8), mask.reshape(3, 8, 8)
    assert sorted(d[0, 1:].tolist()) == [4, 5, 6, 44, 55, 66, 77]  # both branches, breadth first
    paths = {tuple(d[0, np.flatnonzero(m[0, j])].tolist()) for j in range(8)}
    assert (3, 4, 5, 6) in paths and (3, 44, 55, 66, 77) in paths
    assert d[1].tolist() == [44, 55, 66, 77, 88, 99, 100, 0]  # one chain, then padding
    assert d[2].tolist() == [999] + [0] * 7  # nothing matches
    assert _recency_vs_frequency(SGLangNgramReference(2, "BFS")) == 9
    assert _recency_vs_frequency(SGLangNgramReference(2, "PROB")) == 4


def test_default_drafts_at_least_as_well_as_sglang_under_its_calling_pattern():
    """Deterministic MAT of a shipped trace replayed as SGLang's NGRAM worker calls its corpus."""
    from bench.sglang_pattern import replay_sglang
    from bench.sglang_reference import SGLangNgramReference
    from bench.traces import REPO, load_traces

    traces = load_traces(REPO / "bench" / "data" / "traces" / "humaneval164_t07x4.jsonl", limit=48)
    k = 16
    default = replay_sglang(traces, NgramCorpus(draft_token_num=k, match_type="BFS", max_trie_depth=18), k)
    ordered = replay_sglang(traces, NgramCorpus(draft_token_num=k, match_type="BFS", sglang_ordering=True), k)
    sglang = replay_sglang(traces, SGLangNgramReference(k, "BFS"), k)
    assert default["mat"] >= ordered["mat"] and default["mat"] >= sglang["mat"], (default, ordered, sglang)


# ---------------------------------------------------------------------- the remote drop-in

@pytest.fixture(scope="module")
def ordered_server(tmp_path_factory):
    """A real server with a default namespace and one set to SGLang's BFS ordering."""
    from tests.corpus_service.service_fixtures import ServerProcess

    srv = ServerProcess(tmp_path_factory.mktemp("sglang"), "--namespace", "default", "--namespace", "ordered:mode=bfs")
    srv.start()
    yield srv
    if srv.alive():
        srv.stop()


SGLANG_ARGS = dict(match_type="BFS", max_trie_depth=18, min_bfs_breadth=1, max_bfs_breadth=10, capacity=10_000_000,
                   external_sam_budget=0, external_corpus_max_tokens=10_000_000)  # what SGLang's worker passes


def test_remote_drop_in_drafts_in_its_namespace_mode(ordered_server):
    from bench.sglang_pattern import replay_sglang
    from bench.traces import REPO, load_traces
    from corpus_service.client import RemoteNgramCorpus
    from tests.corpus_service.service_fixtures import TOKEN

    remote = {ns: RemoteNgramCorpus(ordered_server.target, ns, draft_token_num=2, token=TOKEN, **SGLANG_ARGS)
              for ns in ("default", "ordered")}
    try:
        assert _recency_vs_frequency(remote["default"]) == 4  # score, though SGLang asked for BFS
        assert _recency_vs_frequency(remote["ordered"]) == 9  # the namespace's mode=bfs
        remote["default"].reset()  # an admin action: the token
        traces = load_traces(REPO / "bench" / "data" / "traces" / "humaneval164_t07x4.jsonl", limit=6)
        remote["k16"] = RemoteNgramCorpus(ordered_server.target, "default", draft_token_num=16, **SGLANG_ARGS)
        got = replay_sglang(traces, remote["k16"], 16)
        expect = replay_sglang(traces, NgramCorpus(draft_token_num=16, **SGLANG_ARGS), 16)
        assert got["mat"] == expect["mat"] and got["steps"] == expect["steps"]
    finally:
        for r in remote.values():
            r.close()
    with pytest.raises(ValueError, match="--namespace ordered:mode=prob"):
        RemoteNgramCorpus(ordered_server.target, "ordered", match_type="PROB", sglang_ordering=True)
    with pytest.raises(ValueError, match="match_type"):
        RemoteNgramCorpus(ordered_server.target, "ordered", match_type="DFS")
