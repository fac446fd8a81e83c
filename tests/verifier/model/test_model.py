"""The Llama-family model: config validation, RoPE variants, GGUF layout, parity with real traces."""

import dataclasses

import numpy as np
import pytest
import torch

from verifier.model import ForwardBatch, KVCache, ModelConfig, RopeScaling, build_model
from verifier.model.gguf_loader import _unpermute
from verifier.model.rope import inv_frequencies


def test_config_validates_at_construction():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_name("smollm2-135m", num_kv_heads=4)
    with pytest.raises(ValueError, match="rope_type"):
        RopeScaling("ntk-by-parts")
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RopeScaling("llama3", 8.0)
    cfg = ModelConfig.from_hf({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
                               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert cfg.attention_bias and cfg.head_dim == 16 and cfg.rope_scaling.rope_type == "yarn"


@pytest.mark.parametrize("scaling", [RopeScaling(), RopeScaling("linear", 2.0), RopeScaling("llama3", 8.0, 8192),
                                     RopeScaling("yarn", 4.0, 4096)])
def test_rope_scaling_variants_slow_only_low_frequencies(scaling):
    cfg = ModelConfig.from_name("llama-3-8b", rope_scaling=scaling)
    base, _ = inv_frequencies(dataclasses.replace(cfg, rope_scaling=RopeScaling()))
    inv, mscale = inv_frequencies(cfg)
    assert inv.shape == (cfg.head_dim // 2,) and mscale >= 1.0
    assert torch.all(inv <= base * (1 + 1e-12)) and torch.all(inv >= base / scaling.factor * (1 - 1e-12))
    if scaling.rope_type in ("llama3", "yarn"):  # the highest frequencies are kept as they are
        assert inv[0] == base[0]


def test_gguf_unpermute_inverts_llama_cpp_permute():
    n_head, d, cols = 3, 8, 5
    w = np.arange(n_head * d * cols, dtype=np.float32).reshape(n_head * d, cols)
    permuted = w.reshape(n_head, 2, d // 2, cols).swapaxes(1, 2).reshape(w.shape)  # llama.cpp convert
    np.testing.assert_array_equal(_unpermute(permuted, n_head), w)


def test_tree_mask_forward_matches_sequential_decoding():
    """A chain verified in one masked forward gives the logits of decoding it token by token."""
    cfg = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    model = build_model(cfg, None, "cpu", torch.float32)
    ids = torch.randint(0, 97, (1, 12))
    cache = KVCache(2, 1, 32, 2, 8, "cpu", torch.float32)
    rows = torch.arange(12)[None]
    full = model(ids, cache, ForwardBatch(rows, rows, torch.tensor([0]), 12))
    cache2 = KVCache(2, 1, 32, 2, 8, "cpu", torch.float32)
    model(ids[:, :8], cache2, ForwardBatch(rows[:, :8], rows[:, :8], torch.tensor([0]), 8))
    mask = torch.ones(1, 4, 12, dtype=torch.bool).tril(8)
    chain = model(ids[:, 8:], cache2, ForwardBatch(rows[:, 8:], rows[:, 8:], torch.tensor([0]), 12, mask))
    torch.testing.assert_close(chain, full[:, 8:], rtol=1e-4, atol=1e-4)


def test_greedy_matches_real_model_traces(smollm2, greedy_reference_rows):
    """fp32 CPU greedy from the Q4_1 GGUF vs HF transformers bf16 greedy from the original weights:
    different weights (4-bit) and precision, so outputs drift apart eventually; the first tokens
    must agree on most prompts (measured: 8 Spec-Bench prompts matched 10-32 of 32 tokens)."""
    from verifier.engine.core import Engine, EngineConfig
    from verifier.step.sampling import SamplingParams

    n = 12
    engine = Engine(smollm2.model, smollm2.codec, None, EngineConfig(max_batch=8, max_len=1024, budget=0))
    reqs = engine.generate([r["prompt_ids"] for r in greedy_reference_rows], SamplingParams(max_tokens=n, ignore_eos=True))
    matched = []
    for req, row in zip(reqs, greedy_reference_rows):
        ref = row["output_ids"][:n]
        matched.append(next((i for i, (a, b) in enumerate(zip(req.output_ids, ref)) if a != b), len(ref)))
    print("matched prefix per prompt:", matched)
    assert sum(m >= 6 for m in matched) >= 0.75 * len(matched), matched
    assert all(m >= 1 for m in matched), matched  # the first token is never a coin flip here
