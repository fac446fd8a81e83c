"""The weight perturbation of RL rollout benchmarks (verifier/model/perturb.py): decoder linear
weights only, sigma * std(W) in scale, the same for the same seed, none at sigma 0."""

import pytest
import torch

from verifier.config import VerifierConfig
from verifier.model.perturb import perturb_linear_weights, perturbed_names


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    s = {"embed_tokens.weight": torch.randn(50, 16, generator=g), "norm.weight": torch.ones(16)}
    for i in range(2):
        for name, shape in (("self_attn.q_proj", (16, 16)), ("self_attn.k_proj", (8, 16)), ("self_attn.v_proj", (8, 16)),
                            ("self_attn.o_proj", (16, 16)), ("mlp.gate_proj", (32, 16)), ("mlp.up_proj", (32, 16)),
                            ("mlp.down_proj", (16, 32))):
            s[f"layers.{i}.{name}.weight"] = torch.randn(*shape, generator=g) * (i + 1)
        s[f"layers.{i}.input_layernorm.weight"] = torch.ones(16)
    return s


def test_only_decoder_linears_move_by_sigma_std():
    before = state()
    after = {k: v.clone() for k, v in before.items()}
    names = perturb_linear_weights(after, 0.05, seed=3)
    assert names == perturbed_names(before) and len(names) == 14
    assert names[:7] == [f"layers.0.{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                          "mlp.down_proj")]
    for k in before:
        if k in names:
            ratio = float((after[k] - before[k]).std() / before[k].std())
            assert 0.03 < ratio < 0.07, (k, ratio)  # sigma * std(W): the relative scale is sigma
        else:
            assert torch.equal(after[k], before[k]), k
    again = state()
    perturb_linear_weights(again, 0.05, seed=3)
    other = state()
    perturb_linear_weights(other, 0.05, seed=4)
    assert all(torch.equal(again[k], after[k]) for k in names)
    assert not torch.equal(other[names[0]], after[names[0]])
    untouched = state()
    assert perturb_linear_weights(untouched, 0.0, seed=3) == []
    assert all(torch.equal(untouched[k], before[k]) for k in before)


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="weight_noise_sigma"):
        perturb_linear_weights(state(), -0.1, 0)
    with pytest.raises(ValueError, match="weight_noise_seed"):
        perturb_linear_weights(state(), 0.1, -1)
    with pytest.raises(ValueError, match="no decoder linear weights"):
        perturb_linear_weights({"embed_tokens.weight": torch.ones(2, 2)}, 0.1, 0)
    with pytest.raises(ValueError, match="weight_noise_sigma"):
        VerifierConfig(weight_noise_sigma=2.0)
    with pytest.raises(ValueError, match="weight_noise_seed"):
        VerifierConfig(weight_noise_seed=-1)
