"""verifier.step.reference attention masks and KV compaction against brute-force definitions."""

import random

import pytest
import torch

import tree_cases as tc
from verifier.step import reference as ref


def brute_row(parents, i, prefix_len, kv_len):
    anc = set(tc.ancestors(parents, i))
    return [int(c < prefix_len or (c - prefix_len) in anc) for c in range(kv_len)]


@pytest.mark.parametrize("K", [1, 5, 64])
def test_dense_and_flat_masks(K):
    rng = random.Random(K)
    trees = [tc.random_tree(K, rng, pad=1 if K > 2 else 0) for _ in range(3)]
    prefix = [0, 3, 17]
    mask = ref.tree_mask_from_parents(torch.tensor(trees))
    kv_len = max(prefix) + K + 5
    dense = ref.tree_attention_mask(mask, torch.tensor(prefix), kv_len)
    flat, indptr = ref.tree_attention_mask_flat(mask, torch.tensor(prefix))
    expected_flat = []
    for b, pl in enumerate(trees):
        for i in range(K):
            row = brute_row(pl, i, prefix[b], kv_len)
            assert dense[b, i].int().tolist() == row
            expected_flat += row[: prefix[b] + K]
        assert indptr[b + 1] - indptr[b] == K * (prefix[b] + K)
    assert flat.int().tolist() == expected_flat


def test_dense_mask_matches_sdpa_semantics():
    # attention through the mask equals attention over each node's explicit key set
    torch.manual_seed(0)
    parents = torch.tensor([[-1, 0, 0, 1, 3]])
    mask = ref.tree_mask_from_parents(parents)
    prefix, K, D = 4, 5, 8
    q, k, v = torch.randn(1, 1, K, D), torch.randn(1, 1, prefix + K, D), torch.randn(1, 1, prefix + K, D)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=ref.tree_attention_mask(mask, torch.tensor([prefix]), prefix + K)[:, None])
    for i in range(K):
        keys = list(range(prefix)) + [prefix + j for j in tc.ancestors(parents[0].tolist(), i)]
        w = torch.softmax(q[0, 0, i] @ k[0, 0, keys].T / D ** 0.5, -1)
        torch.testing.assert_close(out[0, 0, i], w @ v[0, 0, keys])


def brute_compact(cache, slots, accept_index, num):
    cache = cache.clone()
    bs, K = slots.shape
    for b in range(bs):
        for t in range(1, int(num[b]) + 1):
            node = int(accept_index[b, t]) - b * K
            cache[:, slots[b, t]] = cache[:, slots[b, node]].clone()
    return cache


@pytest.mark.parametrize("K", [2, 9, 64])
def test_compaction_moves_accepted_path_to_the_front(K):
    rng = random.Random(K)
    bs, vocab = 5, 2
    trees = [tc.random_tree(K, rng) for _ in range(bs)]
    parents, tokens, _ = tc.batch(trees, vocab, seed=K)
    _, idx = ref.tree_indices_from_parents(parents, torch.zeros(bs, dtype=torch.int64))
    targets = torch.tensor([tc.greedy_targets(t, tok, vocab, rng, follow=1.0) for t, tok in zip(trees, tokens.tolist())])
    res = ref.verify_tree_greedy(tokens, idx.retrive_index, idx.retrive_next_token, idx.retrive_next_sibling, targets, K)
    assert res.accept_token_num.sum() > 0
    num_slots = bs * K + 7
    slots = torch.randperm(num_slots)[: bs * K].reshape(bs, K)  # a paged pool: any distinct slots
    cache = torch.randn(3, num_slots, 2, 4)
    original = cache.clone()
    expected = brute_compact(cache, slots, res.accept_index, res.accept_token_num)
    ref.compact_kv_cache(cache, slots, res.accept_index, res.accept_token_num)
    assert torch.equal(cache, expected)
    for b in range(bs):  # the accepted path's original rows now sit in slots[b, 0..n], in order
        for t in range(int(res.accept_token_num[b]) + 1):
            node = int(res.accept_index[b, t]) - b * K
            assert torch.equal(cache[:, slots[b, t]], original[:, slots[b, node]])
