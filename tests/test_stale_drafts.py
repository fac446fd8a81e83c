"""bench/stale_drafts.py's tree helpers: re-rooting along committed tokens and merging two trees
into a closed tree of at most ``budget`` nodes."""

import pytest

from bench.acceptance import accept_path
from bench.stale_drafts import as_paths, merge, reroot


def test_reroot_and_merge():
    # root -> 5 (0.8) -> 6 (0.6) -> 7 (0.5); root -> 9 (0.2)
    tree = as_paths([5, 9, 6, 7], [-1, -1, 0, 2], [0.8, 0.2, 0.6, 0.5])
    assert tree == pytest.approx({(5,): 0.8, (9,): 0.2, (5, 6): 0.6, (5, 6, 7): 0.5})
    assert reroot(tree, [5]) == pytest.approx({(6,): 0.75, (6, 7): 0.625})
    assert reroot(tree, [5, 6, 7]) == {} and reroot(tree, [4]) == {}
    fresh = {(6,): 0.9, (8,): 0.5}
    tokens, parents = merge(fresh, reroot(tree, [5]), budget=3)
    assert (tokens, parents) == ([6, 8, 7], [-1, -1, 0])  # by depth, then probability
    assert accept_path(tokens, parents, [6, 7, 1]) == 2
    # A budget below the union keeps the most probable nodes, never a child without its parent.
    assert merge(fresh, reroot(tree, [5]), budget=1) == ([6], [-1])
