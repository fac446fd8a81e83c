"""Makespan-aware drafting for batches that end together (RL rollouts: a step waits for its longest
sample).

A rollout batch's wall time is its makespan: the time until its last request ends. Near the end a
few long requests run alone (the tail); each step then costs about a plain decode step's fixed GPU
time whatever its tree size, so those requests should draft as deep and wide as the engine allows,
and the longest requests should start first. Two rules, both off by default (a server's requests
do not end together):

- ``tail_requests`` > 0: while no request waits and at most that many run, a step drafts
  ``tail_budget`` nodes per request (0: the engine's max_budget), whatever the batch's budget is
  otherwise (``--budget 6 --max-budget 15 --tail-requests 4``: 6 nodes in the bulk, 15 in the tail).
- ``critical_path``: the budget policy compares drafting with plain decoding by what drafting gains
  the request expected to end last, not the batch's mean (``critical_acceptance``). A batch's
  makespan is that request's steps times the step time; drafting makes every step dearer, so it pays
  only where that request's tokens per drafting step beat the steps' cost ratio. In the lockstep
  replay of the dev rollout traces (``bench/rollouts.py replay``, B = 15) the epoch's last request
  needed 1.13-1.18x fewer rounds than tokens at T = 1.0 (the batch's MAT: 1.74), 1.93-1.95x at
  T = 0.7 (MAT 3.04).
- ``longest_first``: waiting requests are admitted longest expected first (LPT, the classic
  makespan rule), the expectation being the mean output length of the request's prompt key's
  rollouts in the corpus' prompt history (``NgramCorpus.prompt_history``; requests without history
  keep their order, after those with it). With a corpus service, the history read is the verifier's
  in-process mirror's: this replica's own rollouts of the key. On the dev rollout traces it does not
  pay (docs/rollout_frontend.md: a sample's length varies too much within its prompt), so it is
  off everywhere by default.

``MakespanClock`` measures busy periods: from the first request of an idle engine until no request
is left; the last one is the batch's makespan (``/metrics``: ngram_verifier_last_makespan_seconds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from corpus_service import NgramCorpus, default_prompt_key


@dataclass(frozen=True, slots=True)
class MakespanConfig:
    tail_requests: int = 0  # 0 = off
    tail_budget: int = 0  # 0 = the engine's max_budget
    longest_first: bool = False
    critical_path: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.tail_requests, bool) or not 0 <= self.tail_requests <= 4096:
            raise ValueError(f"tail_requests: expected an int 0..4096 (0 = off), got {self.tail_requests!r}")
        if isinstance(self.tail_budget, bool) or not 0 <= self.tail_budget <= 63:
            raise ValueError(f"tail_budget: expected an int 0..63 (0 = max_budget), got {self.tail_budget!r}")


def expected_length(corpus: NgramCorpus, prompt_ids: list[int], prompt_key: str | None) -> float | None:
    """The mean output length of the key's rollouts in the corpus' history (None: no history).
    Only rollouts of the newest version present count: a changed policy writes differently long."""
    history = corpus.prompt_history(prompt_key if prompt_key is not None else default_prompt_key(prompt_ids))
    if not history:
        return None
    newest = max(v for v, _ in history)
    lengths = [n for v, n in history if v == newest]
    return sum(lengths) / len(lengths)


# Drafting steps of prior weight: a request's own tokens per drafting step are shrunk toward the
# batch's mean until it has some of its own. The request expected to end last is the one whose
# figure is lowest (for equal lengths left), and the lowest of 100+ noisy few-step means is a
# pessimist: without a prior, the estimate early in an epoch is the unluckiest request's, not the
# slowest one's.
PRIOR_STEPS = 16.0


def critical_acceptance(requests, mean: float | None) -> float | None:
    """Tokens per drafting step of the request expected to end last among ``requests`` (engine
    requests: ``spec_steps``, ``accepted_tokens``, ``output_ids``, ``params.max_tokens``): each
    request's own figure (one token per drafting step plus the drafts it accepted) shrunk toward
    ``mean`` (the batch's) by PRIOR_STEPS, and its steps left as its tokens left to max_tokens over
    that figure. None for no requests, or no positive mean (None: the batch has no drafting steps
    yet). The length left is an upper bound (a sample may stop earlier): rollouts that run to
    max_tokens are the ones that set a batch's makespan."""
    if mean is None or not mean > 0:
        return None
    prior = PRIOR_STEPS * mean
    best, crit = -1.0, None
    for r in requests:
        a = (r.spec_steps + r.accepted_tokens + prior) / (r.spec_steps + PRIOR_STEPS)
        left = (r.params.max_tokens - len(r.output_ids)) / a
        if left > best:
            best, crit = left, a
    return crit


@dataclass
class MakespanClock:
    """Busy periods of an engine: ``busy`` is called after each step with whether work is left."""

    periods: int = 0
    last_s: float = 0.0  # the last finished busy period's length (a batch's makespan)
    _since: float | None = None

    def start(self) -> None:
        if self._since is None:
            self._since = time.monotonic()

    def busy(self, left: bool) -> None:
        if not left and self._since is not None:
            self.last_s = time.monotonic() - self._since
            self.periods += 1
            self._since = None

    @property
    def current_s(self) -> float:
        """The running busy period's length so far (0 when idle)."""
        return 0.0 if self._since is None else time.monotonic() - self._since
