"""The verify cost model: seconds of one forward against tokens in the batch, kept current by the
steps the engine really runs.

The start-up probe (``verifier.budget.cost_probe``) measures t(N) on a grid of N (1, 2, 4, ...); the
model interpolates linearly between grid points and extrapolates from the last two. A probe is a
few seconds of one moment: on a loaded 2-core CPU it measured 1 token at 232-506 ms and 2 tokens
at 1,538-1,577 ms, and a model that kept those figures never drafted again. So every verify step's
forward time is an observation: per grid bucket (the grid point and the sizes just below it),
the model keeps the latest observations as ratios to the probe's figure at their size, and the
bucket's figure becomes the probe's times the median ratio once it has ``MIN_OBS`` recent ones. A
bucket that steps do not visit is interpolated between the visited buckets around it, or beyond
them takes the nearest one's ratio (the probe's shape, at the level the machine shows now); and
observations older than ``STALE_OBS`` steps no longer count, so a figure measured in a slow spell
does not outlive it for long. The figures stay monotone (a weighted pool-adjacent-violators fit: a
bucket's weight is its number of observations, so one noisy unobserved figure cannot lift every
larger size, as a running maximum would).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

OBS_WINDOW = 16  # observations kept per bucket
MIN_OBS = 3  # a bucket's own ratio needs this many recent observations (a median of 1-2 is a guess)
# Observations (of any bucket) after which one no longer counts: a tree size that steps rarely
# choose keeps no figure from a slow spell for long (a CPU demo measured 8 tokens at 475 ms in one,
# 62 ms out of it); it falls back to the probe's shape at its neighbours' level, and is measured again
# if chosen.
STALE_OBS = 128
REFIT_EVERY = 16  # observations between refits: a refit costs some 30 us, a batch-1 H200 step ~1 ms
MIN_CHANGE = 0.02  # a refit that moves no figure by more than this keeps the model's version


def monotone_fit(ys: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence nearest to ``ys`` in weighted least squares (pool adjacent
    violators): a dip is averaged with its neighbours by weight instead of being lifted."""
    blocks: list[list[float]] = []  # [value, weight, count]
    for y, w in zip(ys, weights):
        blocks.append([y, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            y2, w2, n2 = blocks.pop()
            b = blocks[-1]
            b[0] = (b[0] * b[1] + y2 * w2) / (b[1] + w2)
            b[1] += w2
            b[2] += n2
    return [y for y, _, n in blocks for _ in range(int(n))]


def _interpolate(xs: list[int], ys: list[float], n: float) -> float:
    i = min(max(bisect.bisect_left(xs, n), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(ys[0], y0 + (y1 - y0) * (n - x0) / (x1 - x0))


@dataclass
class CostModel:
    tokens: list[int]  # increasing
    seconds: list[float]  # the current figures (the probe's until steps are observed)
    probed: list[float] = field(init=False)  # the start-up probe's figures, as fitted
    version: int = field(init=False, default=0)  # bumped whenever refit changes the figures
    observations: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if len(self.tokens) < 2 or len(self.tokens) != len(self.seconds) or self.tokens != sorted(set(self.tokens)):
            raise ValueError(f"cost model: expected >= 2 increasing token counts with times, got {self.tokens}")
        if not all(s > 0 for s in self.seconds):  # NaN fails this too
            raise ValueError(f"cost model: expected times > 0, got {self.seconds}")
        self.tokens = [int(t) for t in self.tokens]
        # Measured times are noisy; a step over more tokens never costs less.
        self.seconds = monotone_fit([float(s) for s in self.seconds], [1.0] * len(self.seconds))
        self.probed = list(self.seconds)
        self._obs: list[deque[tuple[int, float]]] = [deque(maxlen=OBS_WINDOW) for _ in self.tokens]

    def __call__(self, n: int) -> float:
        return _interpolate(self.tokens, self.seconds, n)

    def bucket(self, n: int) -> int:
        """The grid index whose bucket holds n tokens: (tokens[i - 1], tokens[i]], the last one open."""
        return min(bisect.bisect_left(self.tokens, n), len(self.tokens) - 1)

    def observe(self, n: int, seconds: float) -> None:
        """One verify forward over n tokens in the batch took ``seconds``."""
        if n < 1 or not 0 < seconds < 1e4:
            return
        self._obs[self.bucket(n)].append((self.observations, seconds / _interpolate(self.tokens, self.probed, n)))
        self.observations += 1
        if self.observations % REFIT_EVERY == 0:
            self.refit()

    def observed_counts(self) -> list[int]:
        """Recent observations per bucket (those the figures use)."""
        oldest = self.observations - STALE_OBS
        return [sum(1 for seq, _ in w if seq >= oldest) for w in self._obs]

    def refit(self) -> None:
        """The figures from the probe and the recent observations (module docstring)."""
        oldest = self.observations - STALE_OBS
        scales: list[float | None] = []
        weights: list[float] = []
        for w in self._obs:
            ratios = sorted(r for seq, r in w if seq >= oldest)
            scales.append(ratios[len(ratios) // 2] if len(ratios) >= MIN_OBS else None)
            weights.append(float(max(1, len(ratios))))
        known = [i for i, s in enumerate(scales) if s is not None]
        ys = [p * (s if s is not None else 1.0) for p, s in zip(self.probed, scales)]
        for i, s in enumerate(scales):
            if s is not None or not known:
                continue
            lo = max((j for j in known if j < i), default=None)
            hi = min((j for j in known if j > i), default=None)
            if lo is not None and hi is not None:  # between visited buckets: their figures, interpolated
                x0, x1 = self.tokens[lo], self.tokens[hi]
                ys[i] = ys[lo] + (ys[hi] - ys[lo]) * (self.tokens[i] - x0) / (x1 - x0)
            else:  # beyond them: the probe's shape at the nearest one's level
                ys[i] = self.probed[i] * scales[lo if lo is not None else hi]
        fitted = monotone_fit(ys, weights)
        if any(abs(a - b) > MIN_CHANGE * b for a, b in zip(fitted, self.seconds)):
            self.seconds = fitted
            self.version += 1

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "seconds": self.seconds, "probed": self.probed,
                "observed": self.observed_counts(), "version": self.version}
