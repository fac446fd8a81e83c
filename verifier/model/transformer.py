"""A Llama-family decoder in plain torch (GQA, RoPE, SwiGLU, RMSNorm, optional qkv bias).

One forward serves prefill, decode and tree verification: every call names, per request, the
cache slot, the positions of its new tokens (RoPE) and the cache rows they are written to, plus
either a causal prefill (empty prefix) or an explicit boolean mask over the cache rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .kv_cache import KVCache
from .rope import apply_rope, rope_cache


@dataclass
class ForwardBatch:
    """What one forward needs besides the token ids [bs, T].

    positions: [bs, T] int64 RoPE positions (prefix_len + depth in a tree).
    write_rows: [bs, T] int64 cache rows of the new tokens' K/V (prefix_len + node index).
    slots: [bs] int64 cache slots; slot_range = (first, bs) when they are consecutive (a view
        instead of a gather).
    kv_len: cache rows attended (>= every write row + 1).
    mask: [bs, T, kv_len] bool (True = attend) or None = causal over exactly the new tokens.
    """

    positions: Tensor
    write_rows: Tensor
    slots: Tensor
    kv_len: int
    mask: Tensor | None = None
    slot_range: tuple[int, int] | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalized in float32, rounded to the model's dtype, then scaled (as HF Llama does);
        # F.rms_norm is one kernel where torch fuses it, instead of six.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """q, k and v come from one fused projection (``qkv_proj``: rows q, then k, then v), and RoPE
    rotates q and k in one pass: fewer, larger kernels (a step of a small model is bound by the
    number of kernels, not by their work)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.cfg = layer, cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.qkv_proj = nn.Linear(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, fb: ForwardBatch) -> Tensor:
        bs, T, _ = x.shape
        cfg = self.cfg
        H, Hkv = cfg.num_heads, cfg.num_kv_heads
        qkv = self.qkv_proj(x).view(bs, T, H + 2 * Hkv, cfg.head_dim)
        qk = apply_rope(qkv[:, :, :H + Hkv], cos, sin)  # [bs, T, H + Hkv, D]
        q, k, v = qk[:, :, :H].transpose(1, 2), qk[:, :, H:], qkv[:, :, H + Hkv:]
        cache.write(self.layer, fb.slots, fb.write_rows, k, v)
        keys, values = cache.read(self.layer, fb.slots, fb.kv_len, fb.slot_range)  # [bs, Hkv, L, D]
        mask = None if fb.mask is None else fb.mask[:, None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=fb.mask is None,
                                             enable_gqa=cfg.num_heads != cfg.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(bs, T, -1))


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one projection (``gate_up_proj``: gate rows, then up)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, fb: ForwardBatch) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, fb)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Parameter names follow HF's LlamaForCausalLM (``model.`` prefix dropped) except for the
    fused projections; ``fuse_state_dict`` maps an HF state dict to them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope: tuple[Tensor, Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def rope(self, max_len: int) -> tuple[Tensor, Tensor]:
        if self._rope is None or self._rope[0].shape[0] < max_len or self._rope[0].device != self.device:
            self._rope = rope_cache(self.config, max_len, self.device, self.dtype)
        return self._rope

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, cache: KVCache, fb: ForwardBatch, last_only: bool = False) -> Tensor:
        """Logits [bs, T, V] (float32), or [bs, 1, V] of the last position with ``last_only``."""
        cos_all, sin_all = self.rope(cache.max_len)
        cos, sin = cos_all[fb.positions][:, :, None], sin_all[fb.positions][:, :, None]  # [bs, T, 1, D]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, fb)
        if last_only:
            x = x[:, -1:]
        x = self.norm(x)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, w).float()


def fuse_state_dict(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF-named weights (q/k/v_proj, gate/up_proj) -> this model's fused projections."""
    out = dict(state)
    for i in range(cfg.num_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        for kind in ("weight", "bias"):
            names = [f"{a}{p}_proj.{kind}" for p in "qkv"]
            if all(n in out for n in names):
                out[f"{a}qkv_proj.{kind}"] = torch.cat([out.pop(n) for n in names], dim=0)
        names = [f"{m}gate_proj.weight", f"{m}up_proj.weight"]
        if all(n in out for n in names):
            out[f"{m}gate_up_proj.weight"] = torch.cat([out.pop(n) for n in names], dim=0)
    return out
