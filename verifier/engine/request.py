"""One generation request: its tokens, KV-cache slot, stop conditions and speculative statistics."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..step.logprobs import TokenLogprob
from ..step.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class CoinStream:
    """A sampled request's uniform draws (float32 in [0, 1)) from its own seeded generator, taken in
    blocks. Torch's CPU generator draws float32 uniforms one after another whatever the size of the
    call (tests/verifier/engine/test_coins.py), so a block gives exactly the values that one call per
    need would, at one call per ``BLOCK`` values instead of two per request and step (at 134 requests
    those calls were ~0.6 ms of a step's host time on the H200 host). ``BLOCK`` floats per request."""

    BLOCK = 256

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)
        self._buf = np.empty(0, dtype=np.float32)
        self._pos = 0

    def take(self, n: int) -> np.ndarray:
        """The next n draws (a view: copy before the next call if kept)."""
        if self._pos + n > len(self._buf):
            rest = self._buf[self._pos:]
            fresh = torch.rand(max(self.BLOCK, n - len(rest)), generator=self.generator).numpy()
            self._buf, self._pos = np.concatenate([rest, fresh]), 0
        out = self._buf[self._pos:self._pos + n]
        self._pos += n
        return out


@dataclass
class Request:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_update: Callable[["Request"], None] | None = None  # called from the engine thread
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    slot: int = -1
    cache_len: int = 0  # tokens whose K/V are in the cache (the last output token is not yet)
    coins: CoinStream | None = None  # a sampled request's random draws (seeded)
    verify_steps: int = 0
    draft_tokens: int = 0  # draft nodes verified
    accepted_tokens: int = 0  # draft tokens accepted
    spec_steps: int = 0  # steps that verified drafts of this request (each committed 1 + what it accepted)
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    text: str = ""  # decoded output, truncated at a stop string when one matched
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token if params.logprobs is set
    grammar: Any = None  # verifier.step.grammar.GrammarMatcher when params.grammar is set (structured output)
    penalty_state: Any = None  # verifier.step.penalties: its serial, which its slot's row of PenaltyCounts holds
    group: str | None = None  # corpus request group: the n samples of one API request draft from each other
    # The corpus' prompt history (corpus_service/engine/prompt_keys.py): the key this request is a
    # sample of (None: a hash of its prompt ids) and the policy version sampling it (None: the
    # namespace's current).
    prompt_key: str | None = None
    policy_version: int | None = None
    expected_len: float | None = None  # output tokens its key's history leads to expect (verifier/budget/makespan.py)
    # Fixed by Engine.add_request from the params and the grammar: the verify step reads them per
    # request and step, where deriving them again took calls and a dict lookup each. The defaults
    # take the general path, which is right for any request.
    as_run: bool = False  # its commits may take append_run: no stop strings, grammar or logprobs
    stops: frozenset[int] = frozenset()  # append_run's stop tokens (stop_tokens of its params)
    plain_greedy: bool = False  # greedy, no grammar, no penalties: a fast step once min_tokens are out

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def cumulative_logprob(self) -> float:
        return sum(t.logprob for t in self.logprobs)


def append_tokens(req: Request, tokens: list[int], eos_ids: tuple[int, ...], decode: Callable[[list[int]], str]) -> None:
    """Appends committed tokens one at a time, stopping at eos, a stop token, a stop string or
    max_tokens; tokens after the stop are dropped (their K/V die with the request). The eos token
    stays in output_ids (it was generated) but not in the text (special tokens are skipped).
    Stop strings count only once min_tokens tokens exist (eos and stop tokens are masked before:
    ``verifier.step.penalties``)."""
    p = req.params
    for tok in tokens:
        req.output_ids.append(int(tok))
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        if (not p.ignore_eos and tok in eos_ids) or tok in p.stop_token_ids:
            _finish(req, "stop", decode)
            return
        if p.stop and len(req.output_ids) < p.min_tokens:
            req.text = decode(req.output_ids)
        elif p.stop:
            text = decode(req.output_ids)
            hits = [text.find(s, max(0, len(req.text) - len(s))) for s in p.stop]
            hits = [h for h in hits if h >= 0]
            if hits:
                req.text = text[:min(hits)]
                req.status, req.finish_reason, req.finished_at = Status.FINISHED, "stop", time.monotonic()
                return
            req.text = text
        if len(req.output_ids) >= p.max_tokens:
            _finish(req, "length", decode)
            return


def stop_tokens(params: SamplingParams, eos_ids: tuple[int, ...]) -> frozenset[int]:
    """The tokens that end a request where they appear: eos (unless ignore_eos) and stop_token_ids."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))


def append_run(req: Request, tokens: list[int], stops: frozenset[int], decode: Callable[[list[int]], str]) -> int:
    """``append_tokens`` for a request without stop strings (``stops``: ``stop_tokens`` of its
    params): the tokens up to the first stop token or max_tokens appended as one slice, not one at
    a time (a verify step commits a run of accepted tokens per request, every request every step).
    Returns how many were appended."""
    p = req.params
    out = req.output_ids
    take = tokens[:p.max_tokens - len(out)]
    reason = None
    if not stops.isdisjoint(take):
        for j, tok in enumerate(take):
            if tok in stops:
                take, reason = take[:j + 1], "stop"
                break
    if take and req.first_token_at is None:
        req.first_token_at = time.monotonic()
    out.extend(take)
    if reason is None and len(out) >= p.max_tokens:
        reason = "length"
    if reason is not None:
        _finish(req, reason, decode)
    return len(take)


def _finish(req: Request, reason: str, decode: Callable[[list[int]], str]) -> None:
    req.text = decode(req.output_ids)
    req.status, req.finish_reason, req.finished_at = Status.FINISHED, reason, time.monotonic()
