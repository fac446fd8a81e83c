"""build_tree_batch: the host-built flattened tree equals kernels.flatten_draft_tree's, padding
nodes are isolated, and prune_tree keeps closed subtrees."""

import numpy as np
import torch

from verifier import kernels
from verifier.tree_batch import PAD_PARENT, build_tree_batch, prune_tree


def _random_draft(rng, n):
    parents = np.array([rng.integers(-1, j) if j else -1 for j in range(n)], dtype=np.int64)
    return rng.integers(0, 1000, n).astype(np.int64), parents, np.sort(rng.random(n))[::-1].astype(np.float32)


def test_matches_flatten_draft_tree():
    rng = np.random.default_rng(0)
    for _ in range(30):
        bs = int(rng.integers(1, 6))
        drafts = [_random_draft(rng, int(rng.integers(0, 9))) for _ in range(bs)]
        last = rng.integers(0, 1000, bs).tolist()
        prefix = rng.integers(1, 50, bs).tolist()
        tb = build_tree_batch(last, drafts, prefix, torch.device("cpu"))
        K = 1 + max(len(d[0]) for d in drafts)
        dt = np.repeat(np.array(last)[:, None], K - 1, axis=1)
        dp = np.full((bs, K - 1), PAD_PARENT)
        for b, (t, p, _) in enumerate(drafts):
            dt[b, :len(t)], dp[b, :len(p)] = t, p
        want_tokens, want_parents = kernels.flatten_draft_tree(torch.tensor(last), torch.from_numpy(dt), torch.from_numpy(dp))
        want_mask, want_idx = kernels.tree_indices_from_parents(want_parents, torch.tensor(prefix))
        assert torch.equal(tb.tokens, want_tokens) and np.array_equal(tb.tokens_host, want_tokens.numpy())
        assert torch.equal(tb.mask, want_mask) and torch.equal(tb.prefix_lens, torch.tensor(prefix))
        for name in want_idx._fields:
            assert torch.equal(getattr(tb.indices, name), getattr(want_idx, name)), name
        assert tb.num_nodes == [1 + len(d[0]) for d in drafts]
        assert abs(tb.predicted - sum(float(d[2].sum()) for d in drafts)) < 1e-4


def test_prune_keeps_closed_subtrees():
    rng = np.random.default_rng(1)
    for _ in range(50):
        tok, par, prob = _random_draft(rng, int(rng.integers(1, 12)))
        # path probabilities never grow from parent to child
        for j in range(len(par)):
            if par[j] >= 0:
                prob[j] = min(prob[j], prob[par[j]])
        k = int(rng.integers(0, len(tok) + 1))
        t, p, pr = prune_tree(tok, par, prob, k)
        assert len(t) == min(k, len(tok))
        assert all(-1 <= int(x) < j for j, x in enumerate(p))
