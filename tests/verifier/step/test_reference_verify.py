"""verifier.step.reference greedy verification and rejection sampling against brute-force definitions."""

import random

import numpy as np
import pytest
import torch

import tree_cases as tc
from verifier.step import reference as ref


def _emitted(result, b, K):
    """Tokens emitted for request b: the predicts at the root and each accepted node."""
    n = int(result.accept_token_num[b])
    idx = result.accept_index[b, : n + 1].long()
    return result.predicts[idx].tolist()


def _links(parents):
    _, idx = ref.tree_indices_from_parents(parents, torch.zeros(parents.shape[0], dtype=torch.int64))
    return idx


def test_greedy_hand_made():
    # root(7) -> {1: 3, 2: 4}; 1 -> {3: 5}; 2 -> {4: 6}.  target: after root 4, after node 2: 6, after node 4: 9
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    cand = torch.tensor([[7, 3, 4, 5, 6]])
    target = torch.tensor([[4, 0, 6, 0, 9]])
    idx = _links(parents)
    res = ref.verify_tree_greedy(cand, idx.retrive_index, idx.retrive_next_token, idx.retrive_next_sibling, target, 5)
    assert res.accept_token_num.tolist() == [2]
    assert res.accept_index.tolist() == [[0, 2, 4, -1, -1]]
    assert res.predicts.tolist() == [4, -1, 6, -1, 9]
    # num_spec_steps = 2 stops after one accepted token, bonus = target after node 2
    res = ref.verify_tree_greedy(cand, idx.retrive_index, idx.retrive_next_token, idx.retrive_next_sibling, target, 2)
    assert res.accept_index.tolist() == [[0, 2]] and res.predicts.tolist() == [4, -1, 6, -1, -1]


@pytest.mark.parametrize("shape", ["chain", "fan_out", "binary", "random"])
@pytest.mark.parametrize("K", [1, 3, 16, 64])
def test_greedy_against_path_enumeration(shape, K):
    rng = random.Random(K * 7 + len(shape))
    bs, vocab = 6, 3  # tiny vocab: duplicate sibling tokens, the lowest index must win
    trees = [tc.shaped(shape, K, rng) for _ in range(bs)]
    parents, tokens, _ = tc.batch(trees, vocab, seed=K)
    targets = torch.tensor([tc.greedy_targets(t, tok, vocab, rng) for t, tok in zip(trees, tokens.tolist())])
    idx = _links(parents)
    for steps in (1, 3, K + 2):
        res = ref.verify_tree_greedy(tokens, idx.retrive_index, idx.retrive_next_token, idx.retrive_next_sibling, targets, steps)
        for b in range(bs):
            path, bonus = tc.brute_greedy(trees[b], tokens[b].tolist(), targets[b].tolist(), steps)
            assert res.accept_token_num[b] == len(path) - 1
            assert res.accept_index[b].tolist() == [b * K + p for p in path] + [-1] * (steps - len(path))
            assert _emitted(res, b, K) == [tokens[b, p].item() for p in path[1:]] + [bonus]


def test_greedy_malformed_links_terminate():
    K = 4
    cand = torch.zeros(1, K, dtype=torch.int64)
    ridx = torch.arange(K)[None]
    cyclic = torch.tensor([[1, -1, -1, -1]]), torch.tensor([[-1, 2, 1, 99]])  # 1 <-> 2 sibling cycle
    res = ref.verify_tree_greedy(cand, ridx, *cyclic, torch.ones(1, K, dtype=torch.int64), 4)
    assert res.accept_token_num.tolist() == [0]


def _sampling_case(bs, K, V, seed, shape="random"):
    rng = random.Random(seed)
    trees = [tc.shaped(shape, K, rng) for _ in range(bs)]
    parents, tokens, _ = tc.batch(trees, V, seed=seed)
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(3 * torch.randn(bs, K, V, generator=g), -1)
    probs[:, :, 0] = 0.0  # a zero-probability token that drafts sometimes propose
    probs /= probs.sum(-1, keepdim=True)
    coins, final = torch.rand(bs, K, generator=g), torch.rand(bs, generator=g)
    return trees, tokens, probs, coins, final


@pytest.mark.parametrize("thresholds", [(1.0, 1.0), (0.3, 0.6)])
@pytest.mark.parametrize("K,V", [(1, 5), (6, 4), (16, 40), (64, 8)])
def test_sampling_against_scalar_loop(K, V, thresholds):
    bs = 24
    trees, tokens, probs, coins, final = _sampling_case(bs, K, V, seed=K + V)
    idx = _links(torch.tensor(trees))
    steps = max(1, K // 2)
    res = ref.tree_speculative_sampling(tokens, idx.retrive_index, idx.retrive_next_token, idx.retrive_next_sibling,
                                        coins, final, probs, steps, *thresholds)
    for b in range(bs):
        path, emitted = tc.scalar_sampling(
            idx.retrive_next_token[b].tolist(), idx.retrive_next_sibling[b].tolist(), tokens[b].tolist(),
            coins[b].numpy(), final[b].item(), probs[b].numpy(), steps, *thresholds)
        assert res.accept_index[b, : len(path)].tolist() == [b * K + p for p in path]
        assert res.accept_token_num[b] == len(path) - 1
        assert _emitted(res, b, K) == emitted
        if thresholds == (1.0, 1.0):
            assert 0 not in emitted  # probability-0 tokens are never emitted


def test_sampling_coin_boundaries():
    # root -> children tokens [2, 1]; q_root = [0, .25, .5, .25]
    parents = torch.tensor([[-1, 0, 0]])
    tokens = torch.tensor([[9, 2, 1]])
    probs = torch.tensor([[[0, .25, .5, .25], [1, 0, 0, 0], [0, 0, 0, 1]]])
    idx = _links(parents)

    def run(coin, final):
        return ref.tree_speculative_sampling(tokens, idx.retrive_index, idx.retrive_next_token, idx.retrive_next_sibling,
                                             torch.tensor([[coin, 0.5, 0.5]]), torch.tensor([final]), probs, 3)

    assert _emitted(run(0.49, 0.0), 0, 3) == [2, 0]   # u < .5: first child, then its q is one-hot on 0
    assert _emitted(run(0.5, 0.0), 0, 3) == [1, 3]    # .5 <= u < .75: second child (acc .75)
    assert _emitted(run(0.8, 0.0), 0, 3) == [3]       # both rejected: residual is all on token 3
    assert _emitted(run(0.8, 0.9999999), 0, 3) == [3]


def _chi2_pvalue(counts, probs):
    """Pearson chi-square p-value; bins with zero expectation must have zero counts."""
    counts, probs = np.asarray(counts, dtype=np.float64), np.asarray(probs, dtype=np.float64)
    assert counts[probs == 0].sum() == 0, "emitted a token with target probability 0"
    keep = probs > 0
    n = counts.sum()
    if n == 0:
        return float("nan")
    expected = n * probs[keep]
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = keep.sum() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)))


# K = 8, V = 6: root -> {1: tok 0, 2: tok 2, 3: tok 3}; 1 -> {4: tok 1, 5: tok 0}; 2 -> {6: tok 5}; 4 -> {7: tok 4}
EXACT_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4]
EXACT_TOKENS = [9, 0, 2, 3, 1, 0, 5, 4]


def exactness_pvalues(sample_fn, n=120_000, seed=0, threshold_acc=1.0, device="cpu"):
    """Draw n verifications of one fixed tree and test the emitted tokens' conditional laws
    (chi-square p-values; nan where the condition never occurred):
    y1 ~ q_root; y2 | y1 = tok(c) ~ q_c for each root child c; y3 | (y1, y2) = (0, 1) ~ q_4."""
    K, V = len(EXACT_PARENTS), 6
    g = torch.Generator().manual_seed(seed)
    q = torch.distributions.Dirichlet(torch.ones(V)).sample((K,))
    q[0, 4] = 0.0  # a token the target never emits at the root
    q /= q.sum(-1, keepdim=True)
    tokens = torch.tensor([EXACT_TOKENS]).expand(n, K).contiguous()
    one = _links(torch.tensor([EXACT_PARENTS]))
    idx = one._replace(retrive_index=torch.arange(n * K).reshape(n, K),
                       retrive_next_token=one.retrive_next_token.expand(n, K).contiguous(),
                       retrive_next_sibling=one.retrive_next_sibling.expand(n, K).contiguous())
    coins, final = torch.rand(n, K, generator=g), torch.rand(n, generator=g)
    args = [t.to(device) for t in (tokens, idx.retrive_index, idx.retrive_next_token, idx.retrive_next_sibling,
                                   coins, final, q.expand(n, K, V).contiguous())]
    res = sample_fn(*args, K, 1.0, threshold_acc)
    ai, pred, num = res.accept_index.cpu().long(), res.predicts.cpu().long(), res.accept_token_num.cpu()
    y1 = pred[ai[:, 0]]
    pvalues = {"y1": _chi2_pvalue(torch.bincount(y1, minlength=V), q[0])}
    for child in (1, 2, 3):
        sel = (y1 == EXACT_TOKENS[child])
        assert (num[sel] >= 1).all()  # a draft token can only be emitted by acceptance
        y2 = pred[ai[sel, 1]]
        pvalues[f"y2|{child}"] = _chi2_pvalue(torch.bincount(y2, minlength=V), q[child])
    sel = (y1 == 0) & (num >= 1)
    sel &= pred[ai[:, 1].clamp(min=0)] == 1
    y3 = pred[ai[sel, 2]]
    pvalues["y3|4"] = _chi2_pvalue(torch.bincount(y3, minlength=V), q[4])
    return pvalues


def test_sampling_is_exact_chi_square():
    pvalues = exactness_pvalues(ref.tree_speculative_sampling)
    assert not any(np.isnan(list(pvalues.values()))), pvalues  # every conditional was observed
    # Fixed seed: deterministic. 1e-6 leaves room for any seed while a biased sampler fails below.
    assert min(pvalues.values()) > 1e-6, pvalues


def test_chi_square_detects_a_biased_sampler():
    pvalues = exactness_pvalues(ref.tree_speculative_sampling, n=40_000, threshold_acc=0.5)
    assert pvalues["y1"] < 1e-6, pvalues
