"""Model configuration: one validated dataclass for Llama-family decoders (Llama 2/3, SmolLM2, Qwen2).

Built from a HF ``config.json`` (``from_hf``), GGUF metadata (``verifier.model.gguf_loader``) or a
named preset of real shapes (``from_name``, for random-weight benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling (HF ``rope_scaling``). ``default`` = plain RoPE."""

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0  # llama3 / yarn: the pre-extension context
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: scales cos/sin (default 0.1 ln(factor) + 1)

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type: expected one of {ROPE_TYPES}, got {self.rope_type!r}")
        if not self.factor >= 1.0 and self.rope_type != "default":
            raise ValueError(f"rope factor: expected >= 1, got {self.factor}")
        if self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings <= 0:
            raise ValueError(f"{self.rope_type} RoPE needs original_max_position_embeddings > 0")
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"llama3 RoPE: expected 0 < low_freq_factor < high_freq_factor, "
                             f"got {self.low_freq_factor}, {self.high_freq_factor}")

    @classmethod
    def from_hf(cls, d: dict[str, Any] | None, max_pos: int) -> "RopeScaling":
        if not d:
            return cls()
        kind = d.get("rope_type", d.get("type", "default"))
        names = {f.name for f in fields(cls)} - {"rope_type"}
        kw = {k: d[k] for k in names if d.get(k) is not None}
        if kind in ("llama3", "yarn"):
            kw.setdefault("original_max_position_embeddings", max_pos)
        return cls(rope_type=kind, **kw)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads})")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even int >= 2 (RoPE rotates pairs), got {self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError(f"rope_theta and rms_norm_eps must be > 0, got {self.rope_theta}, {self.rms_norm_eps}")
        if not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"rope_scaling: expected RopeScaling, got {type(self.rope_scaling).__name__}")
        eos = tuple(int(t) for t in self.eos_token_ids)
        if any(not 0 <= t < self.vocab_size for t in eos):
            raise ValueError(f"eos_token_ids {eos} outside the vocabulary [0, {self.vocab_size})")
        object.__setattr__(self, "eos_token_ids", eos)

    @property
    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        """From a HF ``config.json`` dict (LlamaForCausalLM, Qwen2ForCausalLM, ...)."""
        arch = (d.get("architectures") or ["LlamaForCausalLM"])[0]
        if not any(a in arch for a in ("Llama", "Qwen2", "Mistral")):
            raise ValueError(f"unsupported architecture {arch!r} (Llama-family decoders only)")
        max_pos = int(d.get("max_position_embeddings", 8192))
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"], num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or 0, rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=RopeScaling.from_hf(d.get("rope_scaling"), max_pos),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)), max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", "Qwen2" in arch)),
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos,
        )

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "ModelConfig":
        """Real shapes of public models (weights not included): for random-weight benchmarks."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r} (known: {sorted(PRESETS)})")
        return replace(PRESETS[name], **overrides)


PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, rope_theta=100000.0, tie_word_embeddings=True,
                                bos_token_id=1, eos_token_ids=(2,)),
    "llama-3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_heads=32, num_kv_heads=8, rope_theta=500000.0, eos_token_ids=(128009,),
                              rope_scaling=RopeScaling("llama3", 8.0, 8192, 1.0, 4.0)),
    "qwen2-0.5b": ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                              num_heads=14, num_kv_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6,
                              tie_word_embeddings=True, attention_bias=True, eos_token_ids=(151645,)),
}
