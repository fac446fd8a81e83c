"""``target_probs`` (verifier/step/sampling.py): without top-k / top-p truncation it is the softmax of
logits / temperature, the same distribution as the sorted path up to float rounding; with truncation
on any row (told, or read from the tensors) every row goes through the sorted path."""

import torch

from verifier.step.sampling import target_probs


def _rows(n: int = 6, V: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * 3
    temp = torch.linspace(0.3, 1.5, n)
    return logits, temp, torch.zeros(n, dtype=torch.long), torch.ones(n)


def test_untruncated_rows_are_the_softmax_of_the_sorted_path():
    logits, temp, top_k, top_p = _rows()
    fast = target_probs(logits, temp, top_k, top_p, truncated=False)
    assert torch.equal(fast, (logits / temp[:, None]).softmax(-1))
    assert torch.allclose(fast, target_probs(logits, temp, top_k, top_p, truncated=True), atol=1e-6)
    assert torch.equal(target_probs(logits, temp, top_k, top_p), fast)  # read from the tensors: none truncates
    top_k[:] = 50  # top_k = V keeps every token: no truncation either
    assert torch.equal(target_probs(logits, temp, top_k, top_p), fast)


def test_a_truncating_row_is_read_from_the_tensors():
    logits, temp, top_k, top_p = _rows()
    top_k[2], top_p[4] = 5, 0.5
    probs = target_probs(logits, temp, top_k, top_p)
    assert int((probs[2] > 0).sum()) == 5
    kept = probs[4] > 0
    assert 1 <= int(kept.sum()) < 50 and float(probs[4].sum()) > 0.999
    assert torch.equal(probs, target_probs(logits, temp, top_k, top_p, truncated=True))
    assert torch.allclose(probs[0], (logits[0] / temp[0]).softmax(-1), atol=1e-6)  # the others: untouched


def truncated_from_probs(sample_fn, extra: int = 4):
    """``sample_fn`` (tree_sampling_logits' signature) as a function of target probabilities q
    [n, K, V] (exactness_pvalues' form): logits log q, plus ``extra`` tokens of real mass (each a
    tenth of the row's least likely token) that top-k removes again, so a sampler that ignored the
    truncation would emit them and one that truncated wrongly would skew q."""

    def fn(cand, ridx, nxt, sib, coins, final, q, steps, single, acc):
        n, K, V = q.shape
        logits = q.log().clamp(min=-1e4)
        low = logits.masked_fill(q <= 0, float("inf")).amin(-1, keepdim=True) - 2.3
        logits = torch.cat([logits, low.expand(n, K, extra)], -1).contiguous()
        rows = n * K
        temp = torch.ones(rows, device=q.device)
        top_k = (q > 0).sum(-1).reshape(rows).float()
        return sample_fn(cand, ridx, nxt, sib, coins, final, logits, temp, steps, single, acc,
                         top_k=top_k, top_p=torch.ones(rows, device=q.device))[0]

    return fn


def test_truncated_sampling_from_logits_is_exact_chi_square():
    from tests.verifier.step.test_reference_verify import exactness_pvalues
    from verifier.step import reference as ref

    pvalues = exactness_pvalues(truncated_from_probs(ref.tree_sampling_logits), n=60_000, seed=3)
    assert min(pvalues.values()) > 1e-6, pvalues
    # the same sampler without the floor emits the extra tokens (ids 6-9): the test can fail
    n, K, V = 2000, 3, 6
    q = torch.full((n, K, V), 1 / V)
    links = _chain_links(n, K)
    loose = truncated_from_probs(lambda *a, top_k, top_p: ref.tree_sampling_logits(*a))
    res = loose(torch.zeros(n, K, dtype=torch.int64), *links, torch.rand(n, K), torch.rand(n), q, K, 1.0, 1.0)
    assert int((res.predicts >= V).sum()) > 0
    strict = truncated_from_probs(ref.tree_sampling_logits)
    res = strict(torch.zeros(n, K, dtype=torch.int64), *links, torch.rand(n, K), torch.rand(n), q, K, 1.0, 1.0)
    assert int((res.predicts >= V).sum()) == 0


def _chain_links(n: int, K: int):
    from verifier.step import reference as ref

    _, idx = ref.tree_indices_from_parents(torch.arange(-1, K - 1).expand(n, K).contiguous(),
                                           torch.zeros(n, dtype=torch.int64))
    return idx.retrive_index, idx.retrive_next_token, idx.retrive_next_sibling


def test_the_logits_path_and_the_processed_path_define_the_same_target():
    """The engine verifies a top-k / top-p step from the logits (the floor) or, with penalties on,
    from processed logits (target_probs): both must be the same q, so the same coins decide alike."""
    from verifier.step import reference as ref
    import tree_cases as tc
    import random

    bs, K, V = 6, 5, 40
    rng = random.Random(0)
    trees = [tc.shaped("binary", K, rng) for _ in range(bs)]
    parents, tokens, prefix = tc.batch(trees, V, seed=1, prefix_max=10)
    _, idx = ref.tree_indices_from_parents(parents, prefix)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(bs, K, V, generator=g) * 3
    temp = torch.full((bs * K,), 0.7)
    top_k = torch.tensor([0.0, 3.0, 10.0, 0.0, 7.0, 0.0]).repeat_interleave(K)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.3, 0.8, 1.0]).repeat_interleave(K)
    for trial in range(20):
        coins, final = torch.rand(bs, K, generator=g), torch.rand(bs, generator=g)
        a, _ = ref.tree_sampling_logits(tokens, *idx[1:], coins, final, logits, temp, K, top_k=top_k, top_p=top_p)
        probs = target_probs(logits.view(bs * K, V), temp, top_k, top_p).view(bs, K, V)
        b = ref.tree_speculative_sampling(tokens, *idx[1:], coins, final, probs, K)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), trial
