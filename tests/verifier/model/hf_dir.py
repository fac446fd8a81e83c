"""A small random-weight Llama-shaped HF model directory written by the tests: config.json,
model.safetensors (HF tensor names) and a word-level tokenizer ("t0" .. "t{V-1}") with its
tokenizer_config.json, as ``verifier.model.loader`` reads a downloaded model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": 63,
          "bos_token_id": 0}


def hf_state(seed: int = 0, std: float = 0.3) -> dict[str, torch.Tensor]:
    """Random weights in HF's names (``model.`` prefix, separate q/k/v and gate/up)."""
    c = CONFIG
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g) * std  # noqa: E731
    state = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": torch.ones(h), "lm_head.weight": rnd(v, h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        state.update({p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                      p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
                      p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
                      p + "mlp.down_proj.weight": rnd(h, i), p + "input_layernorm.weight": torch.ones(h),
                      p + "post_attention_layernorm.weight": torch.ones(h)})
    return state


def write_hf_dir(path: Path, seed: int = 0, state: dict[str, torch.Tensor] | None = None,
                 config: dict | None = None) -> dict[str, torch.Tensor]:
    """Writes the directory; returns the weights written."""
    path.mkdir(parents=True, exist_ok=True)
    state = hf_state(seed) if state is None else state
    (path / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    v = CONFIG["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(v)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{v - 1}", "bos_token": "t0"}))
    return state
