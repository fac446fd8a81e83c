"""The verifier's native step plan (``verifier/step/csrc/step_rows.h``, module ``verifier.step._native``)
against its numpy reference (``verifier.step.tree_batch``)."""

import numpy as np
import pytest

from tests.verifier.step.test_tree_batch import _padded_batch
from verifier.step import _native


def test_native_row_summary_prune_and_pack_match_the_numpy_forms():
    """verifier.step._native.summarize_rows / pack_plan (the engine's fast path) give exactly what
    choose_nodes_rows' column sums, best_first_rows, prune_rows and pack_rows give: rows ranked
    best-first or not (ties included), pruned to any k, packed for a larger bucket of rows in place."""
    from verifier.budget.policy import BudgetPolicy
    from verifier.step.tree_batch import best_first_rows, pack_rows, prune_rows

    rng = np.random.default_rng(9)
    policy = BudgetPolicy(15, None, lambda tokens: 1.0 + 0.01 * tokens)
    for trial in range(200):
        bs, W = int(rng.integers(1, 7)), int(rng.integers(0, 10))
        tokens, parents, probs, counts, _ = _padded_batch(rng, bs, W)
        if trial % 3 == 0 and W:  # best-first rows (the corpus' ranking), with ties
            probs = np.round(-np.sort(-probs, axis=1), 1).astype(np.float32) * (np.arange(W) < counts[:, None])
        t32, p32, c32 = tokens.astype(np.int32), parents.astype(np.int32), counts.astype(np.int32)
        nodes, best_first, sums = _native.summarize_rows(probs, c32)
        assert best_first == best_first_rows(probs) and nodes == min(W, int(counts.max(initial=0)))
        assert policy.choose_nodes_summary(bs, nodes, sums) == policy.choose_nodes_rows(probs, counts, best_first)
        k = int(rng.integers(0, W + 2))
        t, p, pr, c = prune_rows(tokens, parents, probs, counts, k, best_first)
        last, prefix, slots = rng.integers(0, 1000, bs).tolist(), rng.integers(1, 50, bs).tolist(), list(range(bs))
        K_min = int(rng.integers(1, 5))
        ref = pack_rows(last, t, p, pr, c, prefix, slots, K_min)
        host, K, num_nodes, predicted = _native.pack_plan(last, t32, p32, probs, c32, k, best_first, prefix, slots, K_min)
        assert (K, num_nodes) == (ref.K, ref.num_nodes) and np.array_equal(host, ref.host)
        assert abs(predicted - ref.predicted) < 1e-4
        # In place, for a bucket of R >= bs rows: the first rows as above, padding rows after.
        R = bs + int(rng.integers(0, 3))
        out = np.full(2 * R * K + 2 * R, 77, np.int64)
        back = _native.pack_plan(last, t32, p32, probs, c32, k, best_first, prefix, slots, K_min, rows=R, scratch=9, out=out)
        assert back[0] is out
        n = bs * K
        assert np.array_equal(out[:n], ref.host[:n]) and (out[n:R * K] == 0).all()
        assert np.array_equal(out[R * K:R * K + n], ref.host[n:2 * n]) and (out[R * K + n:2 * R * K] == -1).all()
        assert out[2 * R * K:2 * R * K + bs].tolist() == prefix and (out[2 * R * K + bs:2 * R * K + R] == 0).all()
        assert out[2 * R * K + R:2 * R * K + R + bs].tolist() == slots and (out[2 * R * K + R + bs:] == 9).all()


def test_native_pack_plan_refuses_bad_input():

    t = np.zeros((2, 3), np.int32)
    p, c = np.zeros((2, 3), np.float32), np.array([1, 1], np.int32)
    with pytest.raises(ValueError, match="one shape and counts one entry per row"):
        _native.pack_plan([1, 2], t, t[:1], p, c, 2, True, [1, 2], [0, 1], 1)
    with pytest.raises(ValueError, match="last_tokens: expected 2 values"):
        _native.pack_plan([1], t, t, p, c, 2, True, [1, 2], [0, 1], 1)
    with pytest.raises(ValueError, match="at least n"):
        _native.pack_plan([1, 2], t, t, p, c, 2, True, [1, 2], [0, 1], 1, rows=1)
    with pytest.raises(ValueError, match="out holds"):
        _native.pack_plan([1, 2], t, t, p, c, 2, True, [1, 2], [0, 1], 1, out=np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="writable C-contiguous int64"):
        _native.pack_plan([1, 2], t, t, p, c, 2, True, [1, 2], [0, 1], 1, out=np.zeros(40, np.int32))
    with pytest.raises(TypeError, match="slots: expected ints"):
        _native.pack_plan([1, 2], t, t, p, c, 2, True, [1, 2], [0, "a"], 1)
