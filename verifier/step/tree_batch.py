"""Per-step tree batches: prune each request's draft to its best nodes and pad the batch to K.

The engine plans every step with the native ``verifier.step._native.pack_plan``
(``csrc/step_rows.h``); the numpy functions here are its references (tests compare the two).

A draft is (tokens, parents, probs) with parent -1 = the root (the request's last token) and
parents before children. Path probabilities never grow from a parent to its child, so the k nodes
with the highest probability (ties broken by position) always include their ancestors: a closed
subtree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


def best_first_rows(probs: np.ndarray) -> bool:
    """Whether every row of [n, W] padded probabilities (padding 0, probabilities >= 0) is
    non-increasing: the corpus ranks a tree's nodes best-first, parents before children."""
    return probs.shape[1] < 2 or bool((probs[:, 1:] <= probs[:, :-1]).all())


def prune_rows(tokens: np.ndarray, parents: np.ndarray, probs: np.ndarray, counts: np.ndarray, k: int,
               best_first: bool | None = None):
    """``prune_tree`` for a whole batch at once: rows of [n, W] padded drafts (``counts[i]`` real
    nodes in row i, padding probability 0) -> the same arrays [n, k] holding each row's k most
    probable nodes as a valid tree (original order), and the new counts. Rows whose probabilities
    are not monotone keep their first k nodes, as prune_tree does. ``best_first``: whether
    ``best_first_rows(probs)`` holds, if the caller knows (None: checked here)."""
    n, W = tokens.shape
    counts = np.minimum(counts, W).astype(np.int64)
    k = min(k, W)
    new_counts = np.minimum(counts, k)
    if n == 0 or k == 0:
        return tokens[:, :0], parents[:, :0], probs[:, :0], new_counts
    # Nothing to drop; or rows ranked best-first (probabilities non-increasing, parents before
    # children), whose k most probable nodes are their first k (ties keep their order, as the
    # stable sort below would): one comparison instead of the sort and the remapping.
    if counts.max() <= k or (best_first if best_first is not None else best_first_rows(probs)):
        return tokens[:, :k], parents[:, :k], probs[:, :k], new_counts
    valid = np.arange(W)[None, :] < counts[:, None]
    key = np.where(valid, -probs.astype(np.float64), np.inf)
    keep = np.sort(np.argsort(key, axis=1, kind="stable")[:, :k], axis=1)
    kept = np.arange(k)[None, :] < new_counts[:, None]
    rows = np.arange(n)[:, None]
    remap = np.full((n, W), -1, dtype=np.int64)
    remap[rows, keep] = np.where(kept, np.arange(k)[None, :], -1)
    p = np.take_along_axis(parents.astype(np.int64), keep, 1)
    new_parents = np.where(p >= 0, np.take_along_axis(remap, np.maximum(p, 0), 1), -1)
    broken = np.any(kept & (p >= 0) & (new_parents < 0), axis=1)
    if broken.any():  # not monotone: the first k nodes (parents precede children, so a valid tree)
        keep[broken] = np.arange(k)
        new_parents[broken] = parents[broken, :k]
    return (np.take_along_axis(tokens, keep, 1), new_parents, np.take_along_axis(probs, keep, 1), new_counts)


def pack_rows(last_tokens: list[int], tokens: np.ndarray, parents: np.ndarray, probs: np.ndarray,
              counts: np.ndarray, prefix_lens: list[int], slots: list[int], num_nodes: int = 1) -> "PackedTrees":
    """``pack_trees`` from [bs, W] padded draft arrays (``counts[b]`` real nodes each, parents -1 =
    the root) without a Python loop over requests."""
    # A batch-1 step spends more time in numpy's per-call overhead than in its work: every
    # operation below serves all rows at once, and there are as few as the layout allows.
    bs = tokens.shape[0]
    counts_list = counts.tolist()
    W = min(tokens.shape[1], max(counts_list, default=0))
    K = max(num_nodes, 1 + W)
    host = np.empty(2 * bs * K + 2 * bs, dtype=np.int64)
    tp = host[:2 * bs * K].reshape(2, bs, K)  # tokens, parents
    last = np.asarray(last_tokens, dtype=np.int64)[:, None]
    tp[0] = last  # the root, and padding nodes repeating it
    tp[1] = -1  # the root, and padding nodes (isolated)
    predicted = 0.0
    if W:
        if min(counts_list) == W:  # no row is shorter (always so at batch 1): plain copies
            tp[0, :, 1:1 + W] = tokens[:, :W]
            tp[1, :, 1:1 + W] = parents[:, :W]
            tp[1, :, 1:1 + W] += 1  # draft parent -1 (the root) -> node 0
        else:  # a shorter row's padding keeps repeating the root, isolated
            real = np.arange(W) < counts[:, None]
            np.copyto(tp[0, :, 1:1 + W], tokens[:, :W], where=real)
            np.copyto(tp[1, :, 1:1 + W], parents[:, :W] + 1, where=real)
        predicted = float(probs[:, :W].sum(dtype=np.float64))  # padding probabilities are 0
    host[2 * bs * K:2 * bs * K + bs] = prefix_lens
    host[2 * bs * K + bs:] = slots
    return PackedTrees(host, bs, K, [1 + c for c in counts_list], predicted)


@dataclass
class PackedTrees:
    """A step's flattened trees on the host, in the layout that crosses to the device in one copy:
    ``host`` = tokens [R, K], parents [R, K] (node index; -1 = root or isolated padding node),
    prefix lens [R], cache slots [R], all int64, where R = ``rows`` (a graph bucket's, written in
    place into its staging; rows past ``bs`` are padding) or ``bs``."""

    host: np.ndarray
    bs: int
    K: int
    num_nodes: list[int]  # real nodes per request incl. the root
    predicted: float  # sum of the draft nodes' path probabilities
    rows: int = 0  # 0: bs

    @property
    def _R(self) -> int:
        return self.rows or self.bs

    @property
    def tokens(self) -> np.ndarray:
        return self.host[:self.bs * self.K].reshape(self.bs, self.K)

    @property
    def parents(self) -> np.ndarray:
        n = self._R * self.K
        return self.host[n:n + self.bs * self.K].reshape(self.bs, self.K)

    @property
    def prefix_lens(self) -> np.ndarray:
        n = 2 * self._R * self.K
        return self.host[n:n + self.bs]

    @property
    def slots(self) -> np.ndarray:
        n = 2 * self._R * self.K + self._R
        return self.host[n:n + self.bs]


def pack_trees(last_tokens: list[int], drafts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
               prefix_lens: list[int], slots: list[int] | None = None, num_nodes: int = 1) -> PackedTrees:
    """``num_nodes``: pad every tree to at least this many nodes (a CUDA-graph bucket)."""
    bs = len(last_tokens)
    K = max(num_nodes, 1 + max((len(d[0]) for d in drafts), default=0))
    # Per-step host work, not GPU work, bounds a small model's step time: the trees are flattened
    # (kernels.flatten_draft_tree's form) with numpy and cross to the device in one copy.
    host = np.empty(2 * bs * K + 2 * bs, dtype=np.int64)
    packed = PackedTrees(host, bs, K, [1 + len(d[0]) for d in drafts], 0.0)
    tokens, parents = packed.tokens, packed.parents
    # Padding nodes repeat the root's token at the root's position: the same finite K/V as the root
    # (a pad token whose K/V were NaN would poison every row of the request: 0 * NaN in attention).
    tokens[:] = np.asarray(last_tokens, dtype=np.int64)[:, None]
    parents[:] = -1  # the root, and padding nodes (isolated: they see the prefix and themselves)
    packed.prefix_lens[:] = prefix_lens
    packed.slots[:] = slots if slots is not None else 0
    predicted = 0.0
    for b, (tok, par, prob) in enumerate(drafts):
        n = len(tok)
        if n:
            tokens[b, 1:1 + n] = tok
            parents[b, 1:1 + n] = np.asarray(par, dtype=np.int64) + 1  # draft parent -1 (root) -> node 0
            predicted += float(np.sum(prob))
    packed.predicted = predicted
    return packed
