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
    tokens_host: np.ndarray | None = None  # [bs, K] int64, the same as ``tokens`` (no copy back)
    slots: torch.Tensor | None = None  # [bs] int64 cache slots, when given


def build_tree_batch(last_tokens: list[int], drafts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                     prefix_lens: list[int], device: torch.device, slots: list[int] | None = None,
                     num_nodes: int = 1) -> TreeBatch:
    """``num_nodes``: pad every tree to at least this many nodes (a CUDA-graph bucket)."""
    bs = len(last_tokens)
    K = max(num_nodes, 1 + max((len(d[0]) for d in drafts), default=0))
    # The flattened tree (kernels.flatten_draft_tree's form) is built on the host and crosses to
    # the device in one copy: tokens [bs, K], parents [bs, K], prefix lens [bs], cache slots [bs].
    # Per-step host work, not GPU work, bounds a small model's step time.
    host = np.empty(2 * bs * K + 2 * bs, dtype=np.int64)
    tokens, parents = host[:bs * K].reshape(bs, K), host[bs * K:2 * bs * K].reshape(bs, K)
    # Padding nodes repeat the root's token at the root's position: the same finite K/V as the root
    # (a pad token whose K/V were NaN would poison every row of the request: 0 * NaN in attention).
    tokens[:] = np.asarray(last_tokens, dtype=np.int64)[:, None]
    parents[:] = -1  # the root, and padding nodes (isolated: they see the prefix and themselves)
    host[2 * bs * K:2 * bs * K + bs] = prefix_lens
    host[2 * bs * K + bs:] = slots if slots is not None else 0
    predicted = 0.0
    for b, (tok, par, prob) in enumerate(drafts):
        n = len(tok)
        tokens[b, 1:1 + n] = tok
        parents[b, 1:1 + n] = np.asarray(par, dtype=np.int64) + 1  # draft parent -1 (root) -> node 0
        predicted += float(np.sum(prob))
    dev = torch.from_numpy(host).to(device)
    prefix = dev[2 * bs * K:2 * bs * K + bs]
    mask, indices = kernels.tree_indices_from_parents(dev[bs * K:2 * bs * K].view(bs, K), prefix)
    return TreeBatch(dev[:bs * K].view(bs, K), mask, indices, prefix, [1 + len(d[0]) for d in drafts], predicted,
                     tokens, None if slots is None else dev[2 * bs * K + bs:])
