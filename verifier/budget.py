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

The model only knows GPU time. A step's host work (drafting, tree packing, committing tokens:
Python per request) is not in it, and at large batches it dominates: on the H200 a SmolLM2 step of
64 requests took 4.7 ms of wall time plain and about 14 ms speculative, against 1.6 and 4 ms of
forward. So the policy also keeps what steps really delivered, committed tokens per second of wall
time, per batch-size bucket (powers of two) and mode (drafting or not). Where drafting steps have
delivered less than plain ones (by more than 3%: drafting's gains come in bursts), it does not
draft, except for one step in ``explore_every`` (a run of ``explore_run`` plain steps; four times
fewer when one mode leads by 25%) that keeps the losing mode's figure current; so speculation that
costs more than it brings turns itself off, and back on when it pays again (a smaller batch, better
drafts). Plain steps of a speculative engine run one step ahead of the host (overlapped); their
figure is that steady state, not the cost of switching into it and out of it (a lone plain step
between drafting ones waits for its own results: at batch 64 on the H200 it delivered 20k tok/s
where a run of plain steps delivers 28k, which kept drafting on where it lost).
"""

from __future__ import annotations

from collections.abc import Callable

import bisect
import itertools
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
        self._step_costs: dict[int, list[float]] = {}  # per batch size: cost(bs * node_bucket(k + 1)), k = 0..max_budget
        self._budgets: dict[int, int] = {}  # per batch size: draft_budget's largest worthwhile budget
        self.node_bucket = lambda k: k  # tree size the forward really runs
        # Realized committed tokens per second, by (batch-size bucket, drafted): decayed sums.
        self.explore_every = 16
        # Consecutive plain steps per exploration turn (drafting's: one). An engine whose plain
        # steps overlap the host raises it (their first step only restarts the pipeline); a plain
        # step that does not overlap shows its cost alone.
        self.explore_run = 1
        self._delivered: dict[tuple[int, bool], list[float]] = {}
        self._steps_at: dict[int, int] = {}  # steps seen per bucket: paces the exploration
        self._prefers: dict[int, bool] = {}  # per bucket: whether drafting is the preferred mode
        # How each step was decided, per bucket (decision_counts): for the benchmark's record.
        self._decisions: dict[tuple[int, str], int] = {}

    @property
    def node_bucket(self) -> Callable[[int], int]:
        return self._node_bucket

    @node_bucket.setter
    def node_bucket(self, fn: Callable[[int], int]) -> None:
        self._node_bucket = fn
        self._step_costs.clear()

    @staticmethod
    def batch_bucket(bs: int) -> int:
        return 1 << max(0, bs - 1).bit_length()

    def delivered(self, bs: int, drafted: bool) -> float | None:
        """Committed tokens per second that steps of this bucket and mode delivered (None: none yet)."""
        d = self._delivered.get((self.batch_bucket(bs), drafted))
        return None if d is None else d[0] / d[1]

    def delivered_rates(self) -> dict[str, float]:
        """Every figure kept, as {"<bucket>_drafted" | "<bucket>_plain": committed tokens/s}."""
        return {f"{b}_{'drafted' if d else 'plain'}": v[0] / v[1] for (b, d), v in sorted(self._delivered.items())
                if v[1] > 0}

    def drafting_pays(self, bs: int) -> bool:
        """False where drafting steps of this batch size have delivered less than plain ones,
        except on exploration steps (per ``explore_every`` of this bucket's steps, one drafting
        step or ``explore_run`` plain ones run the mode that is losing, or has no figure yet)."""
        b = self.batch_bucket(bs)
        n = self._steps_at.get(b, 0)
        self._steps_at[b] = n + 1
        spec, plain = self.delivered(bs, True), self.delivered(bs, False)
        # A clear winner (25% apart) is re-checked four times less often: exploring costs a step
        # of the losing mode each time.
        every = self.explore_every
        if spec is not None and plain is not None and max(spec, plain) > 1.25 * min(spec, plain):
            every *= 4
        # Plain steps are explored in runs: an overlapped plain step only shows its steady cost
        # after the one that restarts the pipeline (observe_delivered's callers skip that one and
        # the drain before the next drafting step: switching costs are exploration's, not plain's).
        # Drafting steps are not overlapped, so one shows what drafting costs.
        if spec is None or plain is None:
            # Start by drafting; measure plain steps on the exploration turns.
            self._prefers[b] = True
            drafts = spec is None or n % every < every - self.explore_run
            self._count(b, "start_draft" if drafts else "start_plain")
            return drafts
        # Drafting's gains come in bursts (a copied passage accepts 8 tokens, most steps accept
        # none), so it keeps the lead unless plain is ahead by more than 3%.
        prefers = spec >= 0.97 * plain
        self._prefers[b] = prefers
        explore = n % every >= every - (self.explore_run if prefers else 1)
        drafts = prefers != explore
        self._count(b, ("explore_" if explore else "") + ("draft" if drafts else "plain"))
        return drafts

    def _count(self, bucket: int, kind: str) -> None:
        key = (bucket, kind)
        self._decisions[key] = self._decisions.get(key, 0) + 1

    def decision_counts(self) -> dict[str, int]:
        """Steps per "<bucket>_<how>": how the delivered-rate rule decided them (``start_draft`` /
        ``start_plain``: the bucket lacked a figure; ``draft`` / ``plain``: the leading mode;
        ``explore_draft`` / ``explore_plain``: an exploration step), and ``nodes0``: drafting steps
        whose node choice verified no draft node (the drafts did not pay for their cost)."""
        return {f"{b}_{k}": n for (b, k), n in sorted(self._decisions.items())}

    @property
    def calibration(self) -> float:
        return min(2.0, max(0.05, self.accepted / self.predicted))

    def draft_budget(self, bs: int) -> int:
        """Nodes per request to ask the corpus for (0 = do not draft this step)."""
        if self.fixed is not None:
            return self.fixed
        if not self.drafting_pays(bs):
            return 0
        best = self._budgets.get(bs)
        if best is None:  # the cost model is fixed: once per batch size
            base, best = self.cost(bs), 0
            for k in range(2, self.max_budget + 2):
                if k * base > self.cost(bs * k):
                    best = k - 1
            self._budgets[bs] = best
        return best

    def choose_nodes(self, probs: list[np.ndarray]) -> int:
        """Per-request node count (the same K - 1 for all: the batch is padded to K anyway)."""
        if self.fixed is not None:
            return min(self.fixed, max((len(p) for p in probs), default=0))
        bs = len(probs)
        longest = max((len(p) for p in probs), default=0)
        # gains[k] = expected accepted tokens with the k best nodes per request (probs are ranked
        # by the corpus; sorting keeps the bound honest if they are not).
        gains = np.zeros(longest + 1)
        for p in probs:
            s = np.cumsum(np.sort(np.asarray(p, dtype=float))[::-1])
            gains[1:len(s) + 1] += s
            gains[len(s) + 1:] += s[-1] if len(s) else 0.0
        return self._best_nodes(bs, gains.tolist())

    def choose_nodes_rows(self, probs: np.ndarray, counts: np.ndarray, best_first: bool = False) -> int:
        """``choose_nodes`` for [bs, W] padded probabilities (``counts[b]`` real, padding 0),
        without a loop over rows. ``best_first``: every row's probabilities are non-increasing
        (the corpus ranks nodes so), so a row's k best nodes are its first k and no sort is needed."""
        W = int(counts.max()) if counts.size else 0
        bs = probs.shape[0]
        if self.fixed is not None:
            return min(self.fixed, W)
        if not (bs and W):
            return 0
        probs = probs[:, :W]
        if best_first:  # gains[k] = the first k columns' sum (padding is 0)
            col = probs.sum(axis=0, dtype=np.float64)
        else:
            col = np.sort(probs.astype(np.float64), axis=1)[:, ::-1].sum(axis=0)
        return self._best_nodes(bs, [0.0, *itertools.accumulate(col.tolist())])

    def choose_nodes_summary(self, bs: int, nodes: int, column_sums: list[float]) -> int:
        """``choose_nodes_rows`` from a summary of the rows (``corpus_service._native.summarize_rows``:
        the widest row's node count and, per column, the sum of the rows' j-th best probabilities)."""
        if self.fixed is not None:
            return min(self.fixed, nodes)
        if not (bs and nodes):
            return 0
        return self._best_nodes(bs, [0.0, *itertools.accumulate(column_sums)])

    def _best_nodes(self, bs: int, gains: list[float]) -> int:
        """The k (0 .. len(gains) - 1) with the most expected tokens per second: bs + c gains[k]
        (gains[k]: the k best nodes' probabilities summed over the batch, c the calibration) over
        the step's modeled time with k nodes per request (its tree bucket, and the host overhead
        observed for plain or speculative steps). Plain Python: some 16 numbers, where numpy's
        per-call cost would be most of the step's host time at batch 1."""
        costs = self._step_costs.get(bs)
        if costs is None:  # the cost model and the buckets are fixed: once per batch size
            costs = self._step_costs[bs] = [self.cost(bs * self.node_bucket(k + 1)) for k in range(self.max_budget + 1)]
        c, plain, spec = self.calibration, self.overhead[False], self.overhead[True]
        best, best_rate = 0, bs / (costs[0] * plain)
        for k in range(1, min(len(gains), len(costs))):
            rate = (bs + c * gains[k]) / (costs[k] * spec)
            if rate > best_rate:  # the first of equal rates, as argmax
                best, best_rate = k, rate
        if best == 0:
            self._count(self.batch_bucket(bs), "nodes0")
        return best

    def observe_step(self, speculative: bool, seconds: float, tokens: int) -> None:
        """One step's wall time against the cost model's forward time for its tokens in the batch."""
        if self.cost is None or seconds <= 0:
            return
        r = seconds / self.cost(tokens)
        self.overhead[speculative] = 0.9 * self.overhead[speculative] + 0.1 * min(r, 10.0)

    def observe_delivered(self, bs: int, drafted: bool, seconds: float, committed: int) -> None:
        """One step's committed tokens and wall time (drafting and committing included). ``drafted``:
        the step asked the corpus for drafts (its cost is paid even if no node was verified)."""
        if seconds <= 0:
            return
        d = self._delivered.setdefault((self.batch_bucket(bs), drafted), [0.0, 0.0])
        # The preferred mode's figure averages over about 20 steps (drafting's bursts); the other
        # mode is seen once in explore_every steps, so a few of those must be able to flip it.
        decay = 0.95 if drafted == self._prefers.get(self.batch_bucket(bs), True) else 0.7
        d[0] = decay * d[0] + committed
        d[1] = decay * d[1] + seconds

    def observe(self, predicted: float, accepted: int) -> None:
        """One step's sum of path probabilities of the verified nodes vs draft tokens accepted."""
        decay = 0.98
        self.predicted = decay * self.predicted + predicted
        self.accepted = decay * self.accepted + accepted
