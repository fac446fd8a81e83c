"""Log-probabilities of emitted tokens, read from the rows of the verify step's accepted path.

Emitted token j of a step (accepted draft tokens, then the bonus token) was chosen from the
logits of accepted-path node j (node 0 = the root), the same logits plain decoding computes for
that position, so speculative and plain logprobs agree up to float rounding. The distribution is
the model's after penalties and ``min_tokens`` (``verifier.step.penalties``), before temperature,
top-k and top-p (temperature 0 would leave nothing to report).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens, best first (len = params.logprobs)


def row_logprobs(rows: Tensor, tokens: list[int], top_k: list[int]) -> list[TokenLogprob]:
    """rows [R, V] logits; tokens [R] chosen from them; top_k[r] alternatives wanted for row r."""
    if not tokens:
        return []
    lp = torch.log_softmax(rows.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.int64, device=rows.device)[:, None])[:, 0]
    k = min(max(top_k), lp.shape[-1])
    top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
    chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
    return [TokenLogprob(t, c, tuple(zip(ti[:n], tv[:n])))
            for t, c, tv, ti, n in zip(tokens, chosen, top_v, top_i, top_k)]
