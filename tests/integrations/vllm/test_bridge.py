"""The plugin's parts that need no vLLM: the chain it takes from a draft tree, its input checks,
and what it says on a machine without vLLM."""

from __future__ import annotations

import numpy as np
import pytest

from corpus_service.engine.corpus import DraftBatch
from corpus_service.integrations.vllm import compat
from corpus_service.integrations.vllm.bridge import StepRequest, best_chain


def batch(rows: list[tuple[list[int], list[int], list[float]]], budget: int = 8) -> DraftBatch:
    n = len(rows)
    tokens, parents = np.full((n, budget), -1, np.int32), np.full((n, budget), -1, np.int32)
    probs, counts = np.zeros((n, budget), np.float32), np.zeros(n, np.int32)
    for i, (t, p, q) in enumerate(rows):
        tokens[i, :len(t)], parents[i, :len(t)], probs[i, :len(t)], counts[i] = t, p, q, len(t)
    return DraftBatch(tokens, parents, probs, counts)


def test_best_chain_follows_the_most_probable_child():
    # root -> 10 (0.6) -> 11 (0.5) -> 12 (0.2); root -> 20 (0.3) -> 21 (0.29); 10 -> 13 (0.05)
    b = batch([([10, 20, 11, 21, 13, 12], [-1, -1, 0, 1, 0, 2], [0.6, 0.3, 0.5, 0.29, 0.05, 0.2])])
    assert best_chain(b, 0, 8) == [10, 11, 12]
    assert best_chain(b, 0, 2) == [10, 11]
    assert best_chain(b, 0, 0) == []


def test_best_chain_of_an_empty_tree_and_a_single_node():
    b = batch([([], [], []), ([7], [-1], [0.9])])
    assert best_chain(b, 0, 8) == []
    assert best_chain(b, 1, 8) == [7]


def test_step_request_checks_its_lengths():
    ids = np.arange(10)
    StepRequest("r", ids, 4, 10, 8)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        StepRequest("r", ids, 0, 5, 8)
    with pytest.raises(ValueError, match="len\\(token_ids\\)"):
        StepRequest("r", ids, 4, 11, 8)
    with pytest.raises(ValueError, match="max_draft"):
        StepRequest("r", ids, 4, 10, -1)


def test_without_vllm_the_plugin_says_why_and_patches_nothing(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # this test process never has vLLM
    why, base = compat.check_engine()
    assert base is None and "not importable" in why
