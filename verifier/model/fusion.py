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
        import torch._dynamo

        # Each function is specialised per dtype and per size-1-or-not dimension; a process with
        # several models, dtypes or devices (the test suite; an engine rebuilt) can pass dynamo's
        # default of 8 versions, and with fullgraph=True the 9th raises in the middle of a forward.
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
        _compiled = {name: _Compiled(name, torch.compile(fn, dynamic=True, fullgraph=True), fn)
                     for name, fn in _EAGER.items()}
    ops.update(_compiled)
    return True


RECOMPILE_LIMIT = 64


class _Compiled:
    """A compiled op that runs its eager version, from then on, once dynamo refuses to compile
    another version of it (its recompile limit): a forward never fails for want of a kernel."""

    def __init__(self, name: str, compiled, eager) -> None:
        self.name, self.compiled, self.eager = name, compiled, eager
        self.fn = compiled

    def __call__(self, *args):
        try:
            return self.fn(*args)
        except _RECOMPILE_LIMIT_ERRORS as e:
            if self.fn is self.eager:
                raise
            log.warning("torch.compile of %s: %s; it runs eagerly from now on", self.name, type(e).__name__)
            self.fn = self.eager
            return self.eager(*args)


def _recompile_limit_errors() -> tuple[type[BaseException], ...]:
    try:
        from torch._dynamo.exc import FailOnRecompileLimitHit
    except ImportError:  # older torch: the limit only falls back to eager with a warning
        return ()
    return (FailOnRecompileLimitHit,)


_RECOMPILE_LIMIT_ERRORS = _recompile_limit_errors()


def disable_compile() -> None:
    ops.update(_EAGER)


_compiled: dict | None = None
