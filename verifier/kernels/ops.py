"""The native kernels as torch custom ops (``torch.ops.ngram_verifier.*``).

Each op allocates its outputs with torch (so they come from the graph pool under CUDA graph
capture) and launches on ``torch.cuda.current_stream()`` through ctypes; a fake implementation
gives the output shapes to torch.compile. The ops trust their inputs: validate with
``verifier.kernels.checks`` first (the public functions in ``verifier.kernels`` do).
"""

import math

import torch
from torch import Tensor

from .native import library

_NS = "ngram_verifier"


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


def _index_outputs(like: Tensor, bs: int, K: int):
    i64 = dict(dtype=torch.int64, device=like.device)
    return (torch.empty(bs * K, **i64), torch.empty(bs, K, **i64),
            torch.empty(bs, K, **i64), torch.empty(bs, K, **i64))


def _verify_outputs(like: Tensor, bs: int, K: int, S: int):
    i32 = dict(dtype=torch.int32, device=like.device)
    return torch.empty(bs * K, **i32), torch.empty(bs, S, **i32), torch.empty(bs, **i32)


@torch.library.custom_op(f"{_NS}::tree_indices_from_mask", mutates_args=())
def tree_indices_from_mask(tree_mask: Tensor, prefix_lens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    bs, K = tree_mask.shape[0], tree_mask.shape[1]
    out = _index_outputs(tree_mask, bs, K)
    with torch.cuda.device(tree_mask.device):
        library().call("ngk_tree_indices_from_mask", _ptr(tree_mask), _ptr(prefix_lens),
                       *map(_ptr, out), bs, K, _stream(tree_mask))
    return out


@tree_indices_from_mask.register_fake
def _(tree_mask, prefix_lens):
    return _index_outputs(tree_mask, tree_mask.shape[0], tree_mask.shape[1])


@torch.library.custom_op(f"{_NS}::tree_indices_from_parents", mutates_args=())
def tree_indices_from_parents(parents: Tensor, prefix_lens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    bs, K = parents.shape
    mask = torch.empty(bs, K, K, dtype=torch.bool, device=parents.device)
    out = _index_outputs(parents, bs, K)
    with torch.cuda.device(parents.device):
        library().call("ngk_tree_indices_from_parents", _ptr(parents), _ptr(prefix_lens), _ptr(mask),
                       *map(_ptr, out), bs, K, _stream(parents))
    return (mask, *out)


@tree_indices_from_parents.register_fake
def _(parents, prefix_lens):
    bs, K = parents.shape
    return (parents.new_empty(bs, K, K, dtype=torch.bool), *_index_outputs(parents, bs, K))


@torch.library.custom_op(f"{_NS}::verify_tree_greedy", mutates_args=())
def verify_tree_greedy(candidates: Tensor, retrive_index: Tensor, retrive_next_token: Tensor,
                       retrive_next_sibling: Tensor, target_predict: Tensor,
                       num_spec_steps: int) -> tuple[Tensor, Tensor, Tensor]:
    bs, K = candidates.shape
    out = _verify_outputs(candidates, bs, K, num_spec_steps)
    with torch.cuda.device(candidates.device):
        library().call("ngk_verify_tree_greedy", *map(_ptr, out), _ptr(candidates), _ptr(retrive_index),
                       _ptr(retrive_next_token), _ptr(retrive_next_sibling), _ptr(target_predict),
                       bs, K, num_spec_steps, _stream(candidates))
    return out


@verify_tree_greedy.register_fake
def _(candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict, num_spec_steps):
    return _verify_outputs(candidates, *candidates.shape, num_spec_steps)


@torch.library.custom_op(f"{_NS}::tree_speculative_sampling", mutates_args=())
def tree_speculative_sampling(candidates: Tensor, retrive_index: Tensor, retrive_next_token: Tensor,
                              retrive_next_sibling: Tensor, coins: Tensor, final_coins: Tensor,
                              target_probs: Tensor, num_spec_steps: int, threshold_single: float,
                              threshold_acc: float) -> tuple[Tensor, Tensor, Tensor]:
    bs, K = candidates.shape
    out = _verify_outputs(candidates, bs, K, num_spec_steps)
    with torch.cuda.device(candidates.device):
        library().call("ngk_tree_speculative_sampling", *map(_ptr, out), _ptr(candidates),
                       _ptr(retrive_index), _ptr(retrive_next_token), _ptr(retrive_next_sibling),
                       _ptr(coins), _ptr(final_coins), _ptr(target_probs), bs, K, num_spec_steps,
                       target_probs.shape[2], float(threshold_single), float(threshold_acc),
                       _stream(candidates))
    return out


@tree_speculative_sampling.register_fake
def _(candidates, retrive_index, retrive_next_token, retrive_next_sibling, coins, final_coins,
      target_probs, num_spec_steps, threshold_single, threshold_acc):
    return _verify_outputs(candidates, *candidates.shape, num_spec_steps)


@torch.library.custom_op(f"{_NS}::logit_floor_rows", mutates_args=())
def logit_floor_rows(logits: Tensor, temperature: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    rows, V = logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    with torch.cuda.device(logits.device):
        library().call("ngk_logit_floor_rows", _DTYPE_CODES[logits.dtype], _ptr(logits), rows, V, _ptr(temperature),
                       0 if top_k is None else _ptr(top_k), 0 if top_p is None else _ptr(top_p), _ptr(out),
                       _stream(logits))
    return out


@logit_floor_rows.register_fake
def _(logits, temperature, top_k, top_p):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


@torch.library.custom_op(f"{_NS}::tree_sampling_logits", mutates_args=())
def tree_sampling_logits(candidates: Tensor, retrive_index: Tensor, retrive_next_token: Tensor,
                         retrive_next_sibling: Tensor, coins: Tensor, final_coins: Tensor, logits: Tensor,
                         temperature: Tensor, num_spec_steps: int, threshold_single: float,
                         threshold_acc: float, row_floor: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    bs, K = candidates.shape
    V = logits.shape[2]
    out = _verify_outputs(candidates, bs, K, num_spec_steps)
    f32 = dict(dtype=torch.float32, device=logits.device)
    row_max, row_inv_sum = torch.empty(bs * K, **f32), torch.empty(bs * K, **f32)
    row_argmax = torch.empty(bs * K, dtype=torch.int64, device=logits.device)
    row_bad = torch.empty(bs, K, dtype=torch.bool, device=logits.device)
    with torch.cuda.device(candidates.device):
        library().call("ngk_tree_sampling_logits", _DTYPE_CODES[logits.dtype], _ptr(logits), _ptr(temperature),
                       0 if row_floor is None else _ptr(row_floor), _ptr(row_max), _ptr(row_inv_sum), _ptr(row_argmax), _ptr(row_bad), *map(_ptr, out),
                       _ptr(candidates), _ptr(retrive_index), _ptr(retrive_next_token), _ptr(retrive_next_sibling),
                       _ptr(coins), _ptr(final_coins), bs, K, num_spec_steps, V, float(threshold_single),
                       float(threshold_acc), _stream(candidates))
    return (*out, row_bad)


@tree_sampling_logits.register_fake
def _(candidates, retrive_index, retrive_next_token, retrive_next_sibling, coins, final_coins, logits,
      temperature, num_spec_steps, threshold_single, threshold_acc, row_floor=None):
    bs, K = candidates.shape
    return (*_verify_outputs(candidates, bs, K, num_spec_steps), candidates.new_empty(bs, K, dtype=torch.bool))


@torch.library.custom_op(f"{_NS}::tree_attention_mask", mutates_args=())
def tree_attention_mask(tree_mask: Tensor, prefix_lens: Tensor, kv_len: int) -> Tensor:
    bs, K = tree_mask.shape[0], tree_mask.shape[1]
    out = torch.empty(bs, K, kv_len, dtype=torch.bool, device=tree_mask.device)
    with torch.cuda.device(tree_mask.device):
        library().call("ngk_tree_attention_mask_dense", _ptr(tree_mask), _ptr(prefix_lens), _ptr(out),
                       bs, K, kv_len, _stream(tree_mask))
    return out


@tree_attention_mask.register_fake
def _(tree_mask, prefix_lens, kv_len):
    return tree_mask.new_empty(tree_mask.shape[0], tree_mask.shape[1], kv_len, dtype=torch.bool)


@torch.library.custom_op(f"{_NS}::tree_attention_mask_flat", mutates_args=())
def tree_attention_mask_flat(tree_mask: Tensor, prefix_lens: Tensor, mask_indptr: Tensor, total_len: int) -> Tensor:
    bs, K = tree_mask.shape[0], tree_mask.shape[1]
    out = torch.empty(total_len, dtype=torch.bool, device=tree_mask.device)
    with torch.cuda.device(tree_mask.device):
        library().call("ngk_tree_attention_mask_flat", _ptr(tree_mask), _ptr(prefix_lens), _ptr(mask_indptr),
                       _ptr(out), bs, K, _stream(tree_mask))
    return out


@tree_attention_mask_flat.register_fake
def _(tree_mask, prefix_lens, mask_indptr, total_len):
    return tree_mask.new_empty(total_len, dtype=torch.bool)


@torch.library.custom_op(f"{_NS}::compact_kv_cache", mutates_args=("kv_cache",))
def compact_kv_cache(kv_cache: Tensor, draft_slots: Tensor, accept_index: Tensor, accept_token_num: Tensor) -> None:
    bs, K = draft_slots.shape
    num_caches, num_slots = kv_cache.shape[0], kv_cache.shape[1]
    row_bytes = math.prod(kv_cache.shape[2:]) * kv_cache.element_size()
    with torch.cuda.device(kv_cache.device):
        library().call("ngk_compact_kv_cache", _ptr(kv_cache), _ptr(draft_slots), _ptr(accept_index),
                       _ptr(accept_token_num), bs, K, accept_index.shape[1], num_caches, num_slots,
                       row_bytes, _stream(kv_cache))


@compact_kv_cache.register_fake
def _(kv_cache, draft_slots, accept_index, accept_token_num):
    return None


# dtype codes of csrc/dtypes.cuh
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def attention_splits(head_dim: int, kv_len: int) -> int:
    """Cache-row spans of decode_attention.cu (64 rows for head_dim 64, 32 for 128)."""
    span = 64 if head_dim == 64 else 32
    return -(-kv_len // span)


@torch.library.custom_op(f"{_NS}::rope_store_kv", mutates_args=("kv_cache",))
def rope_store_kv(qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, layer: int,
                  rows: Tensor, num_heads: int, num_kv_heads: int) -> Tensor:
    n, D = positions.numel(), cos.shape[1]
    q = torch.empty(n, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    with torch.cuda.device(qkv.device):
        library().call("ngk_rope_store_kv", _DTYPE_CODES[qkv.dtype], _ptr(qkv), _ptr(positions), _ptr(cos),
                       _ptr(sin), _ptr(rows), _ptr(q), _ptr(kv_cache[2 * layer]), _ptr(kv_cache[2 * layer + 1]),
                       n, num_heads, num_kv_heads, D, _stream(qkv))
    return q


@rope_store_kv.register_fake
def _(qkv, positions, cos, sin, kv_cache, layer, rows, num_heads, num_kv_heads):
    return qkv.new_empty(positions.numel(), num_heads, cos.shape[1])


@torch.library.custom_op(f"{_NS}::decode_attention", mutates_args=())
def decode_attention(q: Tensor, kv_cache: Tensor, layer: int, slots: Tensor, max_len: int, mask: Tensor,
                     scale: float, arrivals: Tensor | None, kv_lens: Tensor | None) -> Tensor:
    # ``arrivals`` is scratch the kernel leaves as it found it (zeros), so the op is declared pure.
    bs, T, H, D = q.shape
    L = mask.shape[2]
    part = torch.empty(bs * T * H * attention_splits(D, L) * (D + 2), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    with torch.cuda.device(q.device):
        library().call("ngk_decode_attention", _DTYPE_CODES[q.dtype], _ptr(q), _ptr(kv_cache[2 * layer]),
                       _ptr(kv_cache[2 * layer + 1]), _ptr(slots), max_len, _ptr(mask),
                       0 if kv_lens is None else _ptr(kv_lens), _ptr(part), _ptr(out),
                       0 if arrivals is None else _ptr(arrivals), 0 if arrivals is None else arrivals.numel(),
                       bs, T, H, kv_cache.shape[2], D, L, float(scale), _stream(q))
    return out


@decode_attention.register_fake
def _(q, kv_cache, layer, slots, max_len, mask, scale, arrivals, kv_lens):
    return torch.empty_like(q)


def _norm_linear_shapes(x: Tensor, weight: Tensor, silu: bool) -> tuple[int, int, int]:
    K = weight.shape[1]
    return x.numel() // K, weight.shape[0] // 2 if silu else weight.shape[0], K


@torch.library.custom_op(f"{_NS}::norm_linear", mutates_args=())
def norm_linear(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, norm_weight: Tensor | None,
                eps: float, silu: bool) -> tuple[Tensor, Tensor]:
    M, N, K = _norm_linear_shapes(x, weight, silu)
    y = x.new_empty(*x.shape[:-1], N)
    s = torch.empty_like(x) if residual is not None else x.new_empty(0)
    prologue = 0 if norm_weight is None else 1 if residual is None else 2
    with torch.cuda.device(x.device):
        library().call("ngk_norm_linear", _DTYPE_CODES[x.dtype], prologue, int(silu), _ptr(x),
                       0 if residual is None else _ptr(residual), _ptr(s) if residual is not None else 0,
                       0 if norm_weight is None else _ptr(norm_weight), float(eps), _ptr(weight),
                       0 if bias is None else _ptr(bias), _ptr(y), M, N, K, _stream(x))
    return y, s


@norm_linear.register_fake
def _(x, weight, bias, residual, norm_weight, eps, silu):
    N = weight.shape[0] // 2 if silu else weight.shape[0]
    return x.new_empty(*x.shape[:-1], N), torch.empty_like(x) if residual is not None else x.new_empty(0)


@torch.library.custom_op(f"{_NS}::argmax_rows", mutates_args=("logits",))
def argmax_rows(logits: Tensor) -> tuple[Tensor, Tensor]:
    V = logits.shape[-1]
    rows = logits.numel() // V
    idx = torch.empty(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    bad = torch.empty(logits.shape[:-1], dtype=torch.bool, device=logits.device)
    with torch.cuda.device(logits.device):
        library().call("ngk_argmax_rows", _DTYPE_CODES[logits.dtype], _ptr(logits), rows, V, _ptr(idx), _ptr(bad),
                       _stream(logits))
    return idx, bad


@argmax_rows.register_fake
def _(logits):
    shape = logits.shape[:-1]
    return logits.new_empty(shape, dtype=torch.int64), logits.new_empty(shape, dtype=torch.bool)


@torch.library.custom_op(f"{_NS}::silu_mul", mutates_args=())
def silu_mul(gate_up: Tensor) -> Tensor:
    I = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], I)
    with torch.cuda.device(gate_up.device):
        library().call("ngk_silu_mul", _DTYPE_CODES[gate_up.dtype], _ptr(gate_up), _ptr(out), gate_up.numel() // (2 * I),
                       I, _stream(gate_up))
    return out


@silu_mul.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
