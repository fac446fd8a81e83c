"""Acceptance feedback (CorpusConfig.feedback, csrc/acceptance_model.h): each commit scores the
request's last draft; counts per (q, depth) and (q, token) cell calibrate the node probabilities."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from corpus_service import CorpusConfig, NgramCorpus

ROUNDS = 12


def a(i: int) -> int:  # rounds use fresh tokens, so the request's own output never repeats a round
    return 100 + i


def b(i: int) -> int:
    return 200 + i


def x(i: int) -> int:  # what the request's own prompt continues "a b" with: always wrong
    return 300 + i


def y(i: int) -> int:  # what the learned corpus continues "a b" with: always right
    return 400 + i


def rounds_corpus(config: CorpusConfig) -> NgramCorpus:
    """The rounds' corpus: for every round i the learned corpus continues a(i) b(i) with y(i) (three
    times), and request "r"'s prompt once with x(i); "r"'s context ends with a(0) b(0)."""
    c = NgramCorpus(config)
    c.start_request("L", [1])
    for i in range(ROUNDS):
        c.extend("L", [a(i), b(i), y(i), 1] * 3)
    c.finish("L")
    c.synchronize()
    prompt = [t for i in range(ROUNDS) for t in (a(i), b(i), x(i), 1)]
    c.start_request("r", prompt + [a(0), b(0)])
    return c


def replay_rounds(feedback: bool) -> list[int]:
    """Round i: the context ends with a(i) b(i); the prompt once continued it with x(i), the learned
    corpus (three times, at a tenth of the weight) with y(i); the verifier commits y(i). Returns the
    top-ranked first token of each round's draft."""
    c = rounds_corpus(CorpusConfig(feedback=feedback, learn_prompts=False, flush_tokens=8))
    firsts = []
    for i in range(ROUNDS):
        toks, parents, probs = c.draft(["r"], 6).tree(0)
        assert {x(i), y(i)} <= {t for t, p in zip(toks, parents) if p == -1}  # both are drafted (tested)
        firsts.append(toks[0])  # nodes come best first
        c.extend("r", [y(i), a(i + 1), b(i + 1)])
    return firsts


def test_feedback_makes_the_accepted_source_rank_first():
    without = replay_rounds(feedback=False)
    with_fb = replay_rounds(feedback=True)
    # The raw estimate keeps preferring the request's own (always rejected) continuation ...
    assert without == [x(i) for i in range(ROUNDS)]
    # ... feedback learns that such nodes (their q, their depth) are rejected and the learned
    # corpus' (a smaller q) accepted, and ranks the learned continuation first.
    assert with_fb[0] == x(0)
    assert with_fb[-4:] == [y(i) for i in range(ROUNDS - 4, ROUNDS)]


def test_probabilities_follow_observed_acceptance():
    # The same draft situation, always rejected: its calibrated probability falls well below q.
    # (No prompt history: it would learn the repeated prompt's output, the point of it, not this test's.)
    c = NgramCorpus(CorpusConfig(feedback=True, learn_prompts=False, history_max_bytes=0))
    c.start_request("r", [5, 6, 7, 1, 2, 5, 6])
    first = c.draft(["r"], 1).tree(0)
    assert first[0] == [7]
    for _ in range(40):
        c.extend("r", [9])
        c.finish("r")
        c.start_request("r", [5, 6, 7, 1, 2, 5, 6])
        c.draft(["r"], 1)
    later = c.draft(["r"], 1).tree(0)
    assert later[0] == [7] and later[2][0] < 0.5 * first[2][0]
    s = c.stats()
    assert s["feedback_tested_nodes"] == 40 and s["feedback_accepted_nodes"] == 0
    c.reset()
    assert c.stats()["feedback_tested_nodes"] == 0


def token_probs(token_prior: float) -> tuple[float, float]:
    """Two situations alike in every feature but the drafted token: 7 is always rejected, 8 always
    accepted (fresh context tokens each round, so the corpora never learn either answer). Returns
    the probability each gets after 30 rounds."""
    c = NgramCorpus(CorpusConfig(feedback=True, feedback_token_prior=token_prior, learn_prompts=False))
    final = {}
    for i in range(31):
        for rid, tok, truth, base in (("A", 7, 9, 1000), ("B", 8, 8, 2000)):
            u, v = base + 2 * i, base + 2 * i + 1
            c.start_request(rid, [u, v, tok, 1, 2, u, v])
            toks, _, probs = c.draft([rid], 1).tree(0)
            assert toks == [tok]
            final[rid] = probs[0]
            if i < 30:  # the last round only drafts, so both see the same counts
                c.extend(rid, [truth])
            c.finish(rid)
    return final["A"], final["B"]


def test_token_level_separates_tokens_with_equal_features():
    p_rejected, p_accepted = token_probs(16.0)
    assert p_rejected < 0.5 * p_accepted
    p_rejected, p_accepted = token_probs(0.0)  # without it, both share every cell
    assert p_rejected == p_accepted


def test_off_by_default_and_counts_nothing():
    c = NgramCorpus()
    assert c.config.feedback is False
    c.start_request("r", [1, 2, 3, 1, 2])
    c.draft(["r"], 4)
    c.extend("r", [3, 1])
    assert c.stats()["feedback_tested_nodes"] == 0


def test_deterministic():
    def run() -> list:
        rng = np.random.default_rng(7)
        c = NgramCorpus(CorpusConfig(feedback=True, flush_tokens=16))
        out = []
        for r in range(6):
            rid = f"r{r}"
            c.start_request(rid, rng.integers(0, 12, 40).tolist())
            for _ in range(15):
                toks, parents, probs = c.draft([rid], 7).tree(0)
                out.append((toks, parents, probs))
                c.extend(rid, rng.integers(0, 12, 3).tolist())
            c.finish(rid)
            c.synchronize()
        return out

    assert run() == run()


def test_counts_stay_bounded_by_the_window():
    def tested(window: int) -> float:
        c = NgramCorpus(CorpusConfig(feedback=True, feedback_window=window, learn_prompts=False))
        c.start_request("r", [5, 6, 7, 1, 5, 6])
        for _ in range(300):
            c.draft(["r"], 3)
            c.extend("r", [8])  # soon "8 8 8 ...": the same few cells are tested every step
        return c.stats()["feedback_tested_nodes"]

    assert tested(1 << 15) >= 290
    assert tested(4) <= 3 * 8  # each touched cell holds fewer than `window` tests


def test_threads_draft_and_commit_with_feedback():
    c = NgramCorpus(CorpusConfig(feedback=True, flush_tokens=8))
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        rng = np.random.default_rng(w)
        try:
            for r in range(30):
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
    assert 0 < s["feedback_accepted_nodes"] <= s["feedback_tested_nodes"]


@pytest.mark.parametrize("field, value", [("feedback", "yes"), ("feedback_prior", -1.0), ("feedback_prior", float("nan")),
                                          ("feedback_token_prior", -1.0),
                                          ("feedback_window", 1), ("feedback_window", 1 << 16)])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        CorpusConfig(**{field: value})
