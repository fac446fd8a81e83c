"""How many draft nodes a step verifies: a fixed budget, or one chosen from a measured cost model.

Cost model: t(N) = seconds of one verify forward over N tokens in the batch, measured at start-up
on a grid of N and interpolated linearly (extrapolated from the last two points).

A step with bs requests padded to K nodes each (the root plus K - 1 draft nodes) costs t(bs * K)
and is expected to commit bs + c * sum_b sum_{i < K-1} p_b,i tokens, where p_b,i is the corpus's
path acceptance probability of request b's i-th best node and c calibrates those estimates
against what verification actually accepted. The policy picks the K with the most expected tokens
per second; K = 1 (plain decoding) is always a candidate, so with calibrated estimates a step is
never expected to be slower than plain decoding. Large batches, where t(bs * K) grows about
linearly in K, draft little or nothing: before drafting, the budget asked of the corpus is capped
at the largest K - 1 for which even fully accepted drafts would pay (K * t(bs) > t(bs * K)).
"""

from __future__ import annotations

from collections.abc import Callable

import bisect
from dataclasses import dataclass

import numpy as np


@dataclass
class CostModel:
    tokens: list[int]  # increasing
    seconds: list[float]

    def __post_init__(self) -> None:
        if len(self.tokens) < 2 or len(self.tokens) != len(self.seconds) or self.tokens != sorted(set(self.tokens)):
            raise ValueError(f"cost model: expected >= 2 increasing token counts with times, got {self.tokens}")
        # Measured times are noisy; a step over more tokens never costs less.
        self.seconds = list(np.maximum.accumulate(np.asarray(self.seconds, dtype=float)))

    def __call__(self, n: int) -> float:
        xs, ys = self.tokens, self.seconds
        i = min(max(bisect.bisect_left(xs, n), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(ys[0], y0 + (y1 - y0) * (n - x0) / (x1 - x0))

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "seconds": self.seconds}


class BudgetPolicy:
    """``fixed`` >= 0: always draft that many nodes per request (0 = no speculation).
    ``fixed`` None: adaptive within [0, max_budget] from ``cost`` and the calibration."""

    def __init__(self, max_budget: int, fixed: int | None = None, cost: CostModel | None = None) -> None:
        if fixed is None and cost is None:
            raise ValueError("an adaptive budget needs a cost model")
        if not 1 <= max_budget <= 63:
            raise ValueError(f"max_budget: expected 1..63 (K <= 64 tree nodes), got {max_budget}")
        if fixed is not None and not 0 <= fixed <= max_budget:
            raise ValueError(f"budget: expected 0..{max_budget}, got {fixed}")
        self.max_budget, self.fixed, self.cost = max_budget, fixed, cost
        self.predicted = 1.0  # decayed sums for the calibration c = accepted / predicted
        self.accepted = 1.0
        # Observed step time / modeled forward time, for plain and for speculative steps: the
        # host work a step adds (drafting, tree building, verification) is part of its cost.
        self.overhead = {False: 1.0, True: 1.0}
        self.node_bucket: Callable[[int], int] = lambda k: k  # tree size the forward really runs

    @property
    def calibration(self) -> float:
        return min(2.0, max(0.05, self.accepted / self.predicted))

    def draft_budget(self, bs: int) -> int:
        """Nodes per request to ask the corpus for (0 = do not draft this step)."""
        if self.fixed is not None:
            return self.fixed
        base = self.cost(bs)
        best = 0
        for k in range(2, self.max_budget + 2):
            if k * base > self.cost(bs * k):
                best = k - 1
        return best

    def choose_nodes(self, probs: list[np.ndarray]) -> int:
        """Per-request node count (the same K - 1 for all: the batch is padded to K anyway)."""
        if self.fixed is not None:
            return min(self.fixed, max((len(p) for p in probs), default=0))
        bs = len(probs)
        c = self.calibration
        longest = max((len(p) for p in probs), default=0)
        # gains[k] = expected accepted tokens with the k best nodes per request (probs are ranked
        # by the corpus; sorting keeps the bound honest if they are not).
        gains = np.zeros(longest + 1)
        for p in probs:
            s = np.cumsum(np.sort(np.asarray(p, dtype=float))[::-1])
            gains[1:len(s) + 1] += s
            gains[len(s) + 1:] += s[-1] if len(s) else 0.0
        rate = [(bs + c * gains[k]) / (self.cost(bs * self.node_bucket(k + 1)) * self.overhead[k > 0])
                for k in range(longest + 1)]
        return int(np.argmax(rate))

    def choose_nodes_rows(self, probs: np.ndarray, counts: np.ndarray) -> int:
        """``choose_nodes`` for [bs, W] padded probabilities (``counts[b]`` real, padding 0),
        without a loop over rows."""
        W = int(counts.max()) if counts.size else 0
        probs = probs[:, :W]
        bs = probs.shape[0]
        if self.fixed is not None:
            return min(self.fixed, W)
        c = self.calibration
        gains = np.zeros(W + 1)
        if bs and W:
            gains[1:] = np.cumsum(-np.sort(-probs.astype(np.float64), axis=1), axis=1).sum(axis=0)
        rate = [(bs + c * gains[k]) / (self.cost(bs * self.node_bucket(k + 1)) * self.overhead[k > 0])
                for k in range(W + 1)]
        return int(np.argmax(rate))

    def observe_step(self, speculative: bool, seconds: float, tokens: int) -> None:
        """One step's wall time against the cost model's forward time for its tokens in the batch."""
        if self.cost is None or seconds <= 0:
            return
        r = seconds / self.cost(tokens)
        self.overhead[speculative] = 0.9 * self.overhead[speculative] + 0.1 * min(r, 10.0)

    def observe(self, predicted: float, accepted: int) -> None:
        """One step's sum of path probabilities of the verified nodes vs draft tokens accepted."""
        decay = 0.98
        self.predicted = decay * self.predicted + predicted
        self.accepted = decay * self.accepted + accepted
