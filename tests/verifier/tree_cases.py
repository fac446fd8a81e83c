"""Draft trees for the verifier tests, plus brute-force definitions written without tensors.

Trees are flattened parent lists: parents[0] = -1 (the root), parents[i] in [0, i) for a node,
-1 for i > 0 marks an isolated padding node.
"""

from __future__ import annotations

import random

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def chain(K):
    return [-1] + list(range(K - 1))


def fan_out(K):
    return [-1] + [0] * (K - 1)


def binary(K):
    return [-1] + [(i - 1) // 2 for i in range(1, K)]


def random_tree(K, rng: random.Random, pad: int = 0):
    """Random recursive tree (each node picks an earlier parent), last `pad` nodes isolated."""
    parents = [-1] + [rng.randrange(i) for i in range(1, K)]
    for i in range(max(1, K - pad), K):
        parents[i] = -1
    return parents


def shaped(name, K, rng):
    return {"chain": chain, "fan_out": fan_out, "binary": binary}.get(name, lambda k: random_tree(k, rng))(K)


# --- brute force (pure Python) -------------------------------------------------------------


def ancestors(parents, i):
    """Root-to-node path of node i (inclusive), following parents; parentless nodes are their own path."""
    path = [i]
    while i > 0 and 0 <= parents[i] < i:
        i = parents[i]
        path.append(i)
    return path[::-1]


def brute_mask(parents):
    K = len(parents)
    return [[int(j in ancestors(parents, i)) for j in range(K)] for i in range(K)]


def children(parents, i):
    return [j for j in range(i + 1, len(parents)) if parents[j] == i and j > 0]


def brute_links(parents, prefix_len):
    K = len(parents)
    positions = [prefix_len + len(ancestors(parents, i)) - 1 for i in range(K)]
    first = [min(children(parents, i), default=-1) for i in range(K)]
    sib = []
    for i in range(K):
        p = parents[i] if i > 0 else -1
        sib.append(min([j for j in children(parents, p) if j > i], default=-1) if p >= 0 else -1)
    return positions, first, sib


def brute_greedy(parents, tokens, target, num_spec_steps):
    """Enumerate every root-to-node path, keep those accepted by greedy verification (each step
    the lowest-index child whose token equals the target at its parent), return the deepest,
    truncated to num_spec_steps - 1 accepted nodes: (path of local nodes, bonus token)."""
    best = [0]
    for node in range(len(parents)):
        path = ancestors(parents, node)
        if path[0] != 0:
            continue
        ok = all(
            n == min((c for c in children(parents, p) if tokens[c] == target[p]), default=None)
            for p, n in zip(path, path[1:])
        )
        if ok and len(path) > len(best):
            best = path
    best = best[:num_spec_steps]
    return best, target[best[-1]]


def batch(parent_lists, vocab, seed=0, prefix_max=50):
    """Stack parent lists (same K) into tensors with random tokens and prefix lengths."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.tensor(parent_lists, dtype=torch.int64)
    bs, K = parents.shape
    tokens = torch.randint(0, vocab, (bs, K), generator=g)
    prefix_lens = torch.randint(0, prefix_max, (bs,), generator=g)
    return parents, tokens, prefix_lens


def greedy_targets(parents, tokens, vocab, rng: random.Random, follow=0.8):
    """Targets that follow a random child's token with probability `follow` (so paths get accepted)."""
    target = []
    for i in range(len(parents)):
        kids = children(parents, i)
        if kids and rng.random() < follow:
            target.append(tokens[rng.choice(kids)])
        else:
            target.append(rng.randrange(vocab))
    return target


def scalar_sampling(first, sibling, tokens, coins, final_coin, probs, num_spec_steps, thr_single=1.0, thr_acc=1.0):
    """One request of tree rejection sampling written as sgl-kernel's sequential loop, with numpy
    float32 for the acceptance arithmetic and a float64 inverse CDF for the bonus token.
    Returns (accepted local nodes incl. root, emitted tokens)."""
    import numpy as np

    f32 = np.float32
    K, V = probs.shape
    thr_acc = f32(max(thr_acc, 1e-9))
    coin, acc = f32(coins[0]), f32(0)
    last, path, emitted, rejected, examined = 0, [0], [], [], 0
    for _ in range(1, num_spec_steps):
        cur, accepted = first[last], False
        while cur != -1 and examined < K - 1:
            examined += 1
            tok = tokens[cur]
            q = f32(probs[last][tok]) if 0 <= tok < V else f32(0)
            acc = f32(acc + q)
            if coin < f32(acc / thr_acc) or q >= f32(thr_single):
                emitted.append(tok)
                path.append(cur)
                last, acc, coin, rejected, accepted = cur, f32(0), f32(coins[cur]), [], True
                break
            if 0 <= tok < V:
                rejected.append(tok)
            cur = sibling[cur]
        if not accepted:
            break
    r = np.array(probs[last], dtype=np.float64)
    r[rejected] = 0.0
    if r.sum() <= 0:
        r = np.array(probs[last], dtype=np.float64)
    cdf = np.cumsum(r)
    u = float(np.float32(final_coin)) * cdf[-1]
    pick = int(np.searchsorted(cdf, u, side="right"))
    if pick >= V:
        pick = int(np.nonzero(r > 0)[0][-1]) if (r > 0).any() else V - 1
    emitted.append(pick)
    return path, emitted
