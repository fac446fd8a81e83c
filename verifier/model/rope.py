"""Rotary position embeddings with the HF scaling variants (default, linear, llama3, yarn).

q/k use the "rotate half" layout of HF checkpoints: dimension j pairs with j + d/2 and rotates by
angle pos * inv_freq[j mod d/2] (applied in ``verifier.model.fusion.rope_qkv``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> tuple[Tensor, float]:
    """(inv_freq [head_dim/2] float64, attention scale applied to cos/sin)."""
    d, base, s = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    kind = s.rope_type
    if kind == "linear":
        return inv / s.factor, 1.0
    if kind == "llama3":
        # Wavelengths above old_ctx/low_freq_factor are slowed by `factor`, those below
        # old_ctx/high_freq_factor are kept, and the band between is interpolated smoothly.
        old = s.original_max_position_embeddings
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        mixed = (1 - smooth) * inv / s.factor + smooth * inv
        out = torch.where(wavelen > old / s.low_freq_factor, inv / s.factor, inv)
        medium = (wavelen <= old / s.low_freq_factor) & (wavelen >= old / s.high_freq_factor)
        return torch.where(medium, mixed, out), 1.0
    if kind == "yarn":
        # YaRN: interpolate dimensions whose period exceeds the original context (ramp between
        # beta_fast and beta_slow rotations), extrapolate the rest; scale attention by mscale.
        old = s.original_max_position_embeddings

        def dim_for(rotations: float) -> float:
            return (d * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(dim_for(s.beta_fast)), 0)
        high = min(math.ceil(dim_for(s.beta_slow)), d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        extrapolate = 1 - ramp
        inv = inv / s.factor * (1 - extrapolate) + inv * extrapolate
        mscale = s.attention_factor if s.attention_factor is not None else 0.1 * math.log(s.factor) + 1.0
        return inv, mscale
    return inv, 1.0


def rope_cache(cfg: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [max_len, head_dim] (angles in float64, then cast)."""
    inv, mscale = inv_frequencies(cfg)
    angles = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * mscale).to(device, dtype), (angles.sin() * mscale).to(device, dtype)
