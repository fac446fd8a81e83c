"""The request-level API, batch forms, bad input, eviction and namespaces."""

from __future__ import annotations

import numpy as np
import pytest

from corpus_service import CorpusConfig, DraftBatch, Namespaces, NgramCorpus


def test_prompt_lookup_drafts_the_continuation():
    c = NgramCorpus()
    c.start_request("a", [5, 6, 7, 8, 9, 1, 5, 6, 7])
    toks, parents, probs = c.draft(["a"], 4).tree(0)
    assert toks[:2] == [8, 9] and parents[:2] == [-1, 0]
    assert all(0 < p <= 1 for p in probs) and probs == sorted(probs, reverse=True)


def test_learned_corpus_is_shared_across_requests():
    c = NgramCorpus(learn_prompts=False)
    c.start_request(1, [100])
    c.extend(1, [1, 2, 3, 4, 5, 6])
    c.finish(1)
    c.synchronize()
    c.start_request(2, [7, 1, 2, 3])
    toks, _, _ = c.draft([2], 3).tree(0)
    assert toks == [4, 5, 6]
    assert c.stats()["learned_tokens"] == 6  # outputs only: the prompt was not learned


def test_each_occurrence_counted_once_with_flush_chunks():
    c = NgramCorpus(flush_tokens=4, overlap=2, learn_prompts=False)
    c.start_request("a", [9])
    for t in range(10):
        c.extend("a", [t])
    c.finish("a")
    c.synchronize()
    s = c.stats()
    assert s["learned_tokens"] == 10  # indexed once each, chunks carry unindexed left context
    assert s["learned_stored_tokens"] > 10


def test_draft_batch_shapes_and_padding():
    c = NgramCorpus()
    c.start_requests(["x", "y"], [[1, 2, 1, 2, 1], np.array([3], dtype=np.int64)])
    d = c.draft(["x", "y"], 6)
    assert isinstance(d, DraftBatch) and len(d) == 2
    assert d.tokens.shape == d.parents.shape == d.probs.shape == (2, 6)
    assert d.tokens.dtype == np.int32 and d.probs.dtype == np.float32
    assert d.counts[1] == 0 and (d.tokens[1] == -1).all() and (d.parents[1] == -1).all()
    n = d.counts[0]
    assert n >= 1 and (d.tokens[0, n:] == -1).all()


def test_extend_batch_with_padded_array():
    c = NgramCorpus()
    c.start_requests(["x", "y"], [[1], [2]])
    c.extend_batch(["x", "y"], np.array([[3, 4, 0], [5, 0, 0]]), lengths=[2, 1])
    c.extend_batch(["x", "y"], [[6], []])
    c.finish_batch(["x", "y"])
    c.synchronize()
    assert sorted(c.learned_tokens()[c.learned_tokens() >= 0].tolist()) == [1, 2, 3, 4, 5, 6]


def test_early_stop_by_probability():
    c = NgramCorpus(min_prob=0.5)
    c.start_request("a", [1, 2, 3, 9, 1, 2, 3])
    _, _, probs = c.draft(["a"], 15).tree(0)
    assert all(p >= 0.5 for p in probs)
    assert len(probs) < 15


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: c.start_request("n", [1, -3]), ">= 0|\\[0, 2\\^31\\)"),
        (lambda c: c.start_request("n", [1, 2**40]), "\\[0, 2\\^31\\)"),
        (lambda c: c.start_request("n", np.array([1.5])), "integer array"),
        (lambda c: c.start_request("n", np.zeros((2, 2), dtype=np.int64)), "1-D"),
        (lambda c: c.start_request("live", [1]), "already live"),
        (lambda c: c.extend("nope", [1]), "unknown request id 'nope'"),
        (lambda c: c.draft(["live"], 0), "budget"),
        (lambda c: c.draft(["live"], 5000), "budget"),
        (lambda c: c.draft(["live", "nope"], 3), "unknown request id"),
        (lambda c: c.finish("nope"), "unknown request id"),
        (lambda c: c.start_request("v", [49152]), "outside the vocabulary \\(size 49152\\)"),
        (lambda c: c.commit_external_corpus("never"), "never started"),
        (lambda c: c.remove_external_corpus("never"), "no external corpus"),
        (lambda c: c.add_external_chunk("never", [1]), "not being loaded"),
        (lambda c: c.extend_batch(["live"], np.zeros((2, 3), dtype=np.int64)), "expected token_ids"),
        (lambda c: c.batch_get(["live"], [[1]], [1, 2]), "one entry per request"),
        (lambda c: c.batch_get(["w"], [[1, 2, 3]], [2]), "shorter than"),
    ],
)
def test_bad_input_raises_value_error(call, message):
    c = NgramCorpus(vocab_size=49152)
    c.start_request("live", [1, 2, 3])
    with pytest.raises(ValueError, match=message):
        call(c)
    # Nothing was lost and the engine still works.
    assert c.has_request("live")
    c.extend("live", [4])
    c.draft(["live"], 3)
    c.check_integrity()


@pytest.mark.parametrize("bad", ["string", 5, [1, "x"], [1, None], [True]])
def test_wrong_types_raise_type_error(bad):
    c = NgramCorpus()
    with pytest.raises(TypeError):
        c.start_request("a", bad)


def test_duplicate_external_corpus_name():
    c = NgramCorpus()
    c.load_external_corpus_named("docs", [[1, 2, 3]])
    with pytest.raises(ValueError, match="already being loaded"):  # staged, not yet committed
        c.load_external_corpus_named("docs", [[4]])
    c.commit_external_corpus_load("docs", 3)
    with pytest.raises(ValueError, match="already exists"):
        c.begin_external_corpus("docs")


@pytest.mark.parametrize(
    "field, value",
    [("mode", "fast"), ("own_orders", ()), ("own_orders", (1, 1)), ("learned_orders", (0,)), ("max_match", 1000),
     ("alpha", -1.0), ("alpha", float("nan")), ("min_prob", 2.0), ("vocab_size", -1), ("learned_max_bytes", 100),
     ("max_candidates", 0), ("max_depth", True)],
)
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        CorpusConfig(**{field: value})


def test_sglang_constructor_arguments():
    c = NgramCorpus(draft_token_num=12, match_type="PROB", capacity=100_000, max_trie_depth=18,
                    min_bfs_breadth=1, max_bfs_breadth=10, external_corpus_max_tokens=1000, sglang_ordering=True)
    assert c.config.mode == "prob" and c.config.max_depth == 18 and c.config.max_external_tokens == 1000
    with pytest.raises(ValueError, match="match_type"):
        NgramCorpus(match_type="DFS")


def test_external_corpus_visible_only_after_commit():
    c = NgramCorpus()
    c.start_request("a", [50, 51])
    c.begin_external_corpus("docs")
    c.add_external_chunk("docs", [50, 51, 52, 53])
    assert c.is_loading_external_corpus("docs")
    assert c.draft(["a"], 4).counts[0] == 0  # staged corpora are invisible
    assert c.list_external_corpora() == {}
    assert c.commit_external_corpus("docs") == 4
    assert c.list_external_corpora() == {"docs": 4}
    assert c.draft(["a"], 2).tree(0)[0] == [52, 53]
    c.remove_external_corpus("docs")
    assert c.draft(["a"], 4).counts[0] == 0


def test_external_budget_is_enforced():
    c = NgramCorpus(max_external_tokens=10)
    with pytest.raises(ValueError, match="max_external_tokens"):
        c.load_external_corpus_named("big", [list(range(8)), list(range(8))])
    assert not c.is_loading_external_corpus("big")  # aborted: the name is free again
    c.load_external_corpus_named("big", [list(range(8))])


def test_the_byte_bound_holds_for_items_large_against_it():
    """One insert item (a put of several sequences, or the insert thread's queue taken at once) can
    hold a good part of the bound: the store makes room before it, and never reserves past what
    the bound needs (it held 1.14x the bound when the insert thread took several items at once)."""
    bound = int(CorpusConfig().bytes_per_token() * 1024)
    c = NgramCorpus(CorpusConfig(learned_max_bytes=bound, learn_prompts=False))
    rng = np.random.default_rng(1)
    worst = 0.0
    for _ in range(12):
        c.batch_put([rng.integers(0, 50, 200).tolist() for _ in range(4)])
        c.synchronize()
        worst = max(worst, c.stats()["learned_bytes"])
    assert worst <= bound + 1024, (worst, bound)
    assert 0 < c.stats()["learned_stored_tokens"] <= 1024
    c.check_integrity()


def test_eviction_under_a_tiny_bound_never_fails():
    bound = int(CorpusConfig().bytes_per_token() * 1024)
    cfg = CorpusConfig(learned_max_bytes=bound, learn_prompts=False)
    c = NgramCorpus(cfg)
    rng = np.random.default_rng(0)
    for r in range(40):
        c.start_request(r, rng.integers(0, 50, 5))
        c.extend(r, rng.integers(0, 50, 200))
        c.draft([r], 8)
        c.finish(r)
    c.synchronize()
    s = c.stats()
    assert s["learned_stored_tokens"] <= 1024
    assert s["learned_tokens"] > 0
    assert s["learned_bytes"] <= bound + 1024  # the byte bound holds (plus the object itself)
    c.check_integrity()
    c.start_request("q", c.learned_tokens()[-20:-10].clip(0))
    assert c.draft(["q"], 5).counts[0] > 0  # recent data is still found


def test_idle_requests_expire():
    c = NgramCorpus(request_ttl_s=0.05)
    c.start_request("old", [1, 2])
    import time

    time.sleep(1.2)  # the sweep runs at most once a second
    c.start_request("new", [3])
    assert not c.has_request("old") and c.has_request("new")


def test_namespaces_are_independent():
    ns = Namespaces()
    a = ns.create("llama3", CorpusConfig(vocab_size=128256))
    b = ns.create("smollm2", CorpusConfig(vocab_size=49152))
    a.start_request("r", [100000, 5])
    with pytest.raises(ValueError, match="vocabulary"):
        b.start_request("r", [100000, 5])
    assert ns.names() == ["llama3", "smollm2"]
    with pytest.raises(ValueError, match="already exists"):
        ns.create("llama3")
    with pytest.raises(ValueError, match="namespace"):
        ns.create("../etc")
    with pytest.raises(KeyError, match="unknown namespace"):
        ns.get("qwen")
    ns.drop("llama3")
    assert "llama3" not in ns


def test_typed_exceptions_are_value_errors():
    from corpus_service import exceptions as ex

    c = NgramCorpus(max_requests=1, max_external_tokens=4)
    c.start_request("a", [1])
    cases = [
        (lambda: c.extend("zz", [1]), ex.UnknownRequestError),
        (lambda: c.start_request("a", [1]), ex.AlreadyExistsError),
        (lambda: c.start_request("b", [1]), ex.LimitExceededError),
        (lambda: c.remove_external_corpus("none"), ex.NotFoundError),
        (lambda: c.load_external_corpus_named("big", [[1, 2, 3, 4, 5]]), ex.LimitExceededError),
        (lambda: c.draft(["a"], 100_000), ex.BudgetTooLargeError),  # a smaller budget will do
    ]
    for call, cls in cases:
        with pytest.raises(cls) as info:
            call()
        assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="budget") as info:
        c.draft(["a"], 0)
    assert not isinstance(info.value, ex.BudgetTooLargeError)
    from corpus_service.protocol.status import status_for

    assert status_for(ex.BudgetTooLargeError("x")).name == "OUT_OF_RANGE"


def test_start_without_learning_the_prompt():
    c = NgramCorpus(learn_prompts=True)
    c.start_request("restored", [1, 2, 3, 4], learn_prompt=False)
    c.extend("restored", [5, 6])
    c.finish("restored")
    c.start_request("fresh", [7, 8], learn_prompt=None)
    c.finish("fresh")
    c.synchronize()
    assert c.stats()["learned_tokens"] == 2 + 2  # only the new output and the fresh prompt


def test_extend_batch_is_all_or_nothing():
    c = NgramCorpus(vocab_size=100)
    c.start_requests(["x", "y"], [[1], [2]])
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        c.extend_batch(["x", "nope"], [[3], [4]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        c.extend_batch(["x", "y"], [[3], [400]])
    with pytest.raises(ValueError, match="integer array"):
        c.extend_batch(["x"], np.array([[1.5]]))
    c.finish_batch(["x", "y"])
    c.synchronize()
    assert c.stats()["learned_tokens"] == 2  # the refused batches left nothing behind


def test_extend_batch_of_int32_runs_is_checked_natively_and_all_or_nothing():
    """The verifier's per-step form (int32 runs, int64 lengths) skips the Python conversions; the
    native call still refuses bad input with a ValueError before changing anything."""
    c = NgramCorpus(vocab_size=100)
    c.start_requests(["x", "y"], [[1], [2]])
    runs, lens = np.array([3, 4, 5], np.int32), np.array([2, 1], np.int64)
    for toks, lengths, message in [
        (np.array([3, -4, 5], np.int32), lens, "must be >= 0"),
        (np.array([3, 400, 5], np.int32), lens, "outside the vocabulary"),
        (runs, np.array([2, 2], np.int64), "add up to 4 but 3"),
        (runs, np.array([4, -1], np.int64), "lengths must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            c.extend_batch(["x", "y"], toks, lengths)
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        c.extend_batch(["x", "nope"], runs, lens)
    c.extend_batch(["x", "y"], runs, lens)
    c.finish_batch(["x", "y"])
    c.synchronize()
    assert sorted(c.learned_tokens()[c.learned_tokens() >= 0].tolist()) == [1, 2, 3, 4, 5]


def test_batch_get_with_per_call_draft_token_num():
    c = NgramCorpus(draft_token_num=8)
    c.batch_put([[1, 2, 3, 4, 5, 6]])
    c.synchronize()
    d4, m4 = c.batch_get(["a"], [[1, 2]], [2], draft_token_num=4)
    assert d4.shape == (4,) and m4.shape == (16,) and d4.tolist()[:4] == [2, 3, 4, 5]
    d8, _ = c.batch_get(["b"], [[1, 2]], [2])
    assert d8.shape == (8,)
    with pytest.raises(ValueError, match="draft_token_num"):
        c.batch_get(["a"], [[1, 2]], [2], draft_token_num=0)


def test_enough_long_candidates_skip_short_orders():
    seq = [7, 3, 8, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]  # "... 1 2 3": two long matches, one "7 3"
    for enough, expect_short in ((2, False), (0, True)):
        c = NgramCorpus(enough_candidates=enough, enough_order=3, learn_prompts=False)
        c.start_request("a", seq)
        toks, parents, _ = c.draft(["a"], 30).tree(0)  # room for every candidate
        roots = {t for t, p in zip(toks, parents) if p == -1}
        assert {4, 5} <= roots
        assert (8 in roots) == expect_short


def test_memory_bound_holds_with_a_long_insert_queue():
    bound = int(CorpusConfig().bytes_per_token() * 4096)
    c = NgramCorpus(learned_max_bytes=bound)
    rng = np.random.default_rng(5)
    for r in range(100):  # finishes queue inserts faster than the worker applies them
        c.start_request(r, rng.integers(0, 1000, 50))
        c.extend(r, rng.integers(0, 1000, 300))
        c.finish(r)
    c.synchronize()
    s = c.stats()
    assert s["learned_stored_tokens"] <= 4096
    assert s["learned_bytes"] <= bound + 1024
    c.check_integrity()


def test_request_size_is_bounded():
    from corpus_service.exceptions import LimitExceededError

    c = NgramCorpus(max_request_tokens=10)
    with pytest.raises(LimitExceededError, match="max_request_tokens"):
        c.start_request("big", list(range(11)))
    c.start_request("a", list(range(8)))
    with pytest.raises(LimitExceededError):
        c.extend("a", [1, 2, 3])
    with pytest.raises(LimitExceededError):
        c.extend_batch(["a"], [[1, 2, 3]])
    c.extend("a", [1, 2])  # exactly at the bound is fine
    c.check_integrity()


def test_draft_compact_is_draft_without_padding():
    c = NgramCorpus()
    rng = np.random.default_rng(11)
    ids = [f"r{i}" for i in range(6)]
    c.start_requests(ids, [rng.integers(0, 8, 40) for _ in ids])
    c.start_request("empty", [999])
    ids.append("empty")
    d = c.draft(ids, 9)
    counts, tokens, parents, probs = c.draft_compact(ids, 9)
    keep = np.arange(9)[None, :] < d.counts[:, None]
    assert (counts == d.counts).all() and counts[-1] == 0
    assert (tokens == d.tokens[keep]).all() and (parents == d.parents[keep]).all() and (probs == d.probs[keep]).all()
    flat = np.arange(30).astype(np.int32)
    c.extend_batch(ids[:3], flat[:6], [1, 2, 3])
    with pytest.raises(ValueError, match="add up to"):
        c.extend_batch(ids[:3], flat[:6], [1, 2, 2])


@pytest.mark.parametrize("reps,finds_other", [(20, True), (200, False)])
def test_a_looping_requests_own_chunks_are_skipped_within_a_bound(reps, finds_other):
    """A request's own chunks in the learned corpus are skipped without using up the chain budget
    (max_chain), so another request's occurrence behind them is still found; but a request caught
    in a generation loop puts its own positions by the hundred at the head of the loop's chains,
    and the walk stops after kSkippedPerStep (16) per step of the budget (here 2 * 16 = 32), where
    walking them all made its drafts cost milliseconds."""
    c = NgramCorpus(learn_prompts=False, flush_tokens=3, overlap=0, max_chain=2)
    c.start_request("other", [1])
    c.extend("other", [3, 4, 5, 99, 98])
    c.finish("other")
    c.start_request("loop", [7])
    for _ in range(reps):
        c.extend("loop", [3, 4, 5])
    c.synchronize()
    toks, parents, _ = c.draft(["loop"], 8).tree(0)
    first = [t for t, p in zip(toks, parents) if p == -1]
    assert first[0] == 3  # the loop itself, from the request's own context
    assert (99 in first) == finds_other


def test_extend_runs_reads_lists_natively_and_is_all_or_nothing():
    """extend_runs (the verifier's per-step commits, lists of ints read through the C API) learns
    what extend_batch learns, and refuses bad input before changing anything."""
    a, b = NgramCorpus(vocab_size=100), NgramCorpus(vocab_size=100)
    for c in (a, b):
        c.start_requests(["x", "y"], [[1, 2], [2]])
    a.extend_runs(["x", "y"], [[3, 4], [5]])
    b.extend_batch(["x", "y"], [[3, 4], [5]])
    a.extend_runs(("x", "y"), ([], np.array([6, 7], np.int64)))
    b.extend_batch(["x", "y"], [[], [6, 7]])
    for bad, match in (([[3], [400]], "outside the vocabulary"), ([[3], [-1]], "extend_runs: expected token ids"),
                       ([[3]], "2 request ids but 1")):
        with pytest.raises(ValueError, match=match):
            a.extend_runs(["x", "y"], bad)
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        a.extend_runs(["x", "nope"], [[3], [4]])
    with pytest.raises(TypeError):
        a.extend_runs(["x", "y"], [[1.5], [2]])
    for c in (a, b):
        c.finish_batch(["x", "y"])
        c.synchronize()
    assert a.learned_tokens().tolist() == b.learned_tokens().tolist()


def test_learn_documents_stores_what_closed_puts_store():
    """A replica applies its log's chunks with learn_documents: each one closed document, the same
    stored tokens and drafts as batch_put([doc]) followed by two empty puts (its previous way)."""
    rng = np.random.default_rng(5)
    phrases = [rng.integers(0, 50, int(rng.integers(1, 20))) for _ in range(30)]
    docs = [np.concatenate([phrases[i] for i in rng.integers(0, 30, int(rng.integers(1, 6)))]) for _ in range(200)]
    docs += [docs[3], docs[3][:4], np.array([7], np.int64)]  # repeated and shorter than a put's tail key
    a, b = NgramCorpus(CorpusConfig(vocab_size=50)), NgramCorpus(CorpusConfig(vocab_size=50))
    for d in docs:
        a.batch_put([d])
        a.batch_put([])
        a.batch_put([])
    for i in range(0, len(docs), 17):
        b.learn_documents(docs[i:i + 17])
    b.learn_documents([])
    a.synchronize(), b.synchronize()
    assert a.learned_tokens().tolist() == b.learned_tokens().tolist()
    for i, d in enumerate(docs[:40]):
        for c in (a, b):
            c.start_request(f"r{i}", d[: max(1, d.size // 2)])
        assert a.draft([f"r{i}"], 8).tree(0) == b.draft([f"r{i}"], 8).tree(0)
    with pytest.raises(ValueError, match="documents"):
        b.learn_documents([[1, 2, 50]])  # outside the vocabulary
    with pytest.raises(TypeError):
        b.learn_documents("abc")
