"""pack_trees: the host-built flattened tree (the step's packed input, as the forward part reads
it) equals kernels.flatten_draft_tree's, padding nodes are isolated, and prune_tree keeps closed
subtrees."""

import numpy as np
import torch

from verifier import kernels
from verifier.step.tree_batch import PAD_PARENT, pack_trees, prune_tree


def _tree_batch(last, drafts, prefix, num_nodes=1):
    """The packed trees, and their tokens, mask and indices on the device as the step's forward
    part computes them (verifier.step.cuda_graphs.forward_part)."""
    packed = pack_trees(last, drafts, prefix, num_nodes=num_nodes)
    bs, K = packed.bs, packed.K
    dev = torch.from_numpy(packed.host)
    mask, indices = kernels.tree_indices_from_parents(dev[bs * K:2 * bs * K].view(bs, K), dev[2 * bs * K:2 * bs * K + bs])
    return packed, dev[:bs * K].view(bs, K), mask, indices


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
        packed, tokens, mask, indices = _tree_batch(last, drafts, prefix)
        K = 1 + max(len(d[0]) for d in drafts)
        dt = np.repeat(np.array(last)[:, None], K - 1, axis=1)
        dp = np.full((bs, K - 1), PAD_PARENT)
        for b, (t, p, _) in enumerate(drafts):
            dt[b, :len(t)], dp[b, :len(p)] = t, p
        want_tokens, want_parents = kernels.flatten_draft_tree(torch.tensor(last), torch.from_numpy(dt), torch.from_numpy(dp))
        want_mask, want_idx = kernels.tree_indices_from_parents(want_parents, torch.tensor(prefix))
        assert torch.equal(tokens, want_tokens) and np.array_equal(packed.tokens, want_tokens.numpy())
        assert torch.equal(mask, want_mask) and packed.prefix_lens.tolist() == prefix
        for name in want_idx._fields:
            assert torch.equal(getattr(indices, name), getattr(want_idx, name)), name
        assert packed.num_nodes == [1 + len(d[0]) for d in drafts]
        assert abs(packed.predicted - sum(float(d[2].sum()) for d in drafts)) < 1e-4


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


def test_padding_to_a_bucket_changes_no_verification():
    """Trees padded with isolated nodes (CUDA-graph buckets) accept exactly what unpadded ones do."""
    rng = np.random.default_rng(2)
    for _ in range(20):
        bs = int(rng.integers(1, 4))
        drafts = [_random_draft(rng, int(rng.integers(0, 6))) for _ in range(bs)]
        last, prefix = rng.integers(0, 5, bs).tolist(), rng.integers(1, 30, bs).tolist()
        plain = _tree_batch(last, drafts, prefix)
        padded = _tree_batch(last, drafts, prefix, num_nodes=plain[0].K + 3)
        K0, K1 = plain[0].K, padded[0].K
        assert K1 == K0 + 3 and torch.equal(padded[1][:, :K0], plain[1])
        # A target that predicts the draft's own tokens often, so paths get accepted.
        target = torch.from_numpy(rng.integers(0, 5, (bs, K0)))
        target_pad = torch.cat([target, torch.from_numpy(rng.integers(0, 5, (bs, 3)))], dim=1)
        results = []
        for (_, tokens, _, i), K, tgt in ((plain, K0, target), (padded, K1, target_pad)):
            r = kernels.verify_tree_greedy(tokens, i.retrive_index, i.retrive_next_token, i.retrive_next_sibling,
                                           tgt, K)
            results.append([(int(r.accept_token_num[b]), (r.accept_index[b, :int(r.accept_token_num[b]) + 1] - b * K).tolist(),
                             int(r.predicts[int(r.accept_index[b, int(r.accept_token_num[b])])])) for b in range(bs)])
        assert results[0] == results[1]


def _padded_batch(rng, bs, W):
    """Random drafts as the corpus returns them: [bs, W] arrays, counts[b] real nodes per row
    (path probabilities never grow from parent to child; padding: token -1, parent -1, prob 0)."""
    tokens = np.full((bs, W), -1, np.int32)
    parents = np.full((bs, W), -1, np.int32)
    probs = np.zeros((bs, W), np.float32)
    counts = rng.integers(0, W + 1, bs)
    drafts = []
    for b in range(bs):
        t, p, pr = _random_draft(rng, int(counts[b]))
        for j in range(len(p)):
            if p[j] >= 0:
                pr[j] = min(pr[j], pr[p[j]])
        if b % 3 == 2 and len(pr) > 2:  # some rows not monotone: prune_tree's first-k fallback
            pr = pr[::-1].copy()
        n = len(t)
        tokens[b, :n], parents[b, :n], probs[b, :n] = t, p, pr
        drafts.append((t, p, pr))
    return tokens, parents, probs, counts, drafts


def _prune_rows_like_prune_tree(tokens, parents, probs, counts, drafts, k):
    """prune_rows of the padded batch == prune_tree of each request's draft; returns both."""
    from verifier.step.tree_batch import prune_rows

    t, p, pr, c = prune_rows(tokens, parents, probs, counts, k)
    want = [prune_tree(*d, k) for d in drafts]
    assert c.tolist() == [len(w[0]) for w in want]
    for b, (wt, wp, wpr) in enumerate(want):
        n = len(wt)
        assert t[b, :n].tolist() == wt.tolist() and p[b, :n].tolist() == wp.tolist(), (b, k)
        np.testing.assert_allclose(pr[b, :n], wpr)
    return t, p, pr, c, want


def test_batched_prune_and_pack_match_the_per_request_forms():
    from verifier.budget.policy import BudgetPolicy
    from verifier.step.tree_batch import pack_rows, pack_trees

    rng = np.random.default_rng(2)
    policy = BudgetPolicy(15, None, lambda tokens: 1.0 + 0.01 * tokens)
    for _ in range(60):
        bs, W = int(rng.integers(1, 7)), int(rng.integers(0, 10))
        tokens, parents, probs, counts, drafts = _padded_batch(rng, bs, W)
        assert policy.choose_nodes_rows(probs, counts) == policy.choose_nodes([d[2] for d in drafts])
        k = int(rng.integers(0, W + 2))
        t, p, pr, c, want = _prune_rows_like_prune_tree(tokens, parents, probs, counts, drafts, k)
        last, prefix, slots = rng.integers(0, 1000, bs).tolist(), rng.integers(1, 50, bs).tolist(), list(range(bs))
        K_min = int(rng.integers(1, 5))
        got = pack_rows(last, t, p, pr, c, prefix, slots, K_min)
        ref = pack_trees(last, want, prefix, slots, K_min)
        assert (got.bs, got.K, got.num_nodes) == (ref.bs, ref.K, ref.num_nodes)
        assert np.array_equal(got.host, ref.host) and abs(got.predicted - ref.predicted) < 1e-4


def test_prune_rows_of_best_first_trees_match_prune_tree():
    """The corpus ranks nodes best-first; prune_rows then keeps the first k of each row (its fast
    path), which must be exactly what prune_tree's most-probable-k selection gives."""
    from verifier.step.tree_batch import prune_rows

    rng = np.random.default_rng(5)
    for _ in range(60):
        bs, W = int(rng.integers(1, 7)), int(rng.integers(1, 12))
        tokens, parents, probs, counts, _ = _padded_batch(rng, bs, W)
        drafts = []
        for b in range(bs):  # reorder each row best-first (stable: a parent precedes its tied children)
            n = int(counts[b])
            t, p, pr = tokens[b, :n].copy(), parents[b, :n].astype(np.int64), probs[b, :n].copy()
            for j in range(n):
                if p[j] >= 0:
                    pr[j] = min(pr[j], pr[p[j]])
            order = np.argsort(-pr.astype(np.float64), kind="stable")
            where = np.empty(n, np.int64)
            where[order] = np.arange(n)
            t, pr = t[order], pr[order]
            p = np.where(p[order] >= 0, where[np.maximum(p[order], 0)], -1)
            assert all(p[j] < j for j in range(n))
            tokens[b, :n], parents[b, :n], probs[b, :n] = t, p, pr
            drafts.append((t, p, pr))
        from verifier.budget.policy import BudgetPolicy
        from verifier.step.tree_batch import best_first_rows

        assert best_first_rows(probs)
        policy = BudgetPolicy(15, None, lambda tokens: 1.0 + 0.01 * tokens)
        assert policy.choose_nodes_rows(probs, counts, best_first=True) == policy.choose_nodes([d[2] for d in drafts])
        k = int(rng.integers(0, W + 2))
        _prune_rows_like_prune_tree(tokens, parents, probs, counts, drafts, k)
