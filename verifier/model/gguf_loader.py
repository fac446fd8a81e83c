"""Llama-architecture GGUF files: config from the metadata, weights dequantized with ``gguf``.

llama.cpp's HF -> GGUF conversion permutes the rows of q_proj and k_proj so that each head's
rotary pairs are interleaved (GGML's "normal" RoPE rotates (2j, 2j+1)); HF's rotate-half pairs
(j, j + d/2). ``_unpermute`` undoes it: rows of a head, viewed as [d/2, 2], are transposed back
to [2, d/2].
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from .config import ModelConfig, RopeScaling

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _meta(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader) -> ModelConfig:
    arch = _meta(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"GGUF: unsupported architecture {arch!r} (llama, qwen2)")
    g = lambda k, d=None: _meta(reader, f"{arch}.{k}", d)  # noqa: E731

    def need(key: str) -> int:  # a missing key is the file's problem: ValueError, not int(None)'s TypeError
        v = g(key)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"GGUF: metadata {arch}.{key} is {'missing' if v is None else f'not an int ({v!r:.40})'}")
        return int(v)

    names = {t.name for t in reader.tensors}
    heads = need("attention.head_count")
    hidden = need("embedding_length")
    scaling = RopeScaling()
    kind = g("rope.scaling.type")
    if kind and kind != "none":
        scaling = RopeScaling.from_hf({"rope_type": kind, "factor": g("rope.scaling.factor", 1.0),
                                       "original_max_position_embeddings": g("rope.scaling.original_context_length")},
                                      int(g("context_length", 8192)))
    eos = _meta(reader, "tokenizer.ggml.eos_token_id")
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    vocab = g("vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
    if vocab is None:
        raise ValueError(f"GGUF: neither {arch}.vocab_size nor tokenizer.ggml.tokens in the metadata")
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden, intermediate_size=need("feed_forward_length"),
        num_layers=need("block_count"), num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("attention.key_length", 0) or 0), rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=scaling, rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(g("context_length", 8192)),
        tie_word_embeddings="output.weight" not in names, attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id"), eos_token_ids=() if eos is None else (int(eos),),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: reshape(n_head, 2, d/2, ...).swapaxes(1, 2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "embed_tokens.weight"
    if name == "output_norm.weight":
        return "norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")  # blk.{i}.{kind}.{weight|bias}
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def load_gguf(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor], Any]:
    """(config, float32 state dict in ``Transformer``'s names, the GGUFReader for tokenizer metadata)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(os.fspath(path))
    cfg = config_from_gguf(reader)
    rope_permuted = _meta(reader, "general.architecture") == "llama"  # qwen2 GGUFs keep HF's layout
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue  # e.g. rope_freqs (recomputed from the config)
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(n) for n in reversed(t.shape.tolist())])  # GGUF lists ne0 (innermost) first
        if rope_permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, cfg.num_heads)
        elif rope_permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, cfg.num_kv_heads)
        state[name] = torch.from_numpy(np.require(w, requirements=["C", "W"]))  # F32 tensors come read-only (mmap)
    return cfg, state, reader
