"""Pure-torch reference of the verifier kernels: the oracle for the CUDA kernels and the CPU path.

Conventions are sgl-kernel's (see verifier/kernels/csrc/*.cu for the same text next to the
kernels). A batch has ``bs`` requests of ``K`` tree nodes each; node 0 is the root (the last
committed token), nodes are in topological order (parents before children), and node ``i`` of
request ``b`` has the flat index ``b*K + i``. ``prefix_lens[b]`` counts the tokens already in the
KV cache, so the root sits at position ``prefix_lens[b]``.

Everything here is batched tensor code with fixed trip counts (no per-request Python loop and no
host synchronisation except where a data-dependent output size forces one), so it runs on CPU or
GPU tensors and under ``torch.compile``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .sampling import truncation_floor


class TreeIndices(NamedTuple):
    positions: Tensor  # [bs*K] int64: prefix_len + depth
    retrive_index: Tensor  # [bs, K] int64: b*K + i
    retrive_next_token: Tensor  # [bs, K] int64: first child, -1 = none
    retrive_next_sibling: Tensor  # [bs, K] int64: next child of the same parent, -1 = none


class VerifyResult(NamedTuple):
    predicts: Tensor  # [bs*K] int32: token following each accepted node, -1 elsewhere
    accept_index: Tensor  # [bs, num_spec_steps] int32: flat indices of root + accepted, -1 pad
    accept_token_num: Tensor  # [bs] int32: number of accepted draft tokens (root excluded)


# --- tree structure -------------------------------------------------------------------------


def flatten_draft_tree(last_tokens: Tensor, draft_tokens: Tensor, draft_parents: Tensor):
    """(tokens, parents) of B draft nodes -> SGLang's flattened K = B + 1 form.

    ``draft_parents[b, j]`` is -1 for a child of the root, ``p`` in [0, j) for a child of draft
    node p, and anything below -1 for a padding slot (the node becomes isolated: it sees only the
    prefix and itself and is never verified). Returns tokens [bs, K] and parents [bs, K], where
    the root's parent and padding parents are -1.
    """
    tokens = torch.cat([last_tokens.reshape(-1, 1), draft_tokens], dim=1).to(torch.int64)
    p = draft_parents.to(torch.int64)
    parents = torch.where(p >= -1, p + 1, torch.zeros_like(p))
    parents = torch.where(p < -1, torch.full_like(p, -1), parents)
    root = torch.full((parents.shape[0], 1), -1, dtype=torch.int64, device=parents.device)  # also for B = 0
    return tokens, torch.cat([root, parents], dim=1)


def _valid_parents(parents: Tensor) -> Tensor:
    """A parent outside [0, i) makes node i parentless (root, padding or malformed)."""
    K = parents.shape[1]
    idx = torch.arange(K, device=parents.device)
    ok = (parents >= 0) & (parents < idx)
    return torch.where(ok, parents, torch.full_like(parents, -1))


def tree_mask_from_parents(parents: Tensor) -> Tensor:
    """[bs, K] parent indices -> [bs, K, K] ancestor-or-self mask (mask[b, i, j]: j is i or an ancestor)."""
    bs, K = parents.shape
    parents = _valid_parents(parents.to(torch.int64))
    eye = torch.eye(K, dtype=torch.bool, device=parents.device)
    mask = eye.expand(bs, K, K).clone()
    rows = torch.arange(bs, device=parents.device)
    for i in range(1, K):  # parents come first, so row parent(i) is final when row i is built
        p = parents[:, i]
        inherited = mask[rows, p.clamp(min=0)] & (p >= 0)[:, None]
        mask[:, i] = inherited | eye[i]
    return mask


def parents_from_mask(tree_mask: Tensor) -> Tensor:
    """Nearest marked ancestor: the largest j < i with mask[i][j] set, else -1."""
    K = tree_mask.shape[-1]
    idx = torch.arange(K, device=tree_mask.device)
    strict = tree_mask.bool() & (idx[None, :] < idx[:, None])
    return torch.where(strict, idx, torch.full_like(idx, -1)).amax(-1)


def _links(parents: Tensor, depth: Tensor, prefix_lens: Tensor) -> TreeIndices:
    bs, K = parents.shape
    dev = parents.device
    idx = torch.arange(K, device=dev)
    later = idx[None, :] > idx[:, None]  # [i, j]: j > i
    none = torch.full((), K, device=dev, dtype=torch.int64)
    is_child = (parents[:, None, :] == idx[None, :, None]) & later  # [b, i, j]: parent(j) == i
    first_child = torch.where(is_child, idx, none).amin(-1)
    same_parent = (parents[:, None, :] == parents[:, :, None]) & (parents >= 0)[:, :, None] & later
    sibling = torch.where(same_parent, idx, none).amin(-1)
    minus_one = torch.full_like(first_child, -1)
    return TreeIndices(
        positions=(prefix_lens.to(torch.int64)[:, None] + depth).reshape(-1),
        retrive_index=(torch.arange(bs, device=dev)[:, None] * K + idx).to(torch.int64),
        retrive_next_token=torch.where(first_child == K, minus_one, first_child),
        retrive_next_sibling=torch.where(sibling == K, minus_one, sibling),
    )


def tree_indices_from_mask(tree_mask: Tensor, prefix_lens: Tensor) -> TreeIndices:
    """sgl-kernel's reconstruct_indices_from_tree_mask for [bs, K, K] masks."""
    K = tree_mask.shape[-1]
    idx = torch.arange(K, device=tree_mask.device)
    strict = tree_mask.bool() & (idx[None, :] < idx[:, None])
    return _links(parents_from_mask(tree_mask), strict.sum(-1), prefix_lens)


def tree_indices_from_parents(parents: Tensor, prefix_lens: Tensor) -> tuple[Tensor, TreeIndices]:
    """[bs, K] flattened parents -> (ancestor mask [bs, K, K], TreeIndices)."""
    mask = tree_mask_from_parents(parents)
    depth = mask.sum(-1) - 1
    return mask, _links(_valid_parents(parents.to(torch.int64)), depth, prefix_lens)


# --- verification -----------------------------------------------------------------------------


def _node_links(links: Tensor, K: int) -> Tensor:
    return torch.where((links >= 0) & (links < K), links, torch.full_like(links, -1))


def _finish(candidates, retrive_index, accepted_nodes, num_accepted, last, bonus) -> VerifyResult:
    """Turn the walk's accepted local nodes into sgl-kernel's outputs (scatter, no sync)."""
    bs, K = candidates.shape
    rows = torch.arange(bs, device=candidates.device)
    safe = accepted_nodes.clamp(min=0)
    accept_index = torch.where(accepted_nodes >= 0, retrive_index.gather(1, safe), -1)
    predicts = torch.full((bs * K + 1,), -1, dtype=torch.int64, device=candidates.device)
    dump = bs * K  # invalid writes land in this extra slot, sliced off below
    nxt = accepted_nodes[:, 1:]
    dst = torch.where(nxt >= 0, accept_index[:, :-1], dump)
    predicts.scatter_(0, dst.reshape(-1), candidates.gather(1, nxt.clamp(min=0)).reshape(-1))
    predicts.scatter_(0, retrive_index[rows, last], bonus.to(torch.int64))
    return VerifyResult(
        predicts[:-1].to(torch.int32), accept_index.to(torch.int32), num_accepted.to(torch.int32)
    )


def verify_tree_greedy(
    candidates: Tensor,
    retrive_index: Tensor,
    retrive_next_token: Tensor,
    retrive_next_sibling: Tensor,
    target_predict: Tensor,
    num_spec_steps: int,
) -> VerifyResult:
    """sgl-kernel's verify_tree_greedy: follow the first child whose token is the target argmax.

    The walk examines at most K - 1 nodes (one event per loop iteration, all requests at once).
    """
    bs, K = candidates.shape
    S = num_spec_steps
    dev = candidates.device
    rows = torch.arange(bs, device=dev)
    nxt, sib = _node_links(retrive_next_token, K), _node_links(retrive_next_sibling, K)
    target_at = target_predict.reshape(-1)[retrive_index]  # target token after node i
    last = torch.zeros(bs, dtype=torch.int64, device=dev)
    num_accepted = torch.zeros_like(last)
    accepted = torch.full((bs, S), -1, dtype=torch.int64, device=dev)
    accepted[:, 0] = 0
    cand = nxt[:, 0]
    done = (cand < 0) | (S <= 1)
    for _ in range(K - 1):
        active = ~done
        node = cand.clamp(min=0)
        ok = active & (candidates[rows, node] == target_at[rows, last])
        num_accepted = num_accepted + ok.long()
        slot = num_accepted.clamp(max=S - 1)
        accepted[rows, slot] = torch.where(ok, node, accepted[rows, slot])
        last = torch.where(ok, node, last)
        cand = torch.where(ok, nxt[rows, node], torch.where(active, sib[rows, node], cand))
        done = done | (ok & (num_accepted >= S - 1)) | (active & (cand < 0))
    return _finish(candidates, retrive_index, accepted, num_accepted, last, target_at[rows, last])


def tree_speculative_sampling(
    candidates: Tensor,
    retrive_index: Tensor,
    retrive_next_token: Tensor,
    retrive_next_sibling: Tensor,
    coins: Tensor,
    final_coins: Tensor,
    target_probs: Tensor,
    num_spec_steps: int,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> VerifyResult:
    """Tree rejection sampling for one-hot drafts (sgl-kernel's tree_speculative_sampling_target_only).

    At the last accepted node (target distribution q, coin u = coins[b, node]) its children c_k
    are tried in sibling order; c_k is accepted iff u < (q(c_1)+..+q(c_k)) / threshold_acc or
    q(c_k) >= threshold_single. With both thresholds 1 this is sequential rejection sampling, so
    the output is distributed exactly as the target. The bonus token is the first v with
    cumsum(r)[v] > final_coin * sum(r), where r is q with the rejected children's tokens zeroed
    (q itself if that leaves no mass). Acceptance is computed in float32 in the kernel's order, so
    it is bit-identical to the kernel; the bonus draw uses a float64 cumsum here and a float32
    chunked scan in the kernel, which can differ only when the coin is within rounding of a CDF
    boundary.
    """
    bs, K = candidates.shape
    V = target_probs.shape[-1]
    S = num_spec_steps
    dev = candidates.device
    rows = torch.arange(bs, device=dev)
    q_rows = target_probs.reshape(bs * K, V).float()
    coins = coins.reshape(bs, K).float()
    thr_acc = torch.tensor(max(float(threshold_acc), 1e-9), dtype=torch.float32, device=dev)
    thr_single = torch.tensor(float(threshold_single), dtype=torch.float32, device=dev)
    nxt, sib = _node_links(retrive_next_token, K), _node_links(retrive_next_sibling, K)
    idx = torch.arange(K, device=dev)
    last = torch.zeros(bs, dtype=torch.int64, device=dev)
    num_accepted = torch.zeros_like(last)
    accepted = torch.full((bs, S), -1, dtype=torch.int64, device=dev)
    accepted[:, 0] = 0
    cand = nxt[:, 0]
    done = (cand < 0) | (S <= 1)
    prob_acc = torch.zeros(bs, dtype=torch.float32, device=dev)
    coin = coins[:, 0]
    rejected = torch.zeros(bs, K, dtype=torch.bool, device=dev)  # children of `last` rejected
    for _ in range(K - 1):
        active = ~done
        node = cand.clamp(min=0)
        tok = candidates[rows, node]
        in_vocab = (tok >= 0) & (tok < V)
        q = torch.where(in_vocab, q_rows[rows * K + last, tok.clamp(0, V - 1)], 0.0)
        acc = prob_acc + q
        ok = active & ((coin < acc / thr_acc) | (q >= thr_single))
        rej = active & ~ok
        num_accepted = num_accepted + ok.long()
        slot = num_accepted.clamp(max=S - 1)
        accepted[rows, slot] = torch.where(ok, node, accepted[rows, slot])
        last = torch.where(ok, node, last)
        prob_acc = torch.where(ok, 0.0, torch.where(rej, acc, prob_acc))
        coin = torch.where(ok, coins[rows, node], coin)
        rejected = (rejected & ~ok[:, None]) | ((idx == node[:, None]) & (rej & in_vocab)[:, None])
        cand = torch.where(ok, nxt[rows, node], torch.where(active, sib[rows, node], cand))
        done = done | (ok & (num_accepted >= S - 1)) | (active & (cand < 0))
    q_last = q_rows[rows * K + last].double()
    keep = torch.ones(bs, V + 1, dtype=torch.float64, device=dev)
    keep.scatter_(1, torch.where(rejected, candidates.clamp(0, V - 1), V), 0.0)
    residual = q_last * keep[:, :V]
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, q_last)
    cdf = residual.cumsum(-1)
    u = final_coins.reshape(bs).double() * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1)
    last_positive = V - 1 - (residual > 0).flip(-1).int().argmax(-1)
    bonus = torch.where(pick >= V, last_positive, pick)
    return _finish(candidates, retrive_index, accepted, num_accepted, last, bonus)


# --- attention metadata and KV compaction ------------------------------------------------------


def tree_sampling_logits(candidates: Tensor, retrive_index: Tensor, retrive_next_token: Tensor,
                         retrive_next_sibling: Tensor, coins: Tensor, final_coins: Tensor, logits: Tensor,
                         temperature: Tensor, num_spec_steps: int, threshold_single: float = 1.0,
                         threshold_acc: float = 1.0, *, top_k: Tensor | None = None,
                         top_p: Tensor | None = None) -> tuple[VerifyResult, Tensor]:
    """``tree_speculative_sampling`` from logits [bs, K, V] and a temperature per row [bs * K]
    (0: a greedy row, whose q is one-hot at its argmax): q = softmax(logits / temperature) in
    float32, truncated by top-k and top-p per row where given (``sampling.truncation_floor``). A
    row holding a NaN or an infinity counts as zeroed logits (uniform q; one-hot at token 0 when
    greedy) and is flagged. Returns (the verification, bad [bs, K] bool)."""
    bs, K, V = logits.shape
    flat = logits.reshape(bs * K, V).float()
    bad = ~torch.isfinite(flat).all(-1)
    flat = flat.masked_fill(bad[:, None], 0.0)
    greedy = temperature == 0
    scaled = flat / torch.where(greedy, 1.0, temperature)[:, None]
    if top_k is not None or top_p is not None:
        # (flat has a bad row zeroed: no floor for it, as the kernel, which sees the NaN, gives)
        floor = truncation_floor(flat, temperature, top_k, top_p).masked_fill(bad, float("-inf"))
        scaled = scaled.masked_fill(flat < floor[:, None], float("-inf"))
    probs = scaled.softmax(-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, flat.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    res = tree_speculative_sampling(candidates, retrive_index, retrive_next_token, retrive_next_sibling, coins,
                                    final_coins, probs.view(bs, K, V), num_spec_steps, threshold_single, threshold_acc)
    return res, bad.view(bs, K)


def tree_attention_mask(tree_mask: Tensor, prefix_lens: Tensor, kv_len: int) -> Tensor:
    """[bs, K, kv_len] bool: node i sees the prefix and its tree ancestors at prefix_len + j."""
    bs, K, _ = tree_mask.shape
    cols = torch.arange(kv_len, device=tree_mask.device)
    prefix = prefix_lens.to(torch.int64)[:, None]
    t = cols[None, :] - prefix  # tree column, [bs, kv_len]
    in_tree = (t >= 0) & (t < K)
    gathered = tree_mask.bool().gather(2, t.clamp(0, K - 1)[:, None, :].expand(bs, K, kv_len))
    return (cols[None, :] < prefix)[:, None, :] | (gathered & in_tree[:, None, :])


def tree_attention_mask_flat(tree_mask: Tensor, prefix_lens: Tensor) -> tuple[Tensor, Tensor]:
    """SGLang/FlashInfer custom_mask: per request K rows of prefix_len + K columns, concatenated.

    Returns (flat mask [sum K*(prefix_len+K)] bool, mask_indptr [bs+1] int64). Synchronises (the
    output size depends on prefix_lens).
    """
    K = tree_mask.shape[-1]
    widths = prefix_lens.to(torch.int64) + K
    indptr = torch.zeros(widths.numel() + 1, dtype=torch.int64, device=tree_mask.device)
    indptr[1:] = torch.cumsum(widths * K, 0)
    if widths.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=tree_mask.device), indptr
    dense = tree_attention_mask(tree_mask, prefix_lens, int(widths.max()))
    cols = torch.arange(dense.shape[-1], device=tree_mask.device)
    valid = (cols[None, :] < widths[:, None])[:, None, :].expand_as(dense)
    return dense[valid], indptr


def compact_kv_cache(
    kv_cache: Tensor, draft_slots: Tensor, accept_index: Tensor, accept_token_num: Tensor
) -> None:
    """In place: for t = 1..n_b, slot draft_slots[b, t] <- slot draft_slots[b, accept_index[b, t] - b*K].

    kv_cache is [num_caches, num_slots, ...]. Steps run in increasing t: node_t >= t, so a source
    is never a slot that an earlier step wrote (see kv_compact.cu for the hazard argument).
    Slots must be valid and distinct across requests (the kernel also skips out-of-range ones).
    """
    bs, K = draft_slots.shape
    S = accept_index.shape[1]
    dev = draft_slots.device
    rows = torch.arange(bs, device=dev)
    n = accept_token_num.to(torch.int64).clamp(max=min(S, K) - 1)
    for t in range(1, min(S, K)):
        node = accept_index[:, t].to(torch.int64) - rows * K
        dst = draft_slots[:, t].to(torch.int64)
        src = draft_slots[rows, node.clamp(0, K - 1)].to(torch.int64)
        ok = (t <= n) & (node != t) & (node >= 0) & (node < K)
        # Requests with nothing to move copy their own slot t onto itself (slots are disjoint
        # between requests, so no other write in this step touches it): no sync, no masking.
        kv_cache[:, dst] = kv_cache[:, torch.where(ok, src, dst)]


def rope_store_kv(qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, layer: int,
                  rows: Tensor, num_heads: int, num_kv_heads: int) -> Tensor:
    """RoPE ("rotate half", in float32, rounded once) on q and k of the fused projection ``qkv``
    [tokens, (H + 2 Hkv) * D]; k and v go to cache rows ``rows`` of ``layer``. Returns q [tokens, H, D]."""
    H, Hkv = num_heads, num_kv_heads
    n, D = positions.numel(), cos.shape[1]
    x = qkv.reshape(n, H + 2 * Hkv, D)
    c = cos[positions.reshape(-1)].float()[:, None]
    s = sin[positions.reshape(-1)].float()[:, None]
    qk = x[:, :H + Hkv].float()
    half = D // 2
    qk = (qk * c + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * s).to(qkv.dtype)
    flat = rows.reshape(-1)
    kv_cache[2 * layer, flat] = qk[:, H:]
    kv_cache[2 * layer + 1, flat] = x[:, H + Hkv:]
    return qk[:, :H]


def decode_attention(q: Tensor, kv_cache: Tensor, layer: int, slots: Tensor, max_len: int, mask: Tensor,
                     scale: float, kv_lens: Tensor | None = None) -> Tensor:
    """Masked attention of q [bs, T, H, D] over cache rows 0 .. L-1 of each request's slot
    (mask [bs, T, L], True = attend; grouped-query heads share kv head h // (H / Hkv)), in float32;
    rows at or past kv_lens[b] (if given) masked too. A row that sees no key gets zeros. Returns
    [bs, T, H, D] in q's dtype."""
    bs, T, H, D = q.shape
    L, Hkv = mask.shape[2], kv_cache.shape[2]
    if kv_lens is not None:
        mask = mask.bool() & (torch.arange(L, device=q.device) < kv_lens.to(q.device)[:, None])[:, None]
    rows = slots.to(torch.int64)[:, None] * max_len + torch.arange(L, device=q.device)
    k = kv_cache[2 * layer][rows].float().repeat_interleave(H // Hkv, dim=2)  # [bs, L, H, D]
    v = kv_cache[2 * layer + 1][rows].float().repeat_interleave(H // Hkv, dim=2)
    scores = torch.einsum("bthd,blhd->bhtl", q.float(), k) * scale
    scores = scores.masked_fill(~mask.bool()[:, None], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: 0/0
    return torch.einsum("bhtl,blhd->bthd", p, v).to(q.dtype)


def norm_linear(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, norm_weight: Tensor | None,
                eps: float, silu: bool) -> tuple[Tensor, Tensor | None]:
    """``epilogue(prologue(x) @ weight.T + bias)`` with eager torch's rounding (verifier.model.fusion):
    prologue: s = residual + x (if residual), then norm_weight * rms_norm(s) (if norm_weight);
    epilogue: silu(gate) * up over weight's gate rows, then up rows (if silu).
    Returns (y, s): s is the residual stream after the add, or None without a residual."""
    s = x if residual is None else residual + x
    a = s
    if norm_weight is not None:
        a = norm_weight * torch.nn.functional.rms_norm(s.float(), (s.shape[-1],), eps=eps).to(s.dtype)
    y = torch.nn.functional.linear(a, weight, bias)
    if silu:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y, (s if residual is not None else None)


def argmax_rows(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(argmax [...] int64, bad [...] bool) of logits [..., V]: a row holding a NaN or an infinity
    is zeroed in place and flagged, and its argmax is 0 (the first maximum of a zero row)."""
    from .numerics import nonfinite_rows

    bad = nonfinite_rows(logits)
    return logits.argmax(-1), bad


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of gate_up [..., 2 I] (gate first), in float32, rounded once to its dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)
