"""The rank model (CorpusConfig.rank_model, csrc/rank_model.h): an online acceptance model learned
from every commit that ranks the draft tree's nodes; its state is bounded, snapshotted and exchanged
between replicas as deltas."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from corpus_service import CorpusConfig, NgramCorpus
from corpus_service._native import RANK_DELTA_WORDS as W
from corpus_service._native import RANK_DELTA_WORDS_V1 as W1
from corpus_service.server.config import NamespaceSpec
from tests.corpus_service.engine.test_acceptance_feedback import ROUNDS, a, b, rounds_corpus, x, y

DATA = Path(__file__).resolve().parents[2] / "data"


def replay_rounds(**config) -> list[int]:
    """Round i: the context ends with a(i) b(i); the prompt once continued it with x(i), the learned
    corpus (three times, at a tenth of the weight) with y(i); the verifier commits y(i). Returns the
    top-ranked first token of each round's draft."""
    c = rounds_corpus(CorpusConfig(learn_prompts=False, flush_tokens=8, history_max_bytes=0, **config))
    firsts = []
    for i in range(ROUNDS):
        toks, parents, _ = c.draft(["r"], 6).tree(0)
        assert {x(i), y(i)} <= {t for t, p in zip(toks, parents) if p == -1}  # both drafted, so both tested
        firsts.append(toks[0])  # nodes come best first
        c.extend("r", [y(i), a(i + 1), b(i + 1)])
    return firsts


def test_ranking_changes_after_feedback():
    today = replay_rounds()
    model = replay_rounds(rank_model=True)
    assert today == [x(i) for i in range(ROUNDS)]  # the raw estimate keeps preferring the own context
    assert model[0] == x(0)  # an empty model ranks as the calibrated estimate does ...
    assert model[-4:] == [y(i) for i in range(ROUNDS - 4, ROUNDS)]  # ... then learns what is accepted


def token_probs(rounds: int) -> tuple[float, float]:
    """Two situations alike in every feature but the drafted token: 7 is always rejected, 8 always
    accepted (fresh context tokens each round, so the corpora never learn either answer). Returns the
    probability each gets after `rounds` rounds."""
    c = NgramCorpus(CorpusConfig(rank_model=True, learn_prompts=False, history_max_bytes=0))
    final = {}
    for i in range(rounds + 1):
        for rid, tok, truth, base in (("A", 7, 9, 1000), ("B", 8, 8, 2000)):
            u, v = base + 2 * i, base + 2 * i + 1
            c.start_request(rid, [u, v, tok, 1, 2, u, v])
            toks, _, probs = c.draft([rid], 1).tree(0)
            assert toks == [tok]
            final[rid] = probs[0]
            if i < rounds:  # the last round only drafts, so both see the same model
                c.extend(rid, [truth])
            c.finish(rid)
    return final["A"], final["B"]


def test_acceptance_of_a_repeated_pattern_rises():
    before_rejected, before_accepted = token_probs(0)
    assert before_rejected == before_accepted  # nothing learned yet: the same features, the same estimate
    rejected, accepted = token_probs(30)
    assert accepted > before_accepted and rejected < before_rejected
    assert rejected < 0.5 * accepted


def random_workload(config: CorpusConfig, seed: int = 7) -> list:
    rng = np.random.default_rng(seed)
    c = NgramCorpus(config)
    out = []
    for r in range(6):
        rid = f"r{r}"
        c.start_request(rid, rng.integers(0, 12, 40).tolist())
        for _ in range(15):
            toks, parents, probs = c.draft([rid], 7).tree(0)
            out.append((toks, parents, [round(p, 6) for p in probs]))
            c.extend(rid, rng.integers(0, 12, 3).tolist())
        c.finish(rid)
        c.synchronize()
    out.append(c.stats()["rank_tested_nodes"])
    return out


def test_off_switch_gives_todays_drafts_exactly():
    today = random_workload(CorpusConfig())
    off = random_workload(CorpusConfig(rank_model=False, rank_learning_rate=0.5, rank_token_prior=1.0, rank_prior=2.0,
                                       rank_lambda=3.0))
    assert off == today and today[-1] == 0  # the model's settings do nothing while it is off
    on = random_workload(CorpusConfig(rank_model=True))
    assert on != today and on[-1] > 0


def test_deterministic():
    assert random_workload(CorpusConfig(rank_model=True)) == random_workload(CorpusConfig(rank_model=True))


def train(c: NgramCorpus, steps: int, seed: int = 3, learn: bool = True) -> None:
    rng = np.random.default_rng(seed)
    start = c.start_request if learn else c.start_request_unlearned
    start("t", rng.integers(0, 20, 60).tolist())
    for _ in range(steps):
        c.draft(["t"], 7)
        c.extend("t", rng.integers(0, 20, 2).tolist())
    c.finish("t")
    c.synchronize()


def test_state_is_bounded(tmp_path):
    # Fixed tables: a snapshot of a model trained 10 steps and one trained 400 steps are the same size
    # (the requests stay out of the learned corpus, so the rank model is all that changes).
    sizes = []
    for steps in (10, 400):
        c = NgramCorpus(CorpusConfig(rank_model=True, history_max_bytes=0))
        train(c, steps, learn=False)
        assert c.stats()["rank_tested_nodes"] > 0
        c.save(tmp_path / f"s{steps}.ngc")
        sizes.append((tmp_path / f"s{steps}.ngc").stat().st_size)
    assert sizes[0] == sizes[1]
    # The smallest window halves the counts at every few tests: the model keeps learning, finitely.
    c = NgramCorpus(CorpusConfig(rank_model=True, rank_window=2))
    train(c, 300)
    assert np.all(np.isfinite(c.rank_weights())) and c.stats()["rank_tested_nodes"] > 0


def test_snapshot_round_trip(tmp_path):
    c = NgramCorpus(CorpusConfig(rank_model=True))
    train(c, 200)
    c.save(tmp_path / "s.ngc")
    d = NgramCorpus(CorpusConfig(rank_model=True))
    d.load(tmp_path / "s.ngc")
    np.testing.assert_array_equal(c.rank_weights(), d.rank_weights())
    for k in ("rank_tested_nodes", "rank_accepted_nodes"):
        assert c.stats()[k] == d.stats()[k] > 0
    # The same calls on both give the same drafts (the loaded model ranks as the saved one did).
    prompt = list(range(5, 25)) * 3
    for e in (c, d):
        e.start_request("q", prompt)
    for step in range(10):
        dc, dd = c.draft(["q"], 7).tree(0), d.draft(["q"], 7).tree(0)
        assert dc == dd
        c.extend("q", [5 + step, 6 + step])
        d.extend("q", [5 + step, 6 + step])


def test_old_snapshot_format_loads_with_an_empty_model():
    c = NgramCorpus(CorpusConfig(rank_model=True))
    train(c, 50)
    assert c.stats()["rank_tested_nodes"] > 0
    c.load(DATA / "corpus_snapshot_v1.ngc")  # format 1: no policy version, no history, no rank model
    s = c.stats()
    assert s["learned_tokens"] == 22 and c.list_external_corpora() == {"docs": 6}
    assert s["rank_tested_nodes"] == 0
    np.testing.assert_array_equal(c.rank_weights(), NgramCorpus(CorpusConfig(rank_model=True)).rank_weights())


def test_replicas_learn_the_same_model_from_deltas():
    # Each replica queues what it observed instead of learning it; the commit log carries the deltas
    # to every replica (its origin included), in one order, so all hold the same model.
    cfg = CorpusConfig(rank_model=True, rank_learn_local=False, history_max_bytes=0)
    r1, r2 = NgramCorpus(cfg), NgramCorpus(cfg)
    train(r1, 60, seed=1)
    train(r2, 60, seed=2)
    assert r1.stats()["rank_tested_nodes"] == 0 and r1.stats()["rank_delta_queued_nodes"] > 0
    log = [r1.export_rank_delta(), r2.export_rank_delta()]
    assert all(d.size > 0 and d.size % W == 0 for d in log)
    assert r1.stats()["rank_delta_queued_nodes"] == 0
    for replica in (r1, r2):
        for delta in log:
            replica.apply_rank_delta(delta)
    np.testing.assert_array_equal(r1.rank_weights(), r2.rank_weights())
    assert r1.stats()["rank_tested_nodes"] == r2.stats()["rank_tested_nodes"] == sum(d.size for d in log) // W
    # And so they draft alike for the same request (their learned corpora are alike: both empty of it).
    for replica in (r1, r2):
        replica.start_request_unlearned("q", list(range(30, 50)) * 2)
    assert r1.draft(["q"], 7).tree(0) == r2.draft(["q"], 7).tree(0)


def test_local_learning_equals_learning_from_its_own_deltas():
    # An engine that learns locally applies exactly the words it would export: a replica that learns
    # only from the log holds the same model (left-out nodes and pairwise steps included).
    local = NgramCorpus(CorpusConfig(rank_model=True, history_max_bytes=0))
    remote = NgramCorpus(CorpusConfig(rank_model=True, rank_learn_local=False, history_max_bytes=0))
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 20, 60).tolist()
    for c in (local, remote):
        c.start_request_unlearned("t", prompt)
    for _ in range(80):
        commit = rng.integers(0, 20, 2).tolist()
        for c in (local, remote):
            c.draft(["t"], 7)
            c.extend("t", commit)
        remote.apply_rank_delta(remote.export_rank_delta())
        np.testing.assert_array_equal(local.rank_weights(), remote.rank_weights())
    assert local.stats()["rank_tested_nodes"] == remote.stats()["rank_tested_nodes"] > 0


def node_words(accepted: int, feats: list[float], sibling: bool = False, v1: bool = False) -> np.ndarray:
    """One node of a delta: cells 0, 100, 200, 300 (and 400), the flag word, the features (bit-cast
    floats); v1: the older layout (4 cells, 14 features)."""
    cells = [0, 100, 200, 300] if v1 else [0, 100, 200, 300, 400]
    f = np.zeros((W1 if v1 else W) - len(cells) - 1, np.float32)
    f[: len(feats)] = feats
    return np.concatenate([np.array(cells + [accepted | (2 if sibling else 0)], np.int32), f.view(np.int32)])


def test_sibling_groups_in_a_delta_take_pairwise_steps():
    # An accepted and a rejected node that differ only in feature 3 (the token level): as siblings
    # (flag bit 1 on the second) they also take a pairwise step, which moves only the weights of the
    # features that differ; as strangers (an old-format delta) they take the log-loss steps alone.
    acc, rej = node_words(1, [1.0, 0.5, 0.5, 1.0]), node_words(0, [1.0, 0.5, 0.5, -1.0])
    siblings = np.concatenate([acc, node_words(0, [1.0, 0.5, 0.5, -1.0], sibling=True)])
    strangers = np.concatenate([acc, rej])
    weights = {}
    for name, delta, rate in (("siblings", siblings, 0.3), ("strangers", strangers, 0.3), ("off", siblings, 0.0)):
        c = NgramCorpus(CorpusConfig(rank_model=True, rank_pair_rate=rate))
        c.apply_rank_delta(delta)
        assert c.stats()["rank_tested_nodes"] == 2 and c.stats()["rank_accepted_nodes"] == 1
        weights[name] = c.rank_weights()
    np.testing.assert_array_equal(weights["strangers"], weights["off"])
    moved = np.flatnonzero(weights["siblings"] != weights["strangers"])
    assert 3 in moved and weights["siblings"][3] > weights["strangers"][3]  # towards the accepted one


def firsts_with_budget_one(**config) -> list[int]:
    """replay_rounds' situation drafted with one node: only the own context's x(i) is ever drafted,
    while the verifier always commits the learned corpus' y(i). Returns each round's drafted token."""
    c = rounds_corpus(CorpusConfig(learn_prompts=False, flush_tokens=8, history_max_bytes=0, rank_model=True, **config))
    firsts = []
    for i in range(ROUNDS):
        toks, _, _ = c.draft(["r"], 1).tree(0)
        firsts.append(toks[0])
        c.extend("r", [y(i), a(i + 1), b(i + 1)])
    return firsts


def test_left_out_nodes_are_learned_from():
    # With one node drafted the model sees only x rejected; the left-out y, labelled by the commit,
    # shows what would have been accepted, so it switches to y sooner.
    without = firsts_with_budget_one(rank_left_out=0, rank_pair_rate=0.0)
    with_left_out = firsts_with_budget_one()
    switch = [next((i for i, t in enumerate(f) if t == y(i)), ROUNDS) for f in (without, with_left_out)]
    assert switch[1] < switch[0], (without, with_left_out)
    assert with_left_out[-3:] == [y(i) for i in range(ROUNDS - 3, ROUNDS)]


@pytest.mark.parametrize("words", [np.arange(5, dtype=np.int32),  # not a whole node
                                   np.full(W, 1 << 30, np.int32),  # a cell out of range
                                   np.array([0, 0, 0, 0, -1, 0] + [0] * (W - 6), np.int32),  # no cell: v1 only
                                   np.array([0, 0, 0, 0, 0, 4] + [0] * (W - 6), np.int32),  # flag not in [0, 3]
                                   np.array([0, 0, 0, 0, 0, -1] + [0] * (W - 6), np.int32),  # flag negative
                                   np.array([0] * 6 + [0x7fc00000] * (W - 6), np.int32),  # features NaN
                                   np.zeros((2, W), np.int32),  # not 1-D
                                   np.zeros(W, np.float32)])  # not integers
def test_malformed_delta_is_refused_and_changes_nothing(words):
    c = NgramCorpus(CorpusConfig(rank_model=True))
    before = c.rank_weights()
    good = np.zeros(W, np.int32)
    bad = np.concatenate([good, words.ravel().astype(np.int32)]) if words.ndim == 1 and words.dtype.kind == "i" else words
    with pytest.raises(ValueError):
        c.apply_rank_delta(bad)
    np.testing.assert_array_equal(before, c.rank_weights())
    assert c.stats()["rank_tested_nodes"] == 0


@pytest.mark.parametrize("node_words_", [0, -1, 7, W + 1, 2.0, True])
def test_delta_of_an_unknown_layout_is_refused(node_words_):
    c = NgramCorpus(CorpusConfig(rank_model=True))
    with pytest.raises(ValueError, match="node_words|words per node"):
        c.apply_rank_delta(np.zeros(W * W1, np.int32), node_words_)
    assert c.stats()["rank_tested_nodes"] == 0


def test_older_layout_delta_learns_as_its_nodes_in_todays_layout():
    # A delta of the older layout (before the source-pair cell and the request's own cells) learns as
    # the same nodes would in today's layout with those features 0: the weights move alike.
    feats = ([1.0, 0.5, 0.5, 1.0, 0.2], [1.0, 0.5, 0.5, -1.0, 0.1])
    old = np.concatenate([node_words(1, feats[0], v1=True), node_words(0, feats[1], sibling=True, v1=True)])
    new = np.concatenate([node_words(1, feats[0]), node_words(0, feats[1], sibling=True)])
    a, b = NgramCorpus(CorpusConfig(rank_model=True)), NgramCorpus(CorpusConfig(rank_model=True))
    a.apply_rank_delta(old, W1)
    b.apply_rank_delta(new)
    np.testing.assert_array_equal(a.rank_weights(), b.rank_weights())
    assert a.stats()["rank_tested_nodes"] == 2 and a.stats()["rank_accepted_nodes"] == 1
    with pytest.raises(ValueError):  # the older layout's words read as today's: not a whole node
        NgramCorpus(CorpusConfig(rank_model=True)).apply_rank_delta(old)


def test_older_layout_snapshot_and_delta_still_load():
    # Written by the engine of the older layout (tests/data/README.md): its snapshot (format 3) loads
    # with its 14 weights and counts, the new ones at their start; its delta learns as it did there.
    expected = json.loads((DATA / "rank_v1_expected.json").read_text())
    fresh = NgramCorpus(CorpusConfig(rank_model=True)).rank_weights()
    c = NgramCorpus(CorpusConfig(rank_model=True))
    c.load(DATA / "corpus_snapshot_v3_rank.ngc")
    s = c.stats()
    assert s["rank_tested_nodes"] == expected["rank_tested_nodes"] > 0
    assert s["rank_accepted_nodes"] == expected["rank_accepted_nodes"]
    assert s["learned_tokens"] == expected["learned_tokens"]
    w = c.rank_weights()
    np.testing.assert_array_equal(w[:14], np.float32(expected["weights"]))
    np.testing.assert_array_equal(w[14:], fresh[14:])
    c.start_request("q", list(range(3, 18)) * 3)
    assert c.draft(["q"], 7).counts[0] > 0  # and drafts with it
    d = NgramCorpus(CorpusConfig(rank_model=True, history_max_bytes=0))
    d.apply_rank_delta(np.load(DATA / "rank_delta_v1.npy"), W1)
    assert d.stats()["rank_tested_nodes"] == expected["delta_tested_nodes"] > 0
    np.testing.assert_allclose(d.rank_weights()[:14], expected["delta_weights"], rtol=0, atol=1e-6)


def own_cells_contrast(rounds: int) -> tuple[float, float]:
    """Two requests alike in everything but what they accept: A accepts token 8 and rejects 7, B the
    opposite, in alternating rounds (fresh context tokens each round, so only the tokens recur). Then
    both see one context continued once by 7 and once by 8. Returns, per request, logit p(8) - logit
    p(7) of its depth-1 nodes: siblings of one draft, so the model's weights, the shared cells and the
    request feature weigh alike in both; only the requests' own cells differ."""
    c = NgramCorpus(CorpusConfig(rank_model=True, learn_prompts=False, history_max_bytes=0))
    truth = {"A": {7: 9, 8: 8}, "B": {7: 7, 8: 9}}
    base = {"A": 1000, "B": 2000}
    for rid in ("A", "B"):
        c.start_request_unlearned(rid, [base[rid], base[rid] + 1, 7, 1, 2, base[rid], base[rid] + 1])
    for i in range(rounds):
        tok = 7 if i % 2 == 0 else 8
        nxt = 8 if tok == 7 else 7
        for rid in ("A", "B"):
            toks, _, _ = c.draft([rid], 1).tree(0)
            assert toks == [tok]
            u = base[rid] + 2 * i + 2
            c.extend(rid, [truth[rid][tok], u, u + 1, nxt, 1, 2, u, u + 1])
    for rid in ("A", "B"):
        u = base[rid] + 500
        c.extend(rid, [3, u, u + 1, 7, 5, 6, u, u + 1, 8, 5, 6, u, u + 1])
    out = []
    for rid in ("A", "B"):
        toks, parents, probs = c.draft([rid], 7).tree(0)
        p = {t: q for t, par, q in zip(toks, parents, probs) if par == -1}
        out.append(float(np.log(p[8] / (1 - p[8])) - np.log(p[7] / (1 - p[7]))))
    return out[0], out[1]


def test_requests_own_cells_tell_requests_apart():
    a, b = own_cells_contrast(20)
    assert a > b + 1.0  # A has seen 8 accepted and 7 rejected; B the opposite (alike without own cells)


def test_threads_draft_and_commit_with_the_model():
    c = NgramCorpus(CorpusConfig(rank_model=True, flush_tokens=8))
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        rng = np.random.default_rng(w)
        try:
            for r in range(20):
                rid = f"w{w}-{r}"
                c.start_request(rid, rng.integers(0, 30, 40))
                for _ in range(10):
                    d = c.draft([rid], 15)
                    assert d.counts[0] <= 15 and all(0 < p <= 1 for p in d.probs[0][: d.counts[0]])
                    c.extend(rid, rng.integers(0, 30, 3))
                c.finish(rid)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    c.check_integrity()
    s = c.stats()
    assert 0 < s["rank_accepted_nodes"] <= s["rank_tested_nodes"]
    assert np.all(np.isfinite(c.rank_weights()))


def test_reset_clears_the_model():
    c = NgramCorpus(CorpusConfig(rank_model=True))
    train(c, 30)
    c.reset()
    assert c.stats()["rank_tested_nodes"] == 0
    np.testing.assert_array_equal(c.rank_weights(), NgramCorpus(CorpusConfig(rank_model=True)).rank_weights())


@pytest.mark.parametrize("field, value", [("rank_model", "yes"), ("rank_learn_local", 1),
                                          ("rank_learning_rate", 2.0), ("rank_learning_rate", float("nan")),
                                          ("rank_request_decay", -0.1), ("rank_prior", -1.0),
                                          ("rank_token_prior", float("inf")), ("rank_pair_prior", -2.0),
                                          ("rank_window", 1), ("rank_window", 1 << 16),
                                          ("rank_left_out", -1), ("rank_left_out", 257), ("rank_left_out", 1.5),
                                          ("rank_pair_rate", 1.5), ("rank_pair_rate", float("nan")),
                                          ("rank_lambda", -1.0), ("rank_lambda", float("inf")), ("rank_lambda", "24"),
                                          ("rank_depth", -1), ("rank_depth", 65), ("rank_depth", 2.0)])
def test_bad_config_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        CorpusConfig(**{field: value})


def test_rank_lambda_is_the_models_own():
    # The model reads the tree's estimates with its own lambda: another rank_lambda drafts otherwise
    # under the model, and today's ranking (lambda_) is untouched by it (test_off_switch_gives_...).
    assert random_workload(CorpusConfig(rank_model=True, rank_lambda=2.0)) != random_workload(CorpusConfig(rank_model=True))


def depth_workload(config: CorpusConfig, seed: int = 11) -> tuple[list, int, list]:
    """random_workload on a repetitive stream (deep trees), with each draft's node depths."""
    rng = np.random.default_rng(seed)
    c = NgramCorpus(config)
    base = rng.integers(0, 12, 16).tolist()
    out, depths = [], []
    for r in range(4):
        rid = f"r{r}"
        c.start_request(rid, base * 3 + rng.integers(0, 12, 8).tolist())
        for _ in range(12):
            toks, parents, probs = c.draft([rid], 15).tree(0)
            d = []
            for par in parents:
                d.append(1 if par < 0 else d[par] + 1)
            out.append((toks, parents, [round(p, 6) for p in probs]))
            depths.append(max(d, default=0))
            c.extend(rid, base[:2] + rng.integers(0, 12, 1).tolist())
        c.finish(rid)
        c.synchronize()
    return out, c.stats()["rank_tested_nodes"], depths


def test_rank_depth_limits_what_the_model_ranks_and_learns():
    # rank_depth 0 ranks every level: as a depth no tree reaches; shallower limits learn from fewer nodes
    # (those below the limit are neither ranked nor labelled) and draft otherwise.
    every, tested_every, depths = depth_workload(CorpusConfig(rank_model=True, rank_depth=0))
    assert max(depths) > 3  # the workload's trees go deeper than the default limit
    deep, tested_deep, _ = depth_workload(CorpusConfig(rank_model=True, rank_depth=64))
    assert (every, tested_every) == (deep, tested_deep)
    first, tested_first, _ = depth_workload(CorpusConfig(rank_model=True, rank_depth=1))
    default, tested_default, _ = depth_workload(CorpusConfig(rank_model=True))
    assert 0 < tested_first < tested_default < tested_every
    assert first != every and default != every
    today, tested_today, _ = depth_workload(CorpusConfig())
    assert first != today and tested_today == 0


def test_switchable_per_namespace():
    on = NamespaceSpec.parse("code:vocab=100,rank_model=true,rank_learning_rate=0.05,rank_depth=2")
    off = NamespaceSpec.parse("chat:vocab=100")
    assert on.corpus.rank_model is True and on.corpus.rank_learning_rate == 0.05 and on.corpus.rank_depth == 2
    assert off.corpus.rank_model is False
    with pytest.raises(ValueError, match="rank_model"):
        NamespaceSpec.parse("code:rank_model=maybe")
    with pytest.raises(ValueError, match="rank_window"):
        NamespaceSpec.parse("code:rank_window=1")
