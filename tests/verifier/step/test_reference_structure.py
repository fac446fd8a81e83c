"""verifier.step.reference tree structure against hand-made trees and brute-force definitions."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tree_cases as tc
from verifier.step import reference as ref


def test_hand_made_tree():
    #        0
    #      /   \
    #     1     2
    #    / \    |
    #   3   4   5
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]])
    mask, idx = ref.tree_indices_from_parents(parents, torch.tensor([10]))
    assert mask[0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]
    assert idx.positions.tolist() == [10, 11, 11, 12, 12, 12]
    assert idx.retrive_index.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert idx.retrive_next_token.tolist() == [[1, 3, 5, -1, -1, -1]]
    assert idx.retrive_next_sibling.tolist() == [[-1, 2, -1, 4, -1, -1]]
    again = ref.tree_indices_from_mask(mask, torch.tensor([10]))
    for a, b in zip(again, idx):
        assert torch.equal(a, b)


def test_second_request_uses_flat_indices_and_own_prefix():
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 0]])
    _, idx = ref.tree_indices_from_parents(parents, torch.tensor([0, 7]))
    assert idx.retrive_index.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert idx.positions.tolist() == [0, 1, 2, 7, 8, 8]
    assert idx.retrive_next_token.tolist() == [[1, 2, -1], [1, -1, -1]]
    assert idx.retrive_next_sibling.tolist() == [[-1, -1, -1], [-1, 2, -1]]


def test_flatten_draft_tree():
    tokens, parents = ref.flatten_draft_tree(
        torch.tensor([9]), torch.tensor([[5, 6, 7, 0]]), torch.tensor([[-1, 0, -1, -2]])
    )
    assert tokens.tolist() == [[9, 5, 6, 7, 0]]
    assert parents.tolist() == [[-1, 0, 1, 0, -1]]  # -2 (padding) -> isolated


def _check_against_brute(parent_lists, prefix_lens):
    parents = torch.tensor(parent_lists)
    prefix = torch.tensor(prefix_lens)
    mask, idx = ref.tree_indices_from_parents(parents, prefix)
    from_mask = ref.tree_indices_from_mask(mask, prefix)
    K = parents.shape[1]
    for b, pl in enumerate(parent_lists):
        assert mask[b].int().tolist() == tc.brute_mask(pl)
        positions, first, sib = tc.brute_links(pl, prefix_lens[b])
        for got in (idx, from_mask):
            assert got.positions[b * K:(b + 1) * K].tolist() == positions
            assert got.retrive_next_token[b].tolist() == first
            assert got.retrive_next_sibling[b].tolist() == sib
            assert got.retrive_index[b].tolist() == list(range(b * K, (b + 1) * K))


@pytest.mark.parametrize("shape", ["chain", "fan_out", "binary", "random"])
@pytest.mark.parametrize("K", [1, 2, 7, 16, 64])
def test_shapes_against_brute_force(shape, K):
    rng = random.Random(K)
    trees = [tc.shaped(shape, K, rng) for _ in range(3)]
    _check_against_brute(trees, [0, 5, 1000])


def test_padding_nodes_are_isolated():
    rng = random.Random(1)
    trees = [tc.random_tree(12, rng, pad=4) for _ in range(4)]
    _check_against_brute(trees, [3, 3, 3, 3])
    _, idx = ref.tree_indices_from_parents(torch.tensor(trees), torch.tensor([3] * 4))
    reachable = set()
    for b in range(4):
        nxt, sib = idx.retrive_next_token[b].tolist(), idx.retrive_next_sibling[b].tolist()
        reachable = {j for j in nxt + sib if j >= 0}
        assert not reachable & set(range(8, 12))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_trees_property(data):
    K = data.draw(st.integers(1, 64))
    bs = data.draw(st.integers(1, 4))
    trees = [[-1] + [data.draw(st.integers(-1, i - 1)) for i in range(1, K)] for _ in range(bs)]
    prefix = [data.draw(st.integers(0, 10_000)) for _ in range(bs)]
    _check_against_brute(trees, prefix)
