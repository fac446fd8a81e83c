"""The elementwise parts of a decoder layer as functions that ``torch.compile`` fuses on the GPU.

A decode step of a small model is bound by the number of kernels, not their work: SmolLM2-135M
runs 30 layers of a few microseconds of work each, and in plain torch every RMSNorm, RoPE, SiLU
and residual add is several kernels (measured on the H200: a graph-replayed bs-1 decode step took
2.3 ms for 0.06 ms of weight reads). Compiled, each function below is one generated kernel, so a
layer is its four matmuls, attention and about five small kernels.

The eager versions are the reference semantics (HF Llama's order of casts); ``enable_compile``
swaps in compiled versions, for CUDA only (CPU runs, and CI, stay eager). A compiled function may
round intermediate values differently from eager (it keeps them in float32), which is within the
model's own bf16 noise; speculative and plain decoding use the same functions, so they still match.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Normalized in float32, rounded to the model's dtype, then scaled (as HF Llama does).
    h = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(residual + x, rms_norm(residual + x)): a sublayer's residual add fused with the next norm."""
    s = residual + x
    return s, rms_norm(s, weight, eps)


def rope_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int) -> tuple[Tensor, Tensor]:
    """qkv [bs, T, H + 2 Hkv, D] from the fused projection -> (q [bs, T, H, D] rotated,
    kv [2, bs, T, Hkv, D]: rotated keys, then values, in the KV cache's layout).

    RoPE in the "rotate half" layout of HF checkpoints; cos/sin [bs, T, 1, D]."""
    H, Hkv = num_heads, num_kv_heads
    qk = qkv[:, :, :H + Hkv]
    half = qk.shape[-1] // 2
    rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
    qk = qk * cos + rotated * sin
    kv = torch.stack([qk[:, :, H:], qkv[:, :, H + Hkv:]])
    return qk[:, :, :H], kv


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU's activation on the fused gate/up projection (gate rows first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_EAGER = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rope_qkv": rope_qkv, "silu_mul": silu_mul}
ops = dict(_EAGER)  # what the model calls: eager, or compiled after enable_compile()


def enable_compile() -> bool:
    """Compiles the functions above (Triton kernels via inductor). Returns False, having logged
    why, when compilation is unavailable; the model then stays eager."""
    try:
        import triton  # noqa: F401  (inductor's GPU backend)
    except ImportError as e:
        log.warning("torch.compile of the layer's elementwise ops is off: %s", e)
        return False
    global _compiled
    if _compiled is None:  # one set per process: each torch.compile wrapper compiles anew
        _compiled = {name: torch.compile(fn, dynamic=True, fullgraph=True) for name, fn in _EAGER.items()}
    ops.update(_compiled)
    return True


def disable_compile() -> None:
    ops.update(_EAGER)


_compiled: dict | None = None
