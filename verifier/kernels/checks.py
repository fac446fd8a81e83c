"""Input validation at the Python boundary: ValueError with what was expected and what came.

The kernels trust their inputs (no per-call device synchronisation), so everything that can be
checked from shapes, dtypes, devices and strides is checked here. Value-level preconditions
(links and parents inside the tree, slots inside the cache) are documented on each function;
the kernels treat out-of-range links as "none" and skip out-of-range slots rather than fault.
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_NODES = 64  # K limit: ancestor sets are 64-bit masks in the kernels

_MASK_DTYPES = (torch.bool, torch.uint8)


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_tensor(name: str, t, *, ndim=None, shape=None, dtypes=None, device=None) -> None:
    require(isinstance(t, Tensor), f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        require(t.dim() == ndim, f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        want = tuple(shape)
        require(tuple(t.shape) == want, f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
        names = " or ".join(str(d) for d in dtypes)
        require(t.dtype in dtypes, f"{name}: expected dtype {names}, got {t.dtype}")
    if device is not None:
        require(t.device == device, f"{name}: expected device {device}, got {t.device}")
    require(t.is_contiguous(), f"{name}: expected a contiguous tensor (call .contiguous())")


def check_num_nodes(K: int) -> None:
    require(1 <= K <= MAX_NODES, f"K (nodes per request, root included) must be in [1, {MAX_NODES}], got {K}")


def check_tree_mask(tree_mask, prefix_lens) -> tuple[int, int]:
    check_tensor("tree_mask", tree_mask, ndim=3, dtypes=_MASK_DTYPES)
    bs, K, K2 = tree_mask.shape
    require(K == K2, f"tree_mask: expected [bs, K, K], got {tuple(tree_mask.shape)}")
    check_num_nodes(K)
    check_tensor("prefix_lens", prefix_lens, shape=(bs,), dtypes=torch.int64, device=tree_mask.device)
    return bs, K


def check_parents(parents, prefix_lens) -> tuple[int, int]:
    check_tensor("parents", parents, ndim=2, dtypes=torch.int64)
    bs, K = parents.shape
    check_num_nodes(K)
    check_tensor("prefix_lens", prefix_lens, shape=(bs,), dtypes=torch.int64, device=parents.device)
    return bs, K


def check_tree_links(candidates, retrive_index, next_token, next_sibling, num_spec_steps) -> tuple[int, int]:
    check_tensor("candidates", candidates, ndim=2, dtypes=torch.int64)
    bs, K = candidates.shape
    check_num_nodes(K)
    dev = candidates.device
    for name, t in (("retrive_index", retrive_index), ("retrive_next_token", next_token),
                    ("retrive_next_sibling", next_sibling)):
        check_tensor(name, t, shape=(bs, K), dtypes=torch.int64, device=dev)
    require(isinstance(num_spec_steps, int) and num_spec_steps >= 1,
            f"num_spec_steps must be an int >= 1, got {num_spec_steps!r}")
    return bs, K


def check_greedy(candidates, retrive_index, next_token, next_sibling, target_predict, num_spec_steps):
    bs, K = check_tree_links(candidates, retrive_index, next_token, next_sibling, num_spec_steps)
    check_tensor("target_predict", target_predict, shape=(bs, K), dtypes=torch.int64, device=candidates.device)
    return bs, K


def check_sampling(candidates, retrive_index, next_token, next_sibling, coins, final_coins,
                   target_probs, num_spec_steps, threshold_single, threshold_acc):
    bs, K = check_tree_links(candidates, retrive_index, next_token, next_sibling, num_spec_steps)
    dev = candidates.device
    check_tensor("target_probs", target_probs, ndim=3, dtypes=torch.float32, device=dev)
    require(tuple(target_probs.shape[:2]) == (bs, K),
            f"target_probs: expected [bs={bs}, K={K}, vocab], got {tuple(target_probs.shape)}")
    require(target_probs.shape[2] >= 1, "target_probs: vocab size must be >= 1")
    require(target_probs.shape[2] < 2**31, "target_probs: vocab size must fit in int32")
    check_tensor("coins", coins, shape=(bs, K), dtypes=torch.float32, device=dev)
    check_tensor("final_coins", final_coins, shape=(bs,), dtypes=torch.float32, device=dev)
    for name, v in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        require(isinstance(v, (int, float)) and 0.0 <= float(v) <= 1.0, f"{name} must be in [0, 1], got {v!r}")
    return bs, K


def check_sampling_logits(candidates, retrive_index, next_token, next_sibling, coins, final_coins,
                          logits, temperature, num_spec_steps, threshold_single, threshold_acc):
    bs, K = check_tree_links(candidates, retrive_index, next_token, next_sibling, num_spec_steps)
    dev = candidates.device
    check_tensor("logits", logits, ndim=3, dtypes=(torch.float32, torch.bfloat16, torch.float16), device=dev)
    require(tuple(logits.shape[:2]) == (bs, K), f"logits: expected [bs={bs}, K={K}, vocab], got {tuple(logits.shape)}")
    require(1 <= logits.shape[2] < 2**31, f"logits: vocab size must be in [1, 2^31), got {logits.shape[2]}")
    check_tensor("temperature", temperature, shape=(bs * K,), dtypes=torch.float32, device=dev)
    check_tensor("coins", coins, shape=(bs, K), dtypes=torch.float32, device=dev)
    check_tensor("final_coins", final_coins, shape=(bs,), dtypes=torch.float32, device=dev)
    for name, v in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        require(isinstance(v, (int, float)) and 0.0 <= float(v) <= 1.0, f"{name} must be in [0, 1], got {v!r}")
    return bs, K


def check_dense_mask(tree_mask, prefix_lens, kv_len) -> tuple[int, int]:
    bs, K = check_tree_mask(tree_mask, prefix_lens)
    require(isinstance(kv_len, int) and kv_len >= 1, f"kv_len must be an int >= 1, got {kv_len!r}")
    return bs, K


def check_compaction(kv_cache, draft_slots, accept_index, accept_token_num) -> tuple[int, int, int]:
    require(isinstance(kv_cache, Tensor), f"kv_cache: expected a torch.Tensor, got {type(kv_cache).__name__}")
    require(kv_cache.dim() >= 3, f"kv_cache: expected [num_caches, num_slots, ...], got shape {tuple(kv_cache.shape)}")
    check_tensor("kv_cache", kv_cache)
    dev = kv_cache.device
    check_tensor("draft_slots", draft_slots, ndim=2, dtypes=torch.int64, device=dev)
    bs, K = draft_slots.shape
    check_num_nodes(K)
    check_tensor("accept_index", accept_index, ndim=2, dtypes=torch.int32, device=dev)
    require(accept_index.shape[0] == bs, f"accept_index: expected {bs} rows, got {tuple(accept_index.shape)}")
    require(accept_index.shape[1] >= 1, "accept_index: expected at least one column (the root)")
    check_tensor("accept_token_num", accept_token_num, shape=(bs,), dtypes=torch.int32, device=dev)
    return bs, K, accept_index.shape[1]


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_kv_cache(kv_cache, layer) -> tuple[int, int]:
    """kv_cache [2 * layers, rows, Hkv, D] (verifier.model.kv_cache); returns (Hkv, D)."""
    check_tensor("kv_cache", kv_cache, ndim=4, dtypes=_FLOAT_DTYPES)
    require(kv_cache.shape[0] % 2 == 0, f"kv_cache: expected 2 * layers entries, got {kv_cache.shape[0]}")
    require(isinstance(layer, int) and 0 <= 2 * layer < kv_cache.shape[0],
            f"layer must be an int in [0, {kv_cache.shape[0] // 2}), got {layer!r}")
    return kv_cache.shape[2], kv_cache.shape[3]


def check_rope_store(qkv, positions, cos, sin, kv_cache, layer, rows, num_heads, num_kv_heads) -> None:
    Hkv, D = check_kv_cache(kv_cache, layer)
    dev, dtype = kv_cache.device, kv_cache.dtype
    require(num_kv_heads == Hkv, f"num_kv_heads: the cache has {Hkv} kv heads, got {num_kv_heads}")
    require(isinstance(num_heads, int) and num_heads >= 1 and num_heads % Hkv == 0,
            f"num_heads must be a multiple of num_kv_heads ({Hkv}), got {num_heads!r}")
    require(D % 2 == 0, f"head_dim must be even for RoPE, got {D}")
    check_tensor("positions", positions, dtypes=torch.int64, device=dev)
    n = positions.numel()
    check_tensor("rows", rows, dtypes=torch.int64, device=dev)
    require(rows.numel() == n, f"rows: expected {n} cache rows (one per token), got {rows.numel()}")
    check_tensor("qkv", qkv, dtypes=dtype, device=dev)
    require(qkv.numel() == n * (num_heads + 2 * Hkv) * D,
            f"qkv: expected {n} tokens x {(num_heads + 2 * Hkv) * D} values, got shape {tuple(qkv.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=2, dtypes=dtype, device=dev)
        require(t.shape[1] == D, f"{name}: expected [max_len, {D}], got {tuple(t.shape)}")


def check_decode_attention(q, kv_cache, layer, slots, max_len, mask, kv_lens=None) -> None:
    Hkv, D = check_kv_cache(kv_cache, layer)
    dev = kv_cache.device
    check_tensor("q", q, ndim=4, dtypes=kv_cache.dtype, device=dev)
    bs, T, H, Dq = q.shape
    require(Dq == D and H % Hkv == 0, f"q: expected [bs, T, a multiple of {Hkv} heads, {D}], got {tuple(q.shape)}")
    require(1 <= T <= MAX_NODES, f"q: expected 1..{MAX_NODES} tokens per request, got {T}")
    check_tensor("slots", slots, shape=(bs,), dtypes=torch.int64, device=dev)
    check_tensor("mask", mask, ndim=3, dtypes=_MASK_DTYPES, device=dev)
    require(tuple(mask.shape[:2]) == (bs, T), f"mask: expected [{bs}, {T}, kv_len], got {tuple(mask.shape)}")
    require(isinstance(max_len, int) and max_len >= 1 and kv_cache.shape[1] % max_len == 0,
            f"max_len: expected the cache's rows per slot, got {max_len!r}")
    require(1 <= mask.shape[2] <= max_len, f"mask: kv_len must be in [1, max_len={max_len}], got {mask.shape[2]}")
    if kv_lens is not None:
        check_tensor("kv_lens", kv_lens, shape=(bs,), dtypes=torch.int64, device=dev)
        require(kv_lens.is_contiguous(), "kv_lens: expected a contiguous tensor")


NORM_LINEAR_MAX_ROWS = 32  # rows (tokens) per call of the native norm_linear


def check_norm_linear(x, weight, bias, residual, norm_weight, eps, silu) -> None:
    check_tensor("weight", weight, ndim=2)
    N_w, K = weight.shape
    dev, dtype = weight.device, weight.dtype
    check_tensor("x", x, dtypes=dtype, device=dev)
    require(x.dim() >= 1 and x.shape[-1] == K, f"x: expected [..., {K}] (the weight's in_features), got {tuple(x.shape)}")
    require(x.is_contiguous(), "x: expected a contiguous tensor")
    require(isinstance(silu, bool), f"silu must be a bool, got {silu!r}")
    if silu:
        require(N_w % 2 == 0, f"weight: silu needs gate and up rows (an even count), got {N_w}")
        require(bias is None, "silu: a bias is not supported (SwiGLU projections have none)")
    if bias is not None:
        check_tensor("bias", bias, shape=(N_w,), dtypes=dtype, device=dev)
    if residual is not None:
        check_tensor("residual", residual, shape=tuple(x.shape), dtypes=dtype, device=dev)
        require(residual.is_contiguous(), "residual: expected a contiguous tensor")
        require(norm_weight is not None, "residual: the add is the norm's prologue, so norm_weight is required")
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, shape=(K,), dtypes=dtype, device=dev)
        require(isinstance(eps, float) and eps > 0, f"eps must be a float > 0, got {eps!r}")


def norm_linear_native_ok(x, weight, silu: bool, norm: bool = False) -> str | None:
    """Why the CUDA norm_linear cannot take these shapes (None: it can); ``norm``: with a prologue."""
    N_w, K = weight.shape
    N = N_w // 2 if silu else N_w
    M = x.numel() // K
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {x.dtype} (float16 or bfloat16 only)"
    if not 1 <= M <= NORM_LINEAR_MAX_ROWS:
        return f"{M} rows (1..{NORM_LINEAR_MAX_ROWS})"
    if norm and x.dtype != torch.bfloat16:
        return "a norm needs bfloat16 (the unnormalised operand could overflow float16)"
    if K % 32 or N % 8:
        return f"in_features {K} (a multiple of 32) / out_features {N} (a multiple of 8)"
    if not weight.is_contiguous() or any(t.data_ptr() % 16 for t in (x, weight)):
        return "tensors must be contiguous and 16-byte aligned"
    return None


def check_argmax_rows(logits) -> None:
    check_tensor("logits", logits, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    require(logits.dim() >= 1 and logits.shape[-1] >= 1, f"logits: expected [..., V >= 1], got {tuple(logits.shape)}")
    require(logits.is_contiguous(), "logits: expected a contiguous tensor")


def check_silu_mul(gate_up) -> None:
    check_tensor("gate_up", gate_up, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    require(gate_up.dim() >= 1 and gate_up.shape[-1] >= 2 and gate_up.shape[-1] % 2 == 0,
            f"gate_up: expected [..., 2 I] with I >= 1 (gate, then up), got {tuple(gate_up.shape)}")


def check_floor_logits(logits, temperature):
    check_tensor("logits", logits, ndim=2, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    require(logits.shape[1] >= 1, "logits: vocab size must be >= 1")
    check_tensor("temperature", temperature, shape=(logits.shape[0],), dtypes=torch.float32, device=logits.device)


def check_truncation(rows, vocab, device, top_k, top_p):
    """top_k and top_p: None or [rows] float32 on the logits' device (a vocabulary below 2^23: the
    floor kernel's fixed-point masses)."""
    if top_k is not None or top_p is not None:
        require(vocab < 2**23, f"top_k / top_p: a vocabulary below 2^23 tokens, got {vocab}")
    for name, t in (("top_k", top_k), ("top_p", top_p)):
        if t is not None:
            check_tensor(name, t, shape=(rows,), dtypes=torch.float32, device=device)
