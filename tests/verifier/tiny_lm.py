"""A tiny random-weight Llama-family model with a word-level tokenizer ("t0" .. "t{V-1}"), for
tests that need many samples (distributions) or a model they may break on purpose (NaN weights).
Its logits are a few units wide, so its distributions are neither flat nor one-hot."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from verifier.model import ForwardBatch, KVCache, ModelConfig, TextCodec, Transformer, build_model
from verifier.model.tokenizer import CHATML


@dataclass
class TinyLM:
    model: Transformer
    codec: TextCodec


def tiny_lm(vocab_size: int = 8, seed: int = 0, weight_std: float = 0.3) -> TinyLM:
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=256, eos_token_ids=(vocab_size - 1,))
    torch.manual_seed(seed)
    model = build_model(cfg, None, "cpu", torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, weight_std)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TinyLM(model, TextCodec(tok, CHATML, (vocab_size - 1,)))


def tiny_lm_cuda(vocab_size: int = 64, seed: int = 5) -> TinyLM:
    """A small random model on the GPU (wider than tiny_lm's, default init) with tiny_lm's codec:
    for engine tests on captured graphs."""
    lm = tiny_lm(vocab_size=vocab_size, seed=seed)
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=256, eos_token_ids=(vocab_size - 1,))
    torch.manual_seed(seed)
    return TinyLM(build_model(cfg, None, "cuda", torch.float32), lm.codec)


def next_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    """The model's logits after ids [V], from a fresh causal forward (no engine involved)."""
    n = len(ids)
    cfg = model.config
    cache = KVCache(cfg.num_layers, 1, max(n, 2), cfg.num_kv_heads, cfg.head_dim, "cpu", model.dtype)
    rows = torch.arange(n)[None]
    fb = ForwardBatch(rows, rows, torch.tensor([0]), n, None, (0, 1))
    return model(torch.tensor([ids]), cache, fb, last_only=True)[0, 0].clone()


def penalized(logits: torch.Tensor, prompt: list[int], output: list[int], presence_penalty: float = 0.0,
              frequency_penalty: float = 0.0, repetition_penalty: float = 1.0) -> torch.Tensor:
    """The penalties one token at a time, written independently of verifier.step.penalties."""
    out = logits.clone()
    for t in set(prompt) | set(output):
        if repetition_penalty != 1.0:
            out[t] = out[t] / repetition_penalty if out[t] > 0 else out[t] * repetition_penalty
    for t, c in Counter(output).items():
        out[t] -= frequency_penalty * c + presence_penalty
    return out


@pytest.fixture(autouse=False)
def one_thread():
    """Tiny matrices on a shared CPU: torch's intra-op threads cost ten times the work itself."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
