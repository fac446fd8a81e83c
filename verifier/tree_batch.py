"""Per-step tree batches: prune each request's draft to its best nodes and pad the batch to K.

A draft is (tokens, parents, probs) with parent -1 = the root (the request's last token) and
parents before children. Path probabilities never grow from a parent to its child, so the k nodes
with the highest probability (ties broken by position) always include their ancestors: a closed
subtree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verifier import kernels

PAD_PARENT = -2  # below -1: an isolated padding node, never verified (flatten_draft_tree)


def prune_tree(tokens: np.ndarray, parents: np.ndarray, probs: np.ndarray, k: int):
    """The k most probable nodes as a valid tree, in their original order."""
    n = len(tokens)
    if k >= n:
        return tokens, parents, probs
    keep = np.sort(np.argsort(-probs, kind="stable")[:k])
    remap = np.full(n, -1, dtype=np.int64)
    remap[keep] = np.arange(len(keep))
    p = parents[keep].astype(np.int64)
    new_parents = np.where(p >= 0, remap[np.maximum(p, 0)], -1)
    if np.any((p >= 0) & (new_parents < 0)):  # probabilities not monotone: keep the first k instead
        keep = np.arange(k)
        return tokens[:k], parents[:k], probs[:k]
    return tokens[keep], new_parents, probs[keep]


@dataclass
class TreeBatch:
    """Tensors of one verify step (bs requests, K nodes each, node 0 = root)."""

    tokens: torch.Tensor  # [bs, K] int64
    mask: torch.Tensor  # [bs, K, K] bool ancestor-or-self
    indices: kernels.TreeIndices
    prefix_lens: torch.Tensor  # [bs] int64
    num_nodes: list[int]  # real nodes per request incl. the root
    predicted: float  # sum of the verified draft nodes' path probabilities


def build_tree_batch(last_tokens: list[int], drafts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                     prefix_lens: list[int], device: torch.device) -> TreeBatch:
    bs = len(last_tokens)
    K = 1 + max((len(d[0]) for d in drafts), default=0)
    draft_tokens = np.zeros((bs, K - 1), dtype=np.int64)
    draft_parents = np.full((bs, K - 1), PAD_PARENT, dtype=np.int64)
    predicted = 0.0
    for b, (tok, par, prob) in enumerate(drafts):
        draft_tokens[b, :len(tok)] = tok
        draft_parents[b, :len(par)] = par
        predicted += float(np.sum(prob))
    prefix = torch.tensor(prefix_lens, dtype=torch.int64, device=device)
    tokens, parents = kernels.flatten_draft_tree(
        torch.tensor(last_tokens, dtype=torch.int64, device=device),
        torch.from_numpy(draft_tokens).to(device), torch.from_numpy(draft_parents).to(device))
    mask, indices = kernels.tree_indices_from_parents(parents, prefix)
    return TreeBatch(tokens, mask, indices, prefix, [1 + len(d[0]) for d in drafts], predicted)
