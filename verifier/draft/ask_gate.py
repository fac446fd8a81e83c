"""When a pipelined verifier asks the remote corpus for trees: by measured gain, not by default.

A pipelined remote step drafts from the in-process mirror (this verifier's requests and outputs)
and merges the remote corpus' tree asked one step earlier. The remote tree helps only where the
shared corpus knows what the mirror does not: other replicas' outputs, external corpora. Each ask
costs the host a round trip to handle and a merge, and on the H200 (SmolLM2, batch 1) remote
drafting that asked every step ran at a median 0.94x the in-process corpus, while the same runs
without asks ran at 0.98-1.10x (docs/history/2026-12.md). On one replica with nothing else in the
corpus, the remote trees added no accepted token at all (bench/fleet.py measures it).

So the drafter counts, per merged step, the accepted tokens only the remote tree drafted (the
merge marks those nodes: ``DraftBatch.earlier_only``) against the tokens the step delivered. Over
each window of ``window_tokens`` delivered tokens, a share below ``min_gain`` doubles the interval
between asks (up to ``max_interval`` steps); a share at or above it, in a window or in any single
step, asks every step again. Whether the fleet knows a request's continuation is mostly a property
of that request, so the drafter also asks, whatever the interval and for them alone: about every new
request on its first drafting step (at large batch new requests join nearly every step), and about
every request whose remote trees added accepted tokens, until several of its asked steps in a row
add none (``verifier.draft.drafter.HOT_ASKS``). The gate itself learns from the other requests.
Commits flow to the corpus either way (the drafter hands them to the client at least every
``HOLD_CALLS_S`` while the engine steps, and the client sends what it holds at least every
``FLUSH_AFTER_S``), so other replicas keep learning from this one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AskGateConfig:
    # Accepted tokens only remote trees drafted, as a share of the tokens that merged steps
    # delivered, that keeps asks on every step. 0.02: about what an ask costs a batch-1 step
    # on the H200 (above), so asking pays where the gain is at least that.
    min_gain: float = 0.02
    window_tokens: int = 256  # delivered tokens per decision (batch 1: about 90 steps)
    max_interval: int = 32  # steps between asks at most (probes: H200 batch 1, ~30 ms)

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_gain <= 1.0:
            raise ValueError(f"min_gain: expected 0..1, got {self.min_gain}")
        if self.window_tokens < 1:
            raise ValueError(f"window_tokens: expected >= 1, got {self.window_tokens}")
        if self.max_interval < 1:
            raise ValueError(f"max_interval: expected >= 1, got {self.max_interval}")


class AskGate:
    """Decides, step by step, whether to ask the remote corpus (``ask``), from what merged steps
    gained (``observe``)."""

    def __init__(self, config: AskGateConfig | None = None) -> None:
        self.config = config or AskGateConfig()
        self.interval = 1  # ask every interval-th step
        self._waited = 0  # steps since the last ask
        self._tokens = 0  # this window's delivered tokens and remote-only accepted tokens
        self._gain = 0

    def ask(self) -> bool:
        """Called once per step that could ask: whether it does."""
        self._waited += 1
        if self._waited >= self.interval:
            self._waited = 0
            return True
        return False

    def observe(self, delivered: int, gain: int) -> None:
        """A merged step delivered ``delivered`` tokens, ``gain`` of them accepted only from the
        remote tree."""
        if delivered <= 0:
            return
        c = self.config
        if gain >= c.min_gain * delivered and gain > 0:
            self.interval, self._tokens, self._gain = 1, 0, 0  # the remote corpus pays now
            return
        self._tokens += delivered
        self._gain += gain
        if self._tokens >= c.window_tokens:
            if self._gain >= c.min_gain * self._tokens and self._gain > 0:
                self.interval = 1
            else:
                self.interval = min(2 * self.interval, c.max_interval)
            self._tokens, self._gain = 0, 0
