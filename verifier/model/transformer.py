"""A Llama-family decoder in plain torch (GQA, RoPE, SwiGLU, RMSNorm, optional qkv bias).

One forward serves prefill, decode and tree verification: every call names, per request, the
cache slot, the positions of its new tokens (RoPE) and the cache rows they are written to, plus
either a causal prefill (empty prefix) or an explicit boolean mask over the cache rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from .config import ModelConfig
from .kv_cache import KVCache
from . import fusion
from .rope import rope_cache


@dataclass
class ForwardBatch:
    """What one forward needs besides the token ids [bs, T].

    positions: [bs, T] int64 RoPE positions (prefix_len + depth in a tree).
    write_rows: [bs, T] int64 cache rows of the new tokens' K/V (prefix_len + node index).
    slots: [bs] int64 cache slots; slot_range = (first, bs) when they are consecutive (a view
        instead of a gather).
    kv_len: cache rows attended (>= every write row + 1).
    mask: [bs, T, kv_len] bool (True = attend) or None = causal over exactly the new tokens.
    kv_lens: [bs] int64 or None: no token of request b attends a row at or past kv_lens[b] (a
        bound the mask keeps: prefix + nodes of a tree); the native attention reads no further.
    """

    positions: Tensor
    write_rows: Tensor
    slots: Tensor
    kv_len: int
    mask: Tensor | None = None
    slot_range: tuple[int, int] | None = None
    kv_lens: Tensor | None = None


@dataclass
class _Step:
    """What every layer of one forward shares: computed once per forward."""

    fb: ForwardBatch
    flat_rows: Tensor  # [bs * T] flat cache rows of the new tokens' K/V
    cos: Tensor | None  # [bs, T, 1, D] (the torch RoPE path)
    sin: Tensor | None
    bias: Tensor | None  # the additive mask of the SDPA path (None: causal, or native attention)
    rope_tables: tuple[Tensor, Tensor] | None = None  # [max_len, D] cos, sin: the native RoPE + KV-store kernel
    native_attention: bool = False  # decode/verify attention by verifier.kernels.decode_attention
    # Every projection by verifier.kernels.norm_linear, with the norms, residual adds and SwiGLU
    # folded in (a step of few rows: decode, small verify steps).
    fused_linear: bool = False
    native_silu: bool = False  # SwiGLU's activation by verifier.kernels.silu_mul (the native kernels' path)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return fusion.ops["rms_norm"](x, self.weight, self.eps)


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

    def forward(self, x: Tensor, cache: KVCache, ctx: "_Step") -> Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), cache, ctx))

    def attend(self, qkv: Tensor, cache: KVCache, ctx: "_Step") -> Tensor:
        """The fused projection's output [bs, T, (H + 2 Hkv) D] -> attention output [bs, T, H D]
        (before o_proj); k and v go into the cache."""
        bs, T, _ = qkv.shape
        cfg, fb = self.cfg, ctx.fb
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if ctx.rope_tables is not None:  # one kernel: RoPE, q out, k/v into their cache rows
            # Every layer of a forward passes the same shapes: the first one validates them.
            q = kernels.rope_store_kv(qkv, fb.positions, *ctx.rope_tables, cache.data, self.layer, ctx.flat_rows,
                                      H, Hkv, check=self.layer == 0).view(bs, T, H, D)
        else:
            q, kv = fusion.ops["rope_qkv"](qkv.view(bs, T, H + 2 * Hkv, D), ctx.cos, ctx.sin, H, Hkv)
            cache.write_kv(self.layer, ctx.flat_rows, kv)
        if ctx.native_attention:  # straight from the cache rows: no gather, no mask expansion
            out = kernels.decode_attention(q, cache.data, self.layer, fb.slots, cache.max_len, fb.mask,
                                           arrivals=cache.arrivals, kv_lens=fb.kv_lens, check=self.layer == 0)
            return out.view(bs, T, H * D)
        keys, values = cache.read(self.layer, fb.slots, fb.kv_len, fb.slot_range)  # [bs, Hkv, L, D]
        if ctx.bias is None:  # causal prefill: flash attention handles the shared kv heads itself
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=True, enable_gqa=H != Hkv)
            return out.transpose(1, 2).reshape(bs, T, -1)
        # Decode/verify with a mask: the G = H / Hkv query heads that share a kv head become G * T
        # query rows of that head (head h uses kv head h // G), so one memory-efficient attention
        # kernel runs with the precomputed additive mask and no copies of keys/values.
        G = H // Hkv
        qg = q.view(bs, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(bs, Hkv, G * T, D)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=ctx.bias)
        return out.view(bs, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(bs, T, H * D)


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one projection (``gate_up_proj``: gate rows, then up)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, native: bool = False) -> Tensor:
        """``native``: the activation by the native kernel (CUDA; see _Step.native_silu)."""
        gate_up = self.gate_up_proj(x)
        act = kernels.silu_mul(gate_up, check=False) if native else fusion.ops["silu_mul"](gate_up)
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: Tensor, residual: Tensor | None, cache: KVCache, ctx: "_Step") -> tuple[Tensor, Tensor]:
        """h: the previous layer's MLP output (the embeddings for layer 0, residual None);
        returns (this layer's MLP output, the residual stream before it). Each residual add is
        fused with the norm that follows it."""
        if ctx.fused_linear:
            return self._forward_fused(h, residual, cache, ctx)
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            residual, x = fusion.ops["add_rms_norm"](h, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        a = self.self_attn(x, cache, ctx)
        norm = self.post_attention_layernorm
        residual, x = fusion.ops["add_rms_norm"](a, residual, norm.weight, norm.eps)
        return self.mlp(x, ctx.native_silu), residual

    def _forward_fused(self, h: Tensor, residual: Tensor | None, cache: KVCache, ctx: "_Step") -> tuple[Tensor, Tensor]:
        """Four kernels besides attention: [add + norm + qkv], [o_proj], [add + norm + gate/up +
        SiLU * up], [down] (verifier.kernels.norm_linear; shapes validated by the model)."""
        attn, mlp = self.self_attn, self.mlp
        norm = self.input_layernorm
        qkv, s = kernels.norm_linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias, residual, norm.weight, norm.eps,
                                     check=False)
        residual = h if residual is None else s
        a, _ = kernels.norm_linear(attn.attend(qkv, cache, ctx).contiguous(), attn.o_proj.weight, check=False)
        norm = self.post_attention_layernorm
        act, residual = kernels.norm_linear(a, mlp.gate_up_proj.weight, None, residual, norm.weight, norm.eps,
                                            silu=True, check=False)
        out, _ = kernels.norm_linear(act, mlp.down_proj.weight, check=False)
        return out, residual


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
        # On CUDA, when the native kernel library loads: RoPE + KV store in one kernel, and
        # decode/verify attention read straight from the cache (verifier.kernels). Off: plain torch.
        self.native_kernels = True
        # With the native kernels, steps of at most kernels.NORM_LINEAR_MAX_ROWS tokens run every
        # projection through kernels.norm_linear (norms, residual adds and SwiGLU folded in).
        self.native_linear = True

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
    def forward(self, input_ids: Tensor, cache: KVCache, fb: ForwardBatch, last_only: bool = False,
                last_index: Tensor | None = None, float_logits: bool = True) -> Tensor:
        """Logits [bs, T, V] (float32), or [bs, 1, V] of the last position with ``last_only``, or
        of position ``last_index[b]`` of each row (right-padded prompts of a batched prefill).
        ``float_logits=False``: in the model's dtype, as the LM head computed them (their float32
        copy is exact, so an argmax needs none: at 64 x 16 tree nodes that copy is 300 MB)."""
        ctx = self._step_context(input_ids, cache, fb)
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual, cache, ctx)
        if last_index is not None:
            rows = torch.arange(h.shape[0], device=h.device)
            h, residual = h[rows, last_index][:, None], residual[rows, last_index][:, None]
        elif last_only:
            h, residual = h[:, -1:], residual[:, -1:]
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if ctx.fused_linear:
            logits, _ = kernels.norm_linear(h.contiguous(), w, None, residual.contiguous(), self.norm.weight,
                                            self.norm.eps, check=False)
            return logits.float() if float_logits else logits
        _, x = fusion.ops["add_rms_norm"](h, residual, self.norm.weight, self.norm.eps)
        logits = F.linear(x, w)
        return logits.float() if float_logits else logits

    def _step_context(self, input_ids: Tensor, cache: KVCache, fb: ForwardBatch) -> "_Step":
        cos_all, sin_all = self.rope(cache.max_len)
        flat_rows = cache.flat_rows(fb.slots, fb.write_rows).view(-1)
        T, cfg = input_ids.shape[1], self.config
        native = self.native_kernels and input_ids.is_cuda and kernels.native_available()  # head_dim is even (config)
        if not native:
            return _Step(fb, flat_rows, cos_all[fb.positions][:, :, None], sin_all[fb.positions][:, :, None],  # [bs, T, 1, D]
                         None if fb.mask is None else self.attention_bias(fb.mask))
        fb = dataclasses.replace(fb, positions=fb.positions.contiguous(), slots=fb.slots.to(torch.int64))
        # Every decode/verify step uses the native attention (H200, SmolLM2-135M,
        # bench/step_profile.py: step replays 0.64-0.78x of torch SDPA's from batch 1 x 1 node to
        # 64 x 16 nodes): a token then computes the same in a plain step as in a verify step where
        # its keys sit at the same cache rows (fixed spans; the root and chain nodes;
        # tests/verifier/kernels/test_decode_attention.py), so greedy speculative output nearly always
        # matches plain decoding in bf16 (it did not, at batch 64, with SDPA above a size threshold).
        attend = fb.mask is not None and cfg.head_dim in (64, 128) and T <= kernels.MAX_NODES
        bias = None if fb.mask is None or attend else self.attention_bias(fb.mask)
        # Few rows: every projection is one norm_linear kernel, with a row's result independent of
        # the other rows (plain and verify steps still compute a token the same).
        fused = (self.native_linear and input_ids.numel() <= kernels.NORM_LINEAR_MAX_ROWS
                 and self.fused_linear_supported())
        # SwiGLU's activation by the native kernel on every native forward: elementwise, so a row's
        # result does not depend on the batch either (H200, SmolLM2 verify steps of 64 x 16 nodes:
        # 256 us per step for the compiled op's kernels, 101 us for the native one).
        return _Step(fb, flat_rows, None, None, bias, (cos_all, sin_all), attend, fused, native_silu=True)

    def fused_linear_supported(self) -> bool:
        """Whether this model's shapes and dtype suit kernels.norm_linear's native kernel."""
        cfg = self.config
        if self.dtype != torch.bfloat16:  # the kernel's folded norm needs bfloat16's range
            return False
        ins = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
        outs = ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size,
                cfg.vocab_size)
        return all(k % 32 == 0 for k in ins) and all(n % 8 == 0 for n in outs)

    def attention_bias(self, mask: Tensor) -> Tensor:
        """mask [bs, T, L] bool (True = attend) -> the additive mask of the grouped-query layout
        [bs, 1, G * T, L] (query row g * T + t is head g's row t), built once per forward."""
        bs, T, L = mask.shape
        G = self.config.num_heads // self.config.num_kv_heads
        bias = torch.zeros(bs, 1, 1, T, L, dtype=self.dtype, device=mask.device)
        bias.masked_fill_(~mask[:, None, None], float("-inf"))
        return bias.expand(bs, 1, G, T, L).reshape(bs, 1, G * T, L)


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
