"""A seeded policy change for RL rollout benchmarks: W += sigma * std(W) * N(0, 1) on every linear
weight of the decoder layers (q, k, v, o, gate, up, down), not the embeddings, the final norm or
lm_head.

An RL step moves every weight a little; the rollout traces (``bench/data`` and the shared dev traces)
were generated with this perturbation between epochs, and sigma = 0.014075 gives a KL of about 0.01
nats per token on SmolLM2-135M. The noise is drawn in float32 on the CPU from one
``torch.Generator`` seeded with ``seed``, matrix after matrix in layer order (q, k, v, o, gate, up,
down: HF's module order), on the float32 weights as loaded, before the model casts them to its
dtype: the same seed gives the same weights on every device and dtype.
"""

from __future__ import annotations

import re

import torch

LINEAR_WEIGHTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.weight$")


def perturbed_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The state's decoder linear weights (unfused HF names), in the order their noise is drawn."""
    found = []
    for name in state:
        m = _LAYER.match(name)
        if m and m.group(2) in LINEAR_WEIGHTS:
            found.append((int(m.group(1)), LINEAR_WEIGHTS.index(m.group(2)), name))
    return [name for *_, name in sorted(found)]


def perturb_linear_weights(state: dict[str, torch.Tensor], sigma: float, seed: int) -> list[str]:
    """Adds ``sigma * std(W) * N(0, 1)`` to each decoder linear weight of ``state`` (HF names, before
    fusion), in place; returns the names perturbed. ValueError for a bad sigma or seed, or a state
    with no such weights."""
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not 0.0 <= sigma <= 1.0:
        raise ValueError(f"weight_noise_sigma: expected a number in [0, 1], got {sigma!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"weight_noise_seed: expected an int in [0, 2^63), got {seed!r}")
    if sigma == 0.0:
        return []
    names = perturbed_names(state)
    if not names:
        raise ValueError("weight_noise_sigma: the model has no decoder linear weights named like "
                         f"'layers.N.{LINEAR_WEIGHTS[0]}.weight' to perturb")
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name in names:
        w = state[name].to(torch.float32)
        noise = torch.randn(w.shape, generator=g, dtype=torch.float32)
        state[name] = w + float(sigma) * w.std() * noise
    return names
