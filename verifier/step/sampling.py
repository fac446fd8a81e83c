"""Sampling parameters and the target distribution they define.

With temperature T, top-k k and top-p p the target is q = softmax(logits / T) restricted to the k
most likely tokens and to the smallest set whose mass reaches p, renormalised. Both truncations
are a floor on the logits (``truncation_floor``): every token tied with the last one kept stays,
as in vLLM's and SGLang's top-k, so q does not depend on how a sort orders ties. Tree rejection
sampling against this q is exact: the output is distributed as plain sampling from q.
Temperature 0 means greedy (argmax).

Penalties and ``min_tokens`` change the logits before any of this (``verifier.step.penalties``), per
tree node with the tokens on the node's path counted, so speculation keeps them exact too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .structured_spec import GrammarSpec

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    speculate: bool = True  # False: plain decoding for this request (no drafts)
    presence_penalty: float = 0.0  # OpenAI: minus this for each token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # CTRL/HF: logits of prompt or output tokens / this (x this if < 0)
    min_tokens: int = 0  # eos and stop_token_ids are masked (stop strings unchecked) before this many
    logprobs: int | None = None  # None: off; k >= 0: each token's logprob and the k most likely tokens
    grammar: GrammarSpec | None = None  # structured output: the grammar every token obeys (verifier.step.grammar)
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature: expected a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed: expected an int in [0, 2^63), got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > 16:
            raise ValueError(f"stop: expected up to 16 non-empty strings, got {len(stop)}")
        bad = next((i for i, s in enumerate(stop) if not isinstance(s, str) or not s), None)
        if bad is not None:
            raise ValueError(f"stop: expected up to 16 non-empty strings, got {type(stop[bad]).__name__} "
                             f"{stop[bad]!r:.40} at index {bad}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name}: expected a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not 0.0 < rp <= 10.0:
            raise ValueError(f"repetition_penalty: expected a number in (0, 10], got {rp!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: expected an int in [0, max_tokens ({self.max_tokens})], got {self.min_tokens!r}")
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs: expected None or an int in [0, {MAX_TOP_LOGPROBS}], got {lp!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar: expected a GrammarSpec, got {type(self.grammar).__name__}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0


def truncation_floor(logits: Tensor, temperature: Tensor, top_k: Tensor | None = None,
                     top_p: Tensor | None = None) -> Tensor:
    """The per-row floor of top-k and top-p (None: off) on logits [N, V]: a token is kept iff its
    logit is >= the floor (float32 [N]; -inf where nothing is truncated, for greedy rows, temperature 0, and
    for rows holding a NaN or an infinity). With x sorted descending, top-k's floor is x_(k), the
    k-th largest; top-p's is x_(m), m the first index where the cumulative softmax(x / T) over
    what top-k kept reaches p; the floor is the larger. The torch reference of the kernel
    ``verifier.kernels.logit_floor`` (which sums masses in fixed point, in another order: the two
    can differ only where the cumulative mass is within rounding of p). No device sync: the
    processed path calls it inside a step."""
    x = logits.float()
    N, V = x.shape
    k = torch.zeros(N, dtype=torch.int64, device=x.device) if top_k is None else top_k.to(x.device, torch.int64)
    p = torch.ones(N, device=x.device) if top_p is None else top_p.to(x.device, torch.float32)
    t = temperature.to(device=x.device, dtype=torch.float32)
    use_k, use_p = (k > 0) & (k < V), p < 1.0
    # Every row is computed and the rows without a floor masked at the end: no device sync.
    active = (use_k | use_p) & (t > 0) & torch.isfinite(x).all(-1)
    xs = x.sort(dim=-1, descending=True).values
    floor_k = xs.gather(1, (torch.where(use_k, k, V) - 1)[:, None]).squeeze(1)
    scaled = (xs - xs[:, :1]) / torch.where(t > 0, t, 1.0)[:, None]
    cum = scaled.exp().masked_fill(xs < floor_k[:, None], 0.0).cumsum(-1)
    m = (cum < p[:, None] * cum[:, -1:]).sum(-1).clamp(max=V - 1)  # the first index reaching p
    floor_p = torch.where(use_p, xs.gather(1, m[:, None]).squeeze(1), float("-inf"))
    floor = torch.maximum(torch.where(use_k, floor_k, float("-inf")), floor_p)
    return torch.where(active, floor, float("-inf"))


def target_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                 truncated: bool | None = None) -> Tensor:
    """logits [N, V]; per-row temperature (> 0), top_k (0 = off), top_p [N] -> probs [N, V] float32.

    ``truncated``: whether any row has a top_k below V or a top_p below 1, where the caller knows it
    on the host (None: read from the tensors, a device sync). Without truncation the distribution is
    the softmax itself: no sort of every row (a speculative step of 134 requests x 16 nodes over a
    49k vocabulary sorts 105 M values for nothing)."""
    raw = logits.float()
    scaled = raw / temperature[:, None]
    V = raw.shape[-1]
    if truncated is None:
        truncated = bool((((top_k > 0) & (top_k < V)) | (top_p < 1.0)).any())
    if not truncated:
        return scaled.softmax(-1)
    floor = truncation_floor(raw, temperature, top_k, top_p)
    return scaled.masked_fill(raw < floor[:, None], float("-inf")).softmax(-1)


def sample(probs: Tensor, coins: Tensor) -> Tensor:
    """Inverse-CDF draw: probs [N, V], coins [N] in [0, 1) -> token ids [N]."""
    cdf = probs.double().cumsum(-1)
    u = coins.double() * cdf[:, -1]
    return torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)
