"""CUDA kernels against the torch reference (run with `pytest -m gpu` on a GPU machine).

Index outputs, greedy verification, acceptance decisions, masks and compaction must match the
reference exactly. The sampled bonus token may differ only where the float32 chunked scan of the
kernel and the float64 cumsum of the reference disagree about which side of a CDF boundary the
coin falls on: the test then requires the kernel's token to be a valid inverse-CDF pick within
1e-5 (relative to the residual mass) of the coin, and such cases to be rare.
"""

import random

import numpy as np
import pytest
import torch

import tree_cases as tc
from verifier import kernels
from verifier.step import reference as ref

pytestmark = [pytest.mark.gpu, tc.requires_cuda]

SHAPES = ["chain", "fan_out", "binary", "random", "padded"]


def make_batch(bs, K, vocab, seed):
    rng = random.Random(seed)
    trees = []
    for b in range(bs):
        shape = SHAPES[b % len(SHAPES)]
        trees.append(tc.random_tree(K, rng, pad=K // 4) if shape == "padded" else tc.shaped(shape, K, rng))
    parents, tokens, prefix = tc.batch(trees, vocab, seed=seed, prefix_max=300)
    targets = torch.tensor([tc.greedy_targets(t, tok, vocab, rng) for t, tok in zip(trees, tokens.tolist())])
    return trees, parents, tokens, prefix, targets


def assert_same(got, want):
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())


def residual_ok(res, b, K, tokens, links, probs, final_coin, steps):
    """The kernel's bonus token for request b is a valid inverse-CDF pick up to rounding."""
    n = int(res.accept_token_num[b])
    last = int(res.accept_index[b, n]) - b * K
    r = probs[b, last].double().clone()
    if n < steps - 1:  # the walk ended by rejecting every child of `last`
        c = int(links.retrive_next_token[b, last])
        while c != -1:
            r[int(tokens[b, c])] = 0.0
            c = int(links.retrive_next_sibling[b, c])
        if r.sum() <= 0:
            r = probs[b, last].double()
    cdf = torch.cumsum(r, 0)
    u, tol = float(final_coin) * float(cdf[-1]), 1e-5 * float(cdf[-1])
    p = int(res.predicts[b * K + last])
    return r[p] > 0 and (p == 0 or cdf[p - 1] - tol <= u) and u <= cdf[p] + tol


@pytest.mark.parametrize("K", [1, 2, 7, 16, 33, 64])
@pytest.mark.parametrize("bs", [1, 5, 64, 256])
def test_parity(bs, K):
    dev = "cuda"
    vocab = 3
    trees, parents, tokens, prefix, targets = make_batch(bs, K, vocab, seed=bs * 100 + K)
    want_mask, want_idx = ref.tree_indices_from_parents(parents, prefix)
    got_mask, got_idx = kernels.tree_indices_from_parents(parents.to(dev), prefix.to(dev))
    assert torch.equal(got_mask.cpu(), want_mask)
    assert_same(got_idx, want_idx)
    assert_same(kernels.tree_indices_from_mask(want_mask.to(dev), prefix.to(dev)), want_idx)

    links = [t.to(dev) for t in want_idx[1:]]
    for steps in sorted({1, 2, max(1, K // 2), K}):
        want = ref.verify_tree_greedy(tokens, *want_idx[1:], targets, steps)
        assert_same(kernels.verify_tree_greedy(tokens.to(dev), *links, targets.to(dev), steps), want)

    kv_len = int(prefix.max()) + K + 3  # odd on purpose: not a multiple of 16
    for kv in (kv_len, (kv_len + 15) // 16 * 16):
        assert torch.equal(kernels.tree_attention_mask(want_mask.to(dev), prefix.to(dev), kv).cpu(),
                           ref.tree_attention_mask(want_mask, prefix, kv))
    flat, indptr = kernels.tree_attention_mask_flat(want_mask.to(dev), prefix.to(dev))
    want_flat, want_indptr = ref.tree_attention_mask_flat(want_mask, prefix)
    assert torch.equal(flat.cpu(), want_flat) and torch.equal(indptr.cpu(), want_indptr)

    res = ref.verify_tree_greedy(tokens, *want_idx[1:], targets, K)
    num_slots = bs * K + 11
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(K))[: bs * K].reshape(bs, K)
    for row_shape, dtype in (((4, 8), torch.bfloat16), ((3,), torch.float32), ((5,), torch.int8)):
        cache = torch.randint(-100, 100, (6, num_slots, *row_shape)).to(dtype)
        want_cache = cache.clone()
        ref.compact_kv_cache(want_cache, slots, res.accept_index, res.accept_token_num)
        got_cache = cache.to(dev)
        kernels.compact_kv_cache(got_cache, slots.to(dev), res.accept_index.to(dev), res.accept_token_num.to(dev))
        assert torch.equal(got_cache.cpu(), want_cache)


@pytest.mark.parametrize("K,vocab", [(1, 7), (7, 5), (16, 1001), (64, 8), (16, 49152), (64, 32000)])
@pytest.mark.parametrize("bs", [1, 37, 256])
@pytest.mark.parametrize("thresholds", [(1.0, 1.0), (0.4, 0.7)])
def test_sampling_parity(bs, K, vocab, thresholds):
    if bs * K * vocab > 2**30 // 4:
        pytest.skip("keeps target_probs under 1 GiB")
    dev = "cuda"
    trees, parents, tokens, prefix, _ = make_batch(bs, K, min(vocab, 6), seed=K + vocab + bs)
    g = torch.Generator().manual_seed(bs + K)
    logits = 4 * torch.randn(bs, K, vocab, generator=g)
    probs = torch.softmax(logits, -1)
    probs[..., 1] = 0.0  # drafts propose token 1 but the target never emits it
    probs /= probs.sum(-1, keepdim=True)
    coins, final = torch.rand(bs, K, generator=g), torch.rand(bs, generator=g)
    _, idx = ref.tree_indices_from_parents(parents, prefix)
    links = [t.to(dev) for t in idx[1:]]
    for steps in sorted({1, max(1, K // 3), K}):
        want = ref.tree_speculative_sampling(tokens, *idx[1:], coins, final, probs, steps, *thresholds)
        got = kernels.tree_speculative_sampling(tokens.to(dev), *links, coins.to(dev), final.to(dev),
                                                probs.to(dev), steps, *thresholds)
        got = [t.cpu() for t in got]
        assert torch.equal(got[1], want.accept_index) and torch.equal(got[2], want.accept_token_num)
        mismatch = (got[0] != want.predicts).nonzero().flatten().tolist()
        got_res = ref.VerifyResult(*got)
        for i in mismatch:
            b = i // K
            assert i == got_res.accept_index[b, got_res.accept_token_num[b]], "only the bonus token may differ"
            assert residual_ok(got_res, b, K, tokens, idx, probs, final[b], steps), (b, steps)
        assert len(mismatch) <= max(1, bs // 100), mismatch


def test_sampling_is_exact_chi_square_on_gpu():
    from tests.verifier.step.test_reference_verify import exactness_pvalues

    pvalues = exactness_pvalues(kernels.tree_speculative_sampling, n=200_000, seed=1, device="cuda")
    assert not any(np.isnan(list(pvalues.values()))), pvalues
    assert min(pvalues.values()) > 1e-6, pvalues


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K,vocab", [(1, 7), (7, 5), (16, 1001), (16, 49152), (64, 32000)])
@pytest.mark.parametrize("bs", [1, 37, 134])
def test_sampling_from_logits_parity(bs, K, vocab, dtype, truncate):
    """The kernel that reads logits against the reference that writes their softmax: the same
    acceptance decisions and bonus tokens, except within rounding of a boundary (its exp is the fast
    one, and it sums in float32), rarely; greedy rows (T = 0) and rows with a NaN or inf included;
    with top-k / top-p on some rows (``truncate``), the floor's too."""
    if bs * K * vocab > 2**30 // 4:
        pytest.skip("keeps the reference's probabilities under 1 GiB")
    dev = "cuda"
    trees, parents, tokens, prefix, _ = make_batch(bs, K, min(vocab, 6), seed=K + vocab + bs + 1)
    g = torch.Generator().manual_seed(bs + K + 1)
    logits = (4 * torch.randn(bs, K, vocab, generator=g)).to(dtype)
    logits[..., 1] = -1e4  # drafts propose token 1 but the target (almost) never emits it
    flat = logits.view(bs * K, vocab)
    temp = torch.empty(bs * K).uniform_(0.3, 1.5, generator=g)
    temp[torch.rand(bs * K, generator=g) < 0.2] = 0.0  # greedy rows
    bad_rows = torch.randperm(bs * K, generator=g)[: max(1, bs * K // 50)]
    flat[bad_rows[0], 0] = float("nan")
    if len(bad_rows) > 1:
        flat[bad_rows[1:], -1] = float("inf")
    coins, final = torch.rand(bs, K, generator=g), torch.rand(bs, generator=g)
    _, idx = ref.tree_indices_from_parents(parents, prefix)
    links = [t.to(dev) for t in idx[1:]]
    trunc = {}
    if truncate:
        rows = bs * K
        trunc = {"top_k": torch.where(torch.rand(rows, generator=g) < 0.5, float(min(vocab, 40)), 0.0),
                 "top_p": torch.where(torch.rand(rows, generator=g) < 0.7, 0.9, 1.0)}
    trunc_dev = {k: v.to(dev) for k, v in trunc.items()}
    for steps in sorted({1, max(1, K // 3), K}):
        want, want_bad = ref.tree_sampling_logits(tokens, *idx[1:], coins, final, logits, temp, steps, **trunc)
        got, got_bad = kernels.tree_sampling_logits(tokens.to(dev), *links, coins.to(dev), final.to(dev),
                                                    logits.to(dev), temp.to(dev), steps, **trunc_dev)
        assert torch.equal(got_bad.cpu(), want_bad)
        got = ref.VerifyResult(*(t.cpu() for t in got))
        differ = (got.accept_token_num != want.accept_token_num).nonzero().flatten().tolist()
        assert len(differ) <= max(1, bs // 50), differ  # an acceptance coin within rounding of q's sum
        same = [b for b in range(bs) if b not in differ]
        assert torch.equal(got.accept_index[same], want.accept_index[same])
        mismatch = [i for i in (got.predicts != want.predicts).nonzero().flatten().tolist() if i // K in same]
        assert len(mismatch) <= max(1, bs // 50), mismatch


def test_sampling_from_logits_is_exact_chi_square_on_gpu():
    from tests.verifier.step.test_reference_verify import exactness_pvalues

    def from_logits(cand, ridx, nxt, sib, coins, final, q, steps, single, acc):
        logits = q.log().clamp(min=-1e4)  # exp(-1e4) is 0 in float32: the target's zeros stay zeros
        temp = torch.ones(q.shape[0] * q.shape[1], device=q.device)
        return kernels.tree_sampling_logits(cand, ridx, nxt, sib, coins, final, logits, temp, steps, single, acc)[0]

    pvalues = exactness_pvalues(from_logits, n=200_000, seed=2, device="cuda")
    assert not any(np.isnan(list(pvalues.values()))), pvalues
    assert min(pvalues.values()) > 1e-6, pvalues


def test_truncated_sampling_from_logits_is_exact_chi_square_on_gpu():
    from tests.verifier.step.test_reference_verify import exactness_pvalues
    from tests.verifier.step.test_target_probs import truncated_from_probs

    pvalues = exactness_pvalues(truncated_from_probs(kernels.tree_sampling_logits), n=200_000, seed=4, device="cuda")
    assert not any(np.isnan(list(pvalues.values()))), pvalues
    assert min(pvalues.values()) > 1e-6, pvalues


def test_greedy_pipeline_under_cuda_graph():
    """indices + verify + compaction captured once, replayed on new inputs, equal to eager."""
    dev, bs, K = "cuda", 64, 16
    _, parents, tokens, prefix, targets = make_batch(bs, K, 3, seed=5)
    static = [t.to(dev) for t in (parents, tokens, prefix, targets)]
    slots = torch.arange(bs * K, device=dev).reshape(bs, K)
    cache = torch.zeros(4, bs * K, 8, device=dev)

    def step(parents, tokens, prefix, targets):
        _, idx = kernels.tree_indices_from_parents(parents, prefix)
        res = kernels.verify_tree_greedy(tokens, *idx[1:], targets, K)
        kernels.compact_kv_cache(cache, slots, res.accept_index, res.accept_token_num)
        return res

    step(*static)  # build + load the library outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*static)
    _, parents2, tokens2, prefix2, targets2 = make_batch(bs, K, 3, seed=6)
    for s, new in zip(static, (parents2, tokens2, prefix2, targets2)):
        s.copy_(new)
    fill = torch.arange(bs * K, device=dev, dtype=torch.float32)[None, :, None].expand_as(cache)
    cache.copy_(fill)
    graph.replay()
    torch.cuda.synchronize()
    want_cache = fill.cpu().clone()
    _, idx = ref.tree_indices_from_parents(parents2, prefix2)
    want = ref.verify_tree_greedy(tokens2, *idx[1:], targets2, K)
    ref.compact_kv_cache(want_cache, slots.cpu(), want.accept_index, want.accept_token_num)
    assert_same(out, want)
    assert torch.equal(cache.cpu(), want_cache)


def test_kernel_argument_errors_name_the_source_line(cuda_kernels):
    with pytest.raises(kernels.NativeKernelError, match=r"verify_greedy\.cu:\d+: invalid argument"):
        cuda_kernels.call("ngk_verify_tree_greedy", *([None] * 8), 1, 65, 4, None)


def test_against_sgl_kernel_when_installed():
    sgl = pytest.importorskip("sgl_kernel", reason="sgl_kernel not installed")
    dev, bs, K = "cuda", 32, 16
    _, parents, tokens, prefix, targets = make_batch(bs, K, 3, seed=9)
    mask, want_idx = ref.tree_indices_from_parents(parents, prefix)
    out = [torch.empty(bs * K, dtype=torch.int64, device=dev)] + [torch.full((bs, K), -1, dtype=torch.int64, device=dev) for _ in range(3)]
    sgl.reconstruct_indices_from_tree_mask(mask.flatten().to(dev), prefix.to(dev), *out, bs, K)
    assert_same(out, want_idx)
    predicts = torch.full((bs * K,), -1, dtype=torch.int32, device=dev)
    accept_index = torch.full((bs, K), -1, dtype=torch.int32, device=dev)
    num = torch.empty(bs, dtype=torch.int32, device=dev)
    sgl.verify_tree_greedy(predicts, accept_index, num, tokens.to(dev), *[t.to(dev) for t in want_idx[1:]], targets.to(dev))
    want = ref.verify_tree_greedy(tokens, *want_idx[1:], targets, K)
    assert torch.equal(accept_index.cpu(), want.accept_index) and torch.equal(num.cpu(), want.accept_token_num)
