"""Tree-verification kernels: CUDA on GPU tensors, the torch reference (verifier.step.reference) on CPU.

Public functions validate their inputs (ValueError), then dispatch: CPU tensors go to the
reference; CUDA tensors go to the nvcc-built library through torch custom ops (CUDA-graph and
torch.compile friendly). If the library cannot be built or loaded on a GPU, a NativeKernelError
says why; the reference is used instead only when allowed, by ``allow_reference=True`` or the
environment variable NGRAM_VERIFIER_ALLOW_REFERENCE=1, and that fallback is logged.

Conventions (sgl-kernel's): K nodes per request, root (last committed token) first, topological
order; flat node index b*K + i; prefix_lens = tokens already in the KV cache; K <= 64.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import Tensor

from ..step import reference
from ..step.reference import TreeIndices, VerifyResult, flatten_draft_tree
from . import checks
from .native import NativeKernelError

log = logging.getLogger(__name__)

__all__ = [
    "MAX_NODES", "NORM_LINEAR_MAX_ROWS", "NativeKernelError", "TreeIndices", "VerifyResult", "argmax_rows",
    "compact_kv_cache",
    "decode_attention", "flatten_draft_tree", "logit_floor", "native_available", "norm_linear", "rope_store_kv", "silu_mul",
    "tree_attention_mask", "tree_attention_mask_flat",
    "tree_indices_from_mask", "tree_indices_from_parents", "tree_sampling_logits", "tree_speculative_sampling",
    "verify_tree_greedy",
]

MAX_NODES = checks.MAX_NODES
NORM_LINEAR_MAX_ROWS = checks.NORM_LINEAR_MAX_ROWS
_warned: set[str] = set()


def _ops():
    from . import ops  # registers torch.ops.ngram_verifier.* on first use

    return ops


def _use_native(device: torch.device, name: str, allow_reference: bool | None) -> bool:
    """True: run the CUDA kernel. False: run the reference (CPU, or an allowed, logged fallback)."""
    if device.type != "cuda":
        return False
    from .native import library

    try:
        library()
        return True
    except NativeKernelError as e:
        if allow_reference is None:
            allow_reference = os.environ.get("NGRAM_VERIFIER_ALLOW_REFERENCE", "").lower() in ("1", "true", "yes")
        if not allow_reference:
            raise
        if name not in _warned:
            _warned.add(name)
            log.warning("%s: using the torch reference on %s because %s", name, device, e)
        return False


def tree_indices_from_mask(tree_mask: Tensor, prefix_lens: Tensor, *, allow_reference: bool | None = None) -> TreeIndices:
    """[bs, K, K] ancestor mask (bool) + prefix_lens [bs] int64 -> TreeIndices (positions, retrive_*)."""
    checks.check_tree_mask(tree_mask, prefix_lens)
    if _use_native(tree_mask.device, "tree_indices_from_mask", allow_reference):
        return TreeIndices(*_ops().tree_indices_from_mask(tree_mask, prefix_lens))
    return reference.tree_indices_from_mask(tree_mask, prefix_lens)


def tree_indices_from_parents(parents: Tensor, prefix_lens: Tensor, *, allow_reference: bool | None = None) -> tuple[Tensor, TreeIndices]:
    """[bs, K] flattened parents (root -1; outside [0, i) = parentless) -> (tree mask, TreeIndices)."""
    checks.check_parents(parents, prefix_lens)
    if _use_native(parents.device, "tree_indices_from_parents", allow_reference):
        mask, *rest = _ops().tree_indices_from_parents(parents, prefix_lens)
        return mask, TreeIndices(*rest)
    return reference.tree_indices_from_parents(parents, prefix_lens)


def verify_tree_greedy(candidates: Tensor, retrive_index: Tensor, retrive_next_token: Tensor,
                       retrive_next_sibling: Tensor, target_predict: Tensor, num_spec_steps: int,
                       *, allow_reference: bool | None = None) -> VerifyResult:
    """Greedy verification; all index inputs [bs, K] int64. Returns (predicts, accept_index, accept_token_num)."""
    args = (candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict, num_spec_steps)
    checks.check_greedy(*args)
    if _use_native(candidates.device, "verify_tree_greedy", allow_reference):
        return VerifyResult(*_ops().verify_tree_greedy(*args))
    return reference.verify_tree_greedy(*args)


def tree_speculative_sampling(candidates: Tensor, retrive_index: Tensor, retrive_next_token: Tensor,
                              retrive_next_sibling: Tensor, coins: Tensor, final_coins: Tensor,
                              target_probs: Tensor, num_spec_steps: int, threshold_single: float = 1.0,
                              threshold_acc: float = 1.0, *, allow_reference: bool | None = None) -> VerifyResult:
    """Rejection sampling of one-hot drafts against target_probs [bs, K, V] float32 (exact at thresholds 1).

    coins [bs, K] and final_coins [bs] are U[0, 1) float32 samples (e.g. torch.rand).
    """
    args = (candidates, retrive_index, retrive_next_token, retrive_next_sibling, coins, final_coins,
            target_probs, num_spec_steps, float(threshold_single), float(threshold_acc))
    checks.check_sampling(*args)
    if _use_native(candidates.device, "tree_speculative_sampling", allow_reference):
        return VerifyResult(*_ops().tree_speculative_sampling(*args))
    return reference.tree_speculative_sampling(*args)


def tree_sampling_logits(candidates: Tensor, retrive_index: Tensor, retrive_next_token: Tensor,
                         retrive_next_sibling: Tensor, coins: Tensor, final_coins: Tensor, logits: Tensor,
                         temperature: Tensor, num_spec_steps: int, threshold_single: float = 1.0,
                         threshold_acc: float = 1.0, *, top_k: Tensor | None = None, top_p: Tensor | None = None,
                         allow_reference: bool | None = None) -> tuple[VerifyResult, Tensor]:
    """``tree_speculative_sampling`` straight from the LM head's logits [bs, K, V] (float32, bfloat16
    or float16, contiguous) at a temperature per row [bs * K] float32 (0: a greedy row, its target
    one-hot at the argmax), with top-k and top-p per row where given ([bs * K] float32; top_k 0 or
    >= V and top_p 1 are off), for targets without logit processing. Returns (the verification,
    bad [bs, K] bool: rows with a NaN or an infinity, verified as zeroed logits).

    On the GPU no [bs, K, V] distribution is written: a truncating step first takes each row's
    floor (``logit_floor``), one kernel takes each row's softmax statistics (max, normaliser over
    the tokens at or above the floor, argmax, non-finite flag) in one pass, and the tree walk
    computes q only at the tokens it tests and over the bonus row (``csrc/verify_sampling.cu``).
    The reference (``verifier.step.reference.tree_sampling_logits``) writes the distribution; the
    two round differently (the kernel's exp is the fast one), so a coin within rounding of a
    boundary can decide differently.
    """
    args = (candidates, retrive_index, retrive_next_token, retrive_next_sibling, coins, final_coins, logits,
            temperature, num_spec_steps, float(threshold_single), float(threshold_acc))
    checks.check_sampling_logits(*args)
    checks.check_truncation(logits.shape[0] * logits.shape[1], logits.shape[2], logits.device, top_k, top_p)
    if _use_native(candidates.device, "tree_sampling_logits", allow_reference):
        floor = None
        if top_k is not None or top_p is not None:
            floor = _ops().logit_floor_rows(logits.view(-1, logits.shape[2]), temperature, top_k, top_p)
        *res, bad = _ops().tree_sampling_logits(*args, floor)
        return VerifyResult(*res), bad
    return reference.tree_sampling_logits(*args, top_k=top_k, top_p=top_p)


def logit_floor(logits: Tensor, temperature: Tensor, top_k: Tensor | None = None, top_p: Tensor | None = None, *,
                allow_reference: bool | None = None) -> Tensor:
    """Top-k / top-p as a floor per row of logits [N, V] (float32, bfloat16 or float16, contiguous):
    float32 [N], a token kept iff its logit is >= it; -inf where nothing is truncated (top_k 0 or
    >= V and top_p 1, temperature 0, or a NaN or an infinity in the row). temperature, top_k and
    top_p are [N] float32 (top_k whole numbers). The semantics are
    ``verifier.step.sampling.truncation_floor``'s (every token tied with the last one kept stays);
    the kernel (``csrc/logit_floor.cu``) is a radix select with fixed-point masses, deterministic."""
    checks.check_floor_logits(logits, temperature)
    checks.check_truncation(*logits.shape, logits.device, top_k, top_p)
    if _use_native(logits.device, "logit_floor", allow_reference):
        return _ops().logit_floor_rows(logits, temperature, top_k, top_p)
    from ..step.sampling import truncation_floor

    return truncation_floor(logits, temperature, top_k, top_p)


def tree_attention_mask(tree_mask: Tensor, prefix_lens: Tensor, kv_len: int, *, allow_reference: bool | None = None) -> Tensor:
    """Dense [bs, K, kv_len] bool mask (True = attend) with tree token i at column prefix_len + i.

    kv_len must be >= max(prefix_lens) + K (not checked: that would synchronise); tree columns
    beyond kv_len are dropped. Use mask[:, None] as SDPA's attn_mask.
    """
    checks.check_dense_mask(tree_mask, prefix_lens, kv_len)
    if _use_native(tree_mask.device, "tree_attention_mask", allow_reference):
        return _ops().tree_attention_mask(tree_mask, prefix_lens, kv_len)
    return reference.tree_attention_mask(tree_mask, prefix_lens, kv_len)


def tree_attention_mask_flat(tree_mask: Tensor, prefix_lens: Tensor, total_len: int | None = None,
                             *, allow_reference: bool | None = None) -> tuple[Tensor, Tensor]:
    """SGLang/FlashInfer custom_mask layout: (flat bool mask, mask_indptr [bs+1] int64).

    total_len = sum(K * (prefix_len + K)); pass it when the host knows it (as SGLang does from
    seq_lens_cpu), else it is read back from the GPU (one synchronisation).
    """
    bs, K = checks.check_tree_mask(tree_mask, prefix_lens)
    if not _use_native(tree_mask.device, "tree_attention_mask_flat", allow_reference):
        return reference.tree_attention_mask_flat(tree_mask, prefix_lens)
    indptr = torch.zeros(bs + 1, dtype=torch.int64, device=tree_mask.device)
    torch.cumsum((prefix_lens + K) * K, 0, out=indptr[1:])
    if total_len is None:
        total_len = int(indptr[-1])
    checks.require(isinstance(total_len, int) and total_len >= 0, f"total_len must be an int >= 0, got {total_len!r}")
    return _ops().tree_attention_mask_flat(tree_mask, prefix_lens, indptr, total_len), indptr


def compact_kv_cache(kv_cache: Tensor, draft_slots: Tensor, accept_index: Tensor, accept_token_num: Tensor,
                     *, allow_reference: bool | None = None) -> None:
    """In place: move each request's accepted K/V rows to the front of its draft slots.

    kv_cache [num_caches, num_slots, ...] (e.g. [2 * layers, slots, heads, head_dim], any dtype);
    draft_slots [bs, K] int64 = the slot of every tree node; accept_index / accept_token_num are
    the int32 outputs of the verify functions.
    """
    checks.check_compaction(kv_cache, draft_slots, accept_index, accept_token_num)
    if _use_native(kv_cache.device, "compact_kv_cache", allow_reference):
        _ops().compact_kv_cache(kv_cache, draft_slots, accept_index, accept_token_num)
    else:
        reference.compact_kv_cache(kv_cache, draft_slots, accept_index, accept_token_num)


def rope_store_kv(qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, layer: int,
                  rows: Tensor, num_heads: int, num_kv_heads: int, *, allow_reference: bool | None = None,
                  check: bool = True) -> Tensor:
    """RoPE on the fused projection's q and k, k and v stored in the KV cache, in one kernel.

    qkv: [tokens, (H + 2 Hkv) * D] (any shape with that many values, contiguous), rows q, k, v;
    positions, rows: [tokens] int64 (RoPE positions; flat cache rows, verifier.model.kv_cache);
    cos, sin: [max_len, D] tables (verifier.model.rope); kv_cache: [2 * layers, rows, Hkv, D].
    Returns q [tokens, H, D] rotated. Positions and rows must be in range (not checked: that
    would synchronise). ``check=False`` skips the validation, for a caller that validated the same
    shapes already (the model's layers after the first).
    """
    if check:
        checks.check_rope_store(qkv, positions, cos, sin, kv_cache, layer, rows, num_heads, num_kv_heads)
    if _use_native(qkv.device, "rope_store_kv", allow_reference):
        return _ops().rope_store_kv(qkv, positions, cos, sin, kv_cache, layer, rows, num_heads, num_kv_heads)
    return reference.rope_store_kv(qkv, positions, cos, sin, kv_cache, layer, rows, num_heads, num_kv_heads)


def decode_attention(q: Tensor, kv_cache: Tensor, layer: int, slots: Tensor, max_len: int, mask: Tensor,
                     scale: float | None = None, *, arrivals: Tensor | None = None, kv_lens: Tensor | None = None,
                     allow_reference: bool | None = None, check: bool = True) -> Tensor:
    """Decode/tree-verify attention straight from the KV cache (no gather of K/V).

    q: [bs, T, H, D] (T <= 64; D 64 or 128 on the GPU); kv_cache: [2 * layers, slots * max_len,
    Hkv, D]; slots: [bs] int64 cache slots; mask: [bs, T, L] bool over cache rows 0 .. L-1 of
    each slot (True = attend; kernels.tree_attention_mask). scale defaults to 1/sqrt(D).
    Returns [bs, T, H, D]. Slots must be in range (not checked: that would synchronise).
    ``arrivals``: zeroed int32 counters on q's device (``KVCache.arrivals``), which the GPU kernel
    leaves zeroed; with them it merges its partial results in one kernel instead of two (the same
    arithmetic). Calls that may run at the same time must not share them. ``kv_lens``: [bs] int64 or
    None; rows at or past kv_lens[b] are masked for request b whatever ``mask`` says, and the GPU
    kernel never reads them (in a batch whose KV bucket its longest request sets, most of a short
    request's rows). ``check=False`` skips the validation, as for ``rope_store_kv``.
    """
    if check:
        checks.check_decode_attention(q, kv_cache, layer, slots, max_len, mask, kv_lens)
        if arrivals is not None:
            checks.check_tensor("arrivals", arrivals, ndim=1, dtypes=torch.int32, device=q.device)
            checks.require(arrivals.is_contiguous(), "arrivals: expected a contiguous tensor")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if _use_native(q.device, "decode_attention", allow_reference):
        checks.require(q.shape[-1] in (64, 128), f"decode_attention on the GPU: head_dim 64 or 128, got {q.shape[-1]}")
        return _ops().decode_attention(q, kv_cache, layer, slots, max_len, mask, scale, arrivals, kv_lens)
    return reference.decode_attention(q, kv_cache, layer, slots, max_len, mask, scale, kv_lens)


def norm_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None,
                norm_weight: Tensor | None = None, eps: float = 1e-6, silu: bool = False, *,
                allow_reference: bool | None = None, check: bool = True) -> tuple[Tensor, Tensor | None]:
    """A linear layer over the few rows of a decode/verify step with the layer's residual add and
    RMSNorm as its prologue and SwiGLU's activation as its epilogue, in one kernel on the GPU.

    x: [..., K] contiguous; weight: [N, K] ([2 I, K], gate rows then up rows, with ``silu``);
    bias: [N] or None; residual: [..., K] or None (added to x first, then normalised; needs
    norm_weight); norm_weight: [K] or None (no norm). Returns (y [..., N] (or [..., I]), s): s is
    residual + x, the residual stream for the next layer, or None without a residual.

    On CUDA, bfloat16 (or float16 without a norm) with 1..32 rows, K % 32 == 0 and N % 8 == 0 run the
    native kernel: the norm is folded into the matmul (rstd times the sums of (norm_weight * s) @
    weight.T), which rounds differently from eager torch by about one rounding of the dtype, and a
    row's result does not depend on the other rows. Other shapes and CPU tensors run the torch
    reference (``verifier.step.reference.norm_linear``, eager torch's rounding).
    ``check=False`` skips the validation, as for ``rope_store_kv``.
    """
    if check:
        checks.check_norm_linear(x, weight, bias, residual, norm_weight, eps, silu)
    if (x.is_cuda and checks.norm_linear_native_ok(x, weight, silu, norm_weight is not None) is None
            and _use_native(x.device, "norm_linear", allow_reference)):
        y, s = _ops().norm_linear(x, weight, bias, residual, norm_weight, float(eps), silu)
        return y, (s if residual is not None else None)
    return reference.norm_linear(x, weight, bias, residual, norm_weight, eps, silu)


def argmax_rows(logits: Tensor, *, allow_reference: bool | None = None) -> tuple[Tensor, Tensor]:
    """Greedy verification's row reductions in one kernel: (argmax [...] int64, bad [...] bool) of
    logits [..., V] (contiguous; float32, bfloat16 or float16: a 16-bit row gives what its float32
    copy would). A row holding a NaN or an infinity is zeroed in place and flagged, and its argmax
    is 0; ties go to the lowest index (as torch.argmax)."""
    checks.check_argmax_rows(logits)
    if _use_native(logits.device, "argmax_rows", allow_reference):
        return _ops().argmax_rows(logits)
    return reference.argmax_rows(logits)


def silu_mul(gate_up: Tensor, *, allow_reference: bool | None = None, check: bool = True) -> Tensor:
    """SwiGLU's activation on a fused gate/up projection: gate_up [..., 2 I] (contiguous; the I gate
    values, then the I up values) -> silu(gate) * up [..., I], computed in float32 and rounded once
    (as the compiled ``verifier.model.fusion.silu_mul``; the eager one rounds silu(gate) first).
    One native kernel on CUDA, the reference (``verifier.step.reference.silu_mul``) elsewhere.
    ``check=False`` skips the validation (the model's own shapes)."""
    if check:
        checks.check_silu_mul(gate_up)
    if _use_native(gate_up.device, "silu_mul", allow_reference):
        return _ops().silu_mul(gate_up)
    return reference.silu_mul(gate_up)


def native_available() -> bool:
    """Whether the CUDA kernel library is built and loaded (it is built on the first call)."""
    from .native import available

    return available()
