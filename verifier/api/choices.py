"""What the routes say about generated samples: OpenAI's two logprobs shapes, best_of selection,
per-choice errors and usage.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; chat:
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``. A token's string is its
own decoding (an incomplete UTF-8 character shows as U+FFFD; ``bytes`` are that string's UTF-8).
"""

from __future__ import annotations

import math

from ..engine.request import Request
from ..step.logprobs import TokenLogprob

LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for -inf (JSON has no infinity)
INTERNAL_ERROR = "internal error"  # Engine.fail_all's prefix: the server failed, not the request


def _lp(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


class TokenStrings:
    """Each token id's own string, decoded once."""

    def __init__(self, decode) -> None:
        self.decode, self._cache = decode, {}

    def __call__(self, token: int) -> str:
        s = self._cache.get(token)
        if s is None:
            s = self._cache[token] = self.decode([token])
        return s


def completion_logprobs(lps: list[TokenLogprob], tok: TokenStrings, offset: int = 0) -> dict:
    """OpenAI completions shape; ``offset``: characters of text before the first token."""
    tokens = [tok(t.token) for t in lps]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [_lp(t.logprob) for t in lps],
            "top_logprobs": [{tok(i): _lp(v) for i, v in t.top} for t in lps], "text_offset": offsets}


def chat_logprobs(lps: list[TokenLogprob], tok: TokenStrings) -> dict:
    def entry(token: int, logprob: float) -> dict:
        s = tok(token)
        return {"token": s, "logprob": _lp(logprob), "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                        for t in lps]}


def best_of(reqs: list[Request], n: int) -> list[Request]:
    """The n samples with the highest cumulative logprob (OpenAI's best_of), in submission order
    when n equals the number of samples."""
    if n >= len(reqs):
        return reqs
    ranked = sorted(range(len(reqs)), key=lambda i: -reqs[i].cumulative_logprob)
    return [reqs[i] for i in ranked[:n]]


def failed_internally(reqs: list[Request]) -> str | None:
    """The error message when every sample failed because the engine did (HTTP 500)."""
    if reqs and all(r.finish_reason == "error" and (r.error or "").startswith(INTERNAL_ERROR) for r in reqs):
        return reqs[0].error
    return None


def usage(reqs: list[Request]) -> dict:
    """Prompt tokens once; completion tokens and speculation counters summed over the samples."""
    steps = sum(r.verify_steps for r in reqs)
    accepted = sum(r.accepted_tokens for r in reqs)
    prompt = len(reqs[0].prompt_ids)
    completion = sum(len(r.output_ids) for r in reqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "verify_steps": steps, "draft_tokens": sum(r.draft_tokens for r in reqs),
            "accepted_draft_tokens": accepted,
            "mean_accepted_tokens": round((steps + accepted) / steps, 4) if steps else 0.0}
