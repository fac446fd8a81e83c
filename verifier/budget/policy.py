"""How many draft nodes a step verifies: a fixed budget, or one chosen from measured costs and the
measured acceptance.

Cost model (``verifier.budget.cost_model``): t(N) = seconds of one verify forward over N tokens in the
batch, probed at start-up and refreshed from the forward times of the steps really run.

A step with bs requests padded to K nodes each (the root plus K - 1 draft nodes) costs t(bs * K)
and is expected to commit bs + c * sum_b sum_{i < K-1} p_b,i tokens, where p_b,i is the corpus's
path acceptance probability of request b's i-th best node and c calibrates those estimates
against what verification actually accepted: one factor for every rank. c is also learned per band
of node ranks (1, 2-3, 4-7, 8-15, ...; ``rank_band``), where the corpus rates its deep nodes more
optimistically than its first ones, and ``BudgetPolicy.rank_bands`` makes the node choice use the
bands; it is off, since on the H100 the trees it cut lost more accepted tokens than the GPU saved
(``__init__``). The node choice picks the K with the most expected
tokens per second; K = 1 (plain decoding) is always a candidate. Large batches, where t(bs * K)
grows about linearly in K, draft little or nothing: the budget asked of the corpus is capped at
the largest K - 1 for which even fully accepted drafts would pay (K * t(bs) > t(bs * K)).

The model only knows forward time. A step's host work (drafting, tree packing, committing tokens:
Python per request) is not in it, and at large batches it dominates: on the H200 a SmolLM2 step of
64 requests took 4.7 ms of wall time plain and about 14 ms speculative, against 1.6 and 4 ms of
forward. So the policy also measures what each mode delivers, per batch-size bucket (powers of
two): the committed tokens per request of its steps (the acceptance actually measured: drafting
steps against plain steps' one token) over its step time, the mean of its latest steps, each
clipped to ``CLIP`` times their median. A step
counts as the cost model's forward time for its tokens in the batch plus its own host time (its
wall time less its measured forward), so that a forward slowed by other processes, the noisy part
on a loaded machine, is the model's median rather than one step's, and both modes are timed on the
same model; an overlapped plain step, whose forward is not measured apart, counts its wall time.
The clipped mean, not the median: a drafting step's time follows its tree size, and so do its
tokens (H100, 2026-12-06, batch 64, n = 4 at T = 0.8: drafting steps of 2.6-2.9 ms and of 3.5 ms);
over a window of small and large trees the median time is a small tree's while the tokens are a
mean over both, which credits drafting with more than it delivered (tests/verifier/budget:
1.20x plain where 1.02x was delivered). The clip keeps one slow step (another process took the
core) from weighing on the figure as a plain mean would.
Before, decayed sums of tokens and wall seconds were compared: one slow drafting step weighed on
the figure for hundreds of steps, and on the H200 one round of batch 64 drafted in 3 of its 214
full-batch steps (MAT 1.26 against 2.58 in the other rounds).

Where drafting delivers less than plain (by more than 3%: drafting's gains come in bursts), the
bucket does not draft, except for one step in ``explore_every`` (a run of ``explore_run`` plain
steps; 2, 4 or 8 times fewer when a mode leads clearly, ``explore_factor``, and 4x fewer again
where drafting leads by 1.25x or more, ``explore_scale``) that keeps the losing
mode's figures current. Plain steps of a speculative engine run one step ahead of the host
(overlapped); their figure is that steady state, not the cost of switching into it and out of it
(a lone plain step between drafting ones waits for its own results: at batch 64 on the H200 it
delivered 20k tok/s where a run of plain steps delivers 28k, which kept drafting on where it lost).

Where several busy verifier processes share one GPU (``gpu_share`` R > 1: replicas under MPS or
time-slicing), a step's forward time is mostly the others' work, and the extra time of a tree over
a plain step delays every process's steps, not only its own: the node choice counts that extra
R times. On the H200 (4 SmolLM2 replicas, RL rollouts, docs/rollouts.md) the choice without it
verified trees whose steps took 8.4 ms against 5.5 ms plain, and a fixed 2 nodes beat it.

No figure can lock drafting off for good: the cost model follows the steps, its stale observations
expire, and one drafting step in ``explore_every`` of a bucket (and every exploring one) chooses its
nodes optimistically (the calibration at least 1, drafting's host overhead no more than plain's,
at least one node where the corpus drafted any), so tree sizes that the figures rule out are
measured again. Each switch of a bucket to plain decoding is counted (``BudgetStats``) by its
reason and logged: ``cost`` (the cost model: no tree size expected to pay), ``delivered`` (drafting
delivered less than plain), ``nothing`` (the corpus had nothing to draft), ``critical`` (with
``critical_path`` on, verifier/budget/makespan.py: drafting gains the request expected to end last
less than it adds to the step time).

A drafting step whose node choice verifies no node (``cost``: with the corpus's drafts in hand, no
tree size was expected to pay) has paid drafting's host work for a plain step's tokens (H100,
2026-12-06, batch 64, n = 4 at T = 0.8: 0.3-0.45 ms of a 2 ms step, in 14-39 of a round's ~230
steps, often in runs). The next step's drafts continue the same requests one token on, so the bucket
backs off: it decodes plain for the next 1, 2, 4 (``BACKOFF_MAX``) steps after consecutive such
outcomes, and asks again after that; a step that verifies drafts ends the back-off. Those steps are
counted (``BudgetStats.plain_steps_backoff``). Exploring and optimistic steps do not back off.

Within a drafting step, a request whose own measured acceptance does not pay for a drafting step's
cost gets no drafts (verifier/budget/request_gate.py; counted per request, not per bucket).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .cost_model import CostModel
from .request_gate import RequestGate

__all__ = ["BudgetPolicy", "BudgetStats", "CostModel"]

log = logging.getLogger(__name__)

TIME_WINDOW = 9  # a mode's latest steps, whose clipped mean step time counts
CLIP = 1.5  # a step counts at most this many times its window's median time
BACKOFF_MAX = 4  # plain steps after a drafting step whose node choice verified nothing (doubling from 1)
MIN_STEPS = 3  # steps of each mode a bucket needs before it compares them (until then: drafting, exploring plain)
OVERHEAD_WINDOW = 9  # a mode's latest (step wall time / modeled forward time) ratios
LOG_EVERY_S = 60.0  # a bucket's switches to plain for one reason: one log line per this many seconds


def _median(xs) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def _clipped_mean(xs) -> float:
    """The mean of ``xs``, each at most CLIP times their median (module docstring)."""
    top = CLIP * _median(xs)
    return sum(min(x, top) for x in xs) / len(xs)


@dataclass
class BudgetStats:
    """What the adaptive budget did (the engine's ``stats.budget``): switches of a batch bucket from
    drafting to plain decoding, by reason (module docstring), and the cost model's refreshes."""

    plain_switches_cost: int = 0
    plain_switches_delivered: int = 0
    plain_switches_nothing: int = 0
    plain_switches_critical: int = 0
    cost_model_refits: int = 0  # the cost model's figures changed from observed steps
    plain_steps_backoff: int = 0  # steps decoded plain after drafting steps whose node choice verified nothing
    # Per request (verifier/budget/request_gate.py): requests switched to no drafts because their
    # measured acceptance does not pay for a drafting step, and the request-steps held off so.
    request_switches_acceptance: int = 0
    request_switches_kind: int = 0  # new requests held from their start by their kind's pooled figure
    request_steps_held: int = 0


@dataclass
class _Bucket:
    """One batch-size bucket's measurements of the two modes (True: drafting, False: plain)."""

    # Per mode, its latest steps as (tokens in the forward, host seconds): the step's wall time less
    # its measured forward; (0, wall seconds) where the step's forward was not measured apart
    # (overlapped plain steps). A step's time is the cost model's forward time plus its host time.
    times: dict[bool, deque] = field(default_factory=lambda: {m: deque(maxlen=TIME_WINDOW) for m in (False, True)})
    step_time: dict[bool, float | None] = field(default_factory=lambda: {False: None, True: None})
    # Decayed sums per mode: committed tokens, committed tokens per request, steps.
    sums: dict[bool, list[float]] = field(default_factory=lambda: {False: [0.0, 0.0, 0.0], True: [0.0, 0.0, 0.0]})
    relative: float | None = None  # drafting's delivered rate / plain's (None: not compared yet)
    prefers: bool = True  # whether drafting is the leading mode
    steps: int = 0  # decisions taken (paces the exploration)
    draft_steps: int = 0  # drafting decisions (paces the optimistic node choices)
    plain_reason: str = "delivered"  # why plain decoding leads, where it does: "delivered" or "critical"
    state: str = "draft"  # the latest leading-mode step: "draft", or why it decoded plain ("cost", "nothing")
    version: int = -1  # the cost model version the step times were computed on
    backoff: int = 0  # plain steps of the latest back-off (module docstring); 0: none running
    skip: int = 0  # plain steps left in it

    def acceptance(self, mode: bool) -> float | None:
        """Committed tokens per request per step of this mode."""
        s = self.sums[mode]
        return s[1] / s[2] if s[2] > 0 else None

    def update(self, mode: bool, forward: Callable[[int], float], version: int) -> None:
        """The mode's step time (the clipped mean of its latest steps; both modes' after a refit of
        the cost model, so that they are timed on the same figures) and drafting's relative rate."""
        for m in ((mode,) if version == self.version else (False, True)):
            if self.times[m]:
                self.step_time[m] = _clipped_mean([(forward(n) if n else 0.0) + t for n, t in self.times[m]])
        self.version = version
        a, b = self.acceptance(True), self.acceptance(False)
        td, tp = self.step_time[True], self.step_time[False]
        if min(len(self.times[True]), len(self.times[False])) < MIN_STEPS or not (a and b and td and tp):
            self.relative = None
        else:
            self.relative = (a / b) / (td / tp)


def rank_band(rank: int) -> int:
    """The calibration band of a draft node's rank (1 = the best): 1 -> 0, 2-3 -> 1, 4-7 -> 2, 8-15 -> 3, ..."""
    return rank.bit_length() - 1


def explore_factor(rel: float) -> int:
    """How many times ``explore_every`` apart a bucket explores its losing mode, from drafting's
    relative rate: a clear winner is re-checked less often, since each exploration costs steps of
    the losing mode. Where drafting leads, plain decoding is re-checked 2, 4 or 8x apart (leads of
    1.25, 1.6, 2.5x): on the H100 (2026-12-06, batch 1 greedy, warm corpus) drafting delivered ~2x
    plain, and a run of 3 exploring plain steps in every 32 cost about 3% of a round's tokens, while
    plain decoding's figure does not follow the text. Where plain leads, drafting is re-checked at
    most 2x apart: its figure does follow the text, and at batch 1 a request that copies after one
    that did not needs drafting found again soon (bench/closed_batch.py, batch 1, 256 tokens, one
    run: with drafting explored 4x apart where plain led by 1.6x, a round decoded plain 302 steps
    against 82)."""
    if rel >= 1.0:
        return 8 if rel >= 2.5 else 4 if rel >= 1.6 else 2 if rel >= 1.25 else 1
    return 2 if rel <= 0.8 else 1


class BudgetPolicy:
    """``fixed`` >= 0: always draft that many nodes per request (0 = no speculation).
    ``fixed`` None: adaptive within [0, max_budget] from ``cost`` and the measurements."""

    def __init__(self, max_budget: int, fixed: int | None = None, cost: CostModel | None = None) -> None:
        if fixed is None and cost is None:
            raise ValueError("an adaptive budget needs a cost model")
        if not 1 <= max_budget <= 63:
            raise ValueError(f"max_budget: expected 1..63 (K <= 64 tree nodes), got {max_budget}")
        if fixed is not None and not 0 <= fixed <= max_budget:
            raise ValueError(f"budget: expected 0..{max_budget}, got {fixed}")
        self.max_budget, self.fixed, self.cost = max_budget, fixed, cost
        self.stats = BudgetStats()
        # Which requests of a drafting step get drafts (an adaptive budget only; the engine may turn it off).
        self.request_gate = RequestGate(self.stats, enabled=fixed is None)
        self.predicted = 1.0  # decayed sums for the calibration c = accepted / predicted
        self.accepted = 1.0
        # The same per band of node ranks (rank_band), always learned (/metrics); ``rank_bands`` True:
        # the node choice calibrates each rank by its band (bench arms spec_bands). Off by default:
        # on the H100 (2026-12-07, bench/modes.py, rounds interleaved) it ran batch 64 at 1.114x /
        # 1.029x plain against the one calibration's 1.149x / 1.111x (60 / 120 prompts), and batch
        # 1 even (2.124x / 2.191x against 2.169x / 2.113x), though a CPU replay with the H100's step
        # times had it 3.4% ahead: trees cut to the ranks that pay by estimate lost more accepted
        # tokens (MAT 2.40-2.45 against 2.51) than the GPU saved on the nodes.
        self.band_predicted = [1.0] * rank_band(max_budget) + [1.0]
        self.band_accepted = [1.0] * len(self.band_predicted)
        self.rank_bands = False
        # Observed step time / modeled forward time, for plain and for speculative steps (medians
        # of the latest): the host work a step adds (drafting, tree building, verification).
        self.overhead = {False: 1.0, True: 1.0}
        self._overhead_obs = {m: deque(maxlen=OVERHEAD_WINDOW) for m in (False, True)}
        self._step_costs: dict[int, list[float]] = {}  # per batch size: cost(bs * node_bucket(k + 1)), k = 0..max_budget
        self._budgets: dict[int, int] = {}  # per batch size: the largest budget that can pay
        self._cost_version = -1  # the cost model's version the two caches hold
        self.node_bucket = lambda k: k  # tree size the forward really runs
        self.explore_every = 16
        # The largest explore_factor used, explore_scale included (bench arms spec_explore2: 2 and
        # spec_explore8: 8, scale 1, the defaults before 2026-12-07).
        self.explore_max = 32
        # explore_factor's factor, where drafting leads by 1.25x or more, times this: plain
        # decoding's figure barely moves, so a clear lead is re-checked 8-32x explore_every apart.
        # On the H100 (2026-12-07, bench/modes.py greedy, four interleaved rounds, arms spec_explore8
        # against this) batch 1 ran 2.220x plain against 2.073x (ahead in 4 of 4 rounds; MAT 2.815
        # against 2.654: fewer exploring plain steps), batch 64 1.231x against 1.217x (2 of 4); the
        # CPU replay (bench/closed_batch.py, the H100's step times) batch 1 +2.5%, batch 64 +3.4%.
        self.explore_scale = 4
        # Busy verifier processes sharing the GPU (module docstring): a tree's forward time beyond a
        # plain step's counts this many times in the node choice.
        self.gpu_share = 1
        # Consecutive plain steps per exploration turn (drafting's: one). An engine whose plain
        # steps overlap the host raises it (their first step only restarts the pipeline); a plain
        # step that does not overlap shows its cost alone.
        self.explore_run = 1
        self._buckets: dict[int, _Bucket] = {}
        # This step's decision (draft_budget), for its node choice: an exploring step does not
        # change the bucket's state; an optimistic one measures tree sizes the figures rule out.
        self._exploring = False
        self._optimistic = False
        self._step_bucket: int | None = None
        # How each step was decided, per bucket (decision_counts): for the benchmark's record.
        self._decisions: dict[tuple[int, str], int] = {}
        self._logged: dict[tuple[int, str], list[float]] = {}  # (bucket, reason): [last log time, switches since]
        self._step_forward: tuple[int, float] | None = None  # observe_step's (tokens, forward seconds) of this step
        self._memo: dict[int, float] = {}
        self._memo_version = -1

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

    def _bucket(self, b: int) -> _Bucket:
        st = self._buckets.get(b)
        if st is None:
            st = self._buckets[b] = _Bucket()
        return st

    # ------------------------------------------------------------------ measured delivery

    def delivered(self, bs: int, drafted: bool) -> float | None:
        """Committed tokens per second of this bucket's steps of one mode: tokens per step over the
        clipped mean step time (None: none seen yet)."""
        st = self._buckets.get(self.batch_bucket(bs))
        if st is None or not st.step_time[drafted] or st.sums[drafted][2] <= 0:
            return None
        s = st.sums[drafted]
        return (s[0] / s[2]) / st.step_time[drafted]

    def delivered_rates(self) -> dict[str, float]:
        """Every figure kept, as {"<bucket>_drafted" | "<bucket>_plain": committed tokens/s}."""
        out = {}
        for b in sorted(self._buckets):
            for mode in (True, False):
                v = self.delivered(b, mode)
                if v is not None:
                    out[f"{b}_{'drafted' if mode else 'plain'}"] = v
        return out

    def acceptance(self, bs: int, drafted: bool) -> float | None:
        """Committed tokens per request per step of this bucket's steps of one mode (None: none seen)."""
        st = self._buckets.get(self.batch_bucket(bs))
        return None if st is None else st.acceptance(drafted)

    def relative_rate(self, bs: int) -> float | None:
        """Drafting's delivered rate over plain decoding's in this bucket (None: not measured yet)."""
        st = self._buckets.get(self.batch_bucket(bs))
        return None if st is None else st.relative

    def step_cost_ratio(self, bs: int) -> float | None:
        """This bucket's drafting step time over its plain step time (clipped means of the latest steps,
        host work included; None until both modes have MIN_STEPS): what a request's drafted step
        must deliver, in tokens, to pay (``RequestGate``)."""
        st = self._buckets.get(self.batch_bucket(bs))
        if st is None or min(len(st.times[True]), len(st.times[False])) < MIN_STEPS:
            return None
        td, tp = st.step_time[True], st.step_time[False]
        return td / tp if td and tp else None

    def drafting_pays(self, bs: int, critical: float | None = None) -> bool:
        """False where drafting steps of this batch size deliver less than plain ones, except on
        exploration steps (per ``explore_every`` of this bucket's steps, one drafting step or
        ``explore_run`` plain ones run the mode that is losing, or is not measured yet).
        ``critical``: the tokens per drafting step of the request expected to end last
        (``verifier.budget.makespan.critical_acceptance``); where given, drafting must deliver
        that request more than plain decoding does, its steps' cost counted (a batch's makespan),
        rather than the batch's mean tokens per step."""
        b = self.batch_bucket(bs)
        st = self._bucket(b)
        n = st.steps
        st.steps = n + 1
        # Drafting's gains come in bursts (a copied passage accepts 8 tokens, most steps accept
        # none), so it keeps the lead unless plain is ahead by more than 3%.
        rel, reason, keep = st.relative, "delivered", 0.97
        if rel is not None and critical is not None:
            # The makespan's figure: that request's gain over the steps' cost ratio. It is a mean
            # over the request's drafting steps, not one step's burst: no margin.
            rel = critical / st.acceptance(False) / (st.step_time[True] / st.step_time[False])
            reason, keep = "critical", 1.0
        # Plain steps are explored in runs: an overlapped plain step only shows its steady cost
        # after the one that restarts the pipeline (observe_delivered's callers skip that one and
        # the drain before the next drafting step: switching costs are exploration's, not plain's).
        # Drafting steps are not overlapped, so one shows what drafting costs.
        if rel is None:
            # Start by drafting; measure plain steps twice as often until the modes compare.
            every = max(self.explore_every // 2, self.explore_run + 1)
            st.prefers = True
            drafts = n % every < every - self.explore_run
            self._exploring = not drafts
            self._count(b, "start_draft" if drafts else "start_plain")
            return drafts
        factor = explore_factor(rel) * (self.explore_scale if rel >= 1.25 else 1)
        every = self.explore_every * min(factor, self.explore_max)
        prefers = rel >= keep
        if st.prefers and not prefers:
            longer = f"{st.step_time[True] / st.step_time[False]:.2f}x as long"
            if reason == "critical":
                why = (f"drafting would give the request expected to end last {critical:.2f} tokens per step "
                       f"against {st.acceptance(False):.2f}, with steps {longer}")
            else:
                why = (f"drafting delivered {rel:.2f}x plain decoding's tokens/s ({st.acceptance(True):.2f} tokens "
                       f"per request-step against {st.acceptance(False):.2f}, steps {longer})")
            self._switched(b, reason, why)
        st.prefers = prefers
        if not prefers:
            st.plain_reason = reason
        explore = n % every >= every - (self.explore_run if prefers else 1)
        drafts = prefers != explore
        self._exploring = explore
        self._count(b, ("explore_" if explore else "") + ("draft" if drafts else "plain"))
        return drafts

    def _count(self, bucket: int, kind: str) -> None:
        key = (bucket, kind)
        self._decisions[key] = self._decisions.get(key, 0) + 1

    def decision_counts(self) -> dict[str, int]:
        """Steps per "<bucket>_<how>": how the delivered-rate rule decided them (``start_draft`` /
        ``start_plain``: the bucket's modes were not compared yet; ``draft`` / ``plain``: the leading
        mode; ``explore_draft`` / ``explore_plain``: an exploration step), ``nodes0``: drafting steps
        whose node choice verified no draft node (the drafts did not pay for their cost), ``nothing``:
        drafting steps with nothing drafted, and ``optimistic``: drafting steps whose node choice was
        optimistic (module docstring)."""
        return {f"{b}_{k}": n for (b, k), n in sorted(self._decisions.items())}

    def states(self) -> dict[str, str]:
        """Per bucket: "draft", or why it decodes plain: "delivered" (drafting is the losing mode),
        "critical" (it loses for the request expected to end last: ``critical_path``),
        "cost" or "nothing" (its latest step, drafting leading)."""
        return {str(b): st.state if st.prefers else st.plain_reason for b, st in sorted(self._buckets.items())}

    def _switched(self, b: int, reason: str, why: str) -> None:
        """A switch of the bucket to plain decoding: counted, and logged (one line per bucket and
        reason per LOG_EVERY_S, saying how many switches it stands for)."""
        setattr(self.stats, f"plain_switches_{reason}", getattr(self.stats, f"plain_switches_{reason}") + 1)
        now = time.monotonic()
        last = self._logged.setdefault((b, reason), [-LOG_EVERY_S, 0])
        last[1] += 1
        if now - last[0] >= LOG_EVERY_S:
            more = f" ({last[1]} switches for this reason since the last line)" if last[0] >= 0 and last[1] > 1 else ""
            log.info("draft budget, batch bucket %d: plain decoding (%s): %s%s", b, reason, why, more)
            last[0], last[1] = now, 0

    def _note(self, reason: str, why: str = "") -> None:
        """A leading-mode drafting step's outcome for its bucket: drafts verified ("draft"), or why
        it decoded plain ("cost", "nothing"); from "draft", that is a switch. Exploration steps, and
        a bucket where plain decoding leads ("delivered", counted when it took the lead), say
        nothing about the bucket's state."""
        b = self._step_bucket
        if b is None or self._exploring:
            return
        st = self._bucket(b)
        if not st.prefers:
            return
        was, st.state = st.state, reason
        if was == "draft" and reason != "draft":
            self._switched(b, reason, why)

    # ------------------------------------------------------------------ the budget and the node choice

    @property
    def calibration(self) -> float:
        return min(2.0, max(0.05, self.accepted / self.predicted))

    def band_calibrations(self, learned: bool = False) -> list[float]:
        """c per band of node ranks (``rank_band``), each within [0.05, 2]: what the node choice uses
        (all ``calibration`` where ``rank_bands`` is off), or with ``learned`` the bands' own figures."""
        if not (self.rank_bands or learned):
            return [self.calibration] * len(self.band_predicted)
        return [min(2.0, max(0.05, a / p)) for a, p in zip(self.band_accepted, self.band_predicted)]

    def _fresh_costs(self) -> None:
        version = getattr(self.cost, "version", 0)  # any t(N) callable will do; a CostModel refreshes
        if version != self._cost_version:
            self.stats.cost_model_refits = version  # the refits that changed its figures
            self._cost_version = version
            self._step_costs.clear()
            self._budgets.clear()

    def _shared_cost(self, plain: float, tree: float) -> float:
        """A tree step's cost as the GPU's busy processes bear it: a plain step's forward time, plus
        the tree's extra counted ``gpu_share`` times (module docstring)."""
        return plain + self.gpu_share * (tree - plain)

    def draft_budget(self, bs: int, critical: float | None = None) -> int:
        """Nodes per request to ask the corpus for (0 = do not draft this step). ``critical``: see
        ``drafting_pays``."""
        self._exploring = self._optimistic = False
        self._step_bucket = None
        self._step_forward = None  # a new step: a verify step's observe_step comes after this
        if self.fixed is not None:
            return self.fixed
        b = self.batch_bucket(bs)
        self._step_bucket = b
        if not self.drafting_pays(bs, critical):
            return 0
        st = self._bucket(b)
        if st.skip > 0 and not self._exploring:
            st.skip -= 1
            self.stats.plain_steps_backoff += 1
            self._count(b, "backoff")
            return 0
        st.draft_steps += 1
        self._optimistic = self._exploring or st.draft_steps % self.explore_every == 0
        self._fresh_costs()
        best = self._budgets.get(bs)
        if best is None:  # once per batch size and cost model version
            base, best = self.cost(bs), 0
            for k in range(2, self.max_budget + 2):
                if k * base > self._shared_cost(base, self.cost(bs * k)):
                    best = k - 1
            self._budgets[bs] = best
        if best == 0 and self._optimistic:
            best = 1  # the cost model may be wrong: one node measures the next tree size
        if best == 0:
            self._note("cost", f"no tree pays at batch {bs} even if fully accepted "
                       f"({self.cost(bs) * 1e3:.2f} ms per plain step, {self.cost(2 * bs) * 1e3:.2f} ms with one node)")
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
            return self._nothing()
        probs = probs[:, :W]
        if best_first:  # gains[k] = the first k columns' sum (padding is 0)
            col = probs.sum(axis=0, dtype=np.float64)
        else:
            col = np.sort(probs.astype(np.float64), axis=1)[:, ::-1].sum(axis=0)
        return self._best_nodes(bs, [0.0, *itertools.accumulate(col.tolist())])

    def choose_nodes_summary(self, bs: int, nodes: int, column_sums: list[float]) -> int:
        """``choose_nodes_rows`` from a summary of the rows (``verifier.step._native.summarize_rows``:
        the widest row's node count and, per column, the sum of the rows' j-th best probabilities)."""
        if self.fixed is not None:
            return min(self.fixed, nodes)
        if not (bs and nodes):
            return self._nothing()
        return self._best_nodes(bs, [0.0, *itertools.accumulate(column_sums)])

    def _nothing(self) -> int:
        if self._step_bucket is not None:
            self._count(self._step_bucket, "nothing")
        self._note("nothing", "the corpus had nothing to draft")
        self._optimistic = False
        return 0

    def _best_nodes(self, bs: int, gains: list[float]) -> int:
        """The k (0 .. len(gains) - 1) with the most expected tokens per second: bs + c gains[k]
        (gains[k]: the k best nodes' probabilities summed over the batch, c the calibration) over
        the step's modeled time with k nodes per request (its tree bucket, and the host overhead
        observed for plain or speculative steps). Plain Python: some 16 numbers, where numpy's
        per-call cost would be most of the step's host time at batch 1."""
        if len(gains) < 2:
            return self._nothing()
        self._fresh_costs()
        costs = self._step_costs.get(bs)
        if costs is None:  # the cost model and the buckets are fixed between refits: once per batch size
            costs = [self.cost(bs * self.node_bucket(k + 1)) for k in range(self.max_budget + 1)]
            costs = self._step_costs[bs] = [self._shared_cost(costs[0], c) for c in costs]
        cs, plain, spec = self.band_calibrations(), self.overhead[False], self.overhead[True]
        optimistic, self._optimistic = self._optimistic, False
        if optimistic:  # figures that may be stale for want of drafting steps: at their most hopeful
            cs, spec = [max(c, 1.0) for c in cs], min(spec, plain)
        best, best_rate = 0, bs / (costs[0] * plain)
        expected, last = 0.0, len(cs) - 1
        for k in range(1, min(len(gains), len(costs))):
            # The k-th best nodes' estimates, calibrated by their band.
            expected += cs[min(rank_band(k), last)] * (gains[k] - gains[k - 1])
            rate = (bs + expected) / (costs[k] * spec)
            if rate > best_rate:  # the first of equal rates, as argmax
                best, best_rate = k, rate
        if optimistic and self._step_bucket is not None:
            self._count(self._step_bucket, "optimistic")
            if best == 0 and gains[1] > 0:
                best = 1
        self._back_off(best == 0 and not (optimistic or self._exploring))
        if best == 0:
            self._count(self.batch_bucket(bs), "nodes0")
            self._note("cost", f"no tree size was expected to pay (calibration {cs[0]:.2f} for the best node, "
                       f"step overhead {spec:.2f}x drafting, {plain:.2f}x plain)")
        else:
            self._note("draft")
        return best

    def _back_off(self, nothing_verified: bool) -> None:
        """After this step's node choice: a leading-mode drafting step that verifies no node starts
        or doubles the bucket's back-off; one that verifies drafts ends it (module docstring)."""
        b = self._step_bucket
        if b is None:
            return
        st = self._bucket(b)
        if nothing_verified:
            st.backoff = min(BACKOFF_MAX, 2 * st.backoff) if st.backoff else 1
            st.skip = st.backoff
        elif not self._exploring:
            st.backoff = st.skip = 0

    # ------------------------------------------------------------------ observations

    def observe_step(self, speculative: bool, seconds: float, tokens: int, forward_seconds: float | None = None) -> None:
        """One step's wall time against the cost model's forward time for its tokens in the batch;
        ``forward_seconds``: the step's own forward time, which refreshes the cost model."""
        if self.cost is None or not seconds > 0:
            return
        if forward_seconds is not None and forward_seconds > 0:
            if isinstance(self.cost, CostModel):
                self.cost.observe(tokens, forward_seconds)
            self._step_forward = (tokens, forward_seconds)  # for this step's observe_delivered
        w = self._overhead_obs[speculative]
        w.append(min(seconds / self.cost(tokens), 10.0))
        self.overhead[speculative] = _median(w)

    def observe_delivered(self, bs: int, drafted: bool, seconds: float, committed: int) -> None:
        """One step's committed tokens and wall time (drafting and committing included). ``drafted``:
        the step asked the corpus for drafts (its cost is paid even if no node was verified). Where
        observe_step gave this step's forward time, the step counts as the cost model's forward time
        for its tokens plus its host time: a forward slowed by other processes is noise that the
        model's median absorbs, and both modes are timed on the same model."""
        step, self._step_forward = self._step_forward, None
        if not seconds > 0 or bs < 1:
            return
        st = self._bucket(self.batch_bucket(bs))
        # The leading mode's figures average over about 20 steps (drafting's bursts); the other
        # mode is seen once in explore_every steps, so a few of those must be able to move them.
        decay = 0.95 if drafted == st.prefers else 0.8
        s = st.sums[drafted]
        s[0] = decay * s[0] + committed
        s[1] = decay * s[1] + committed / bs
        s[2] = decay * s[2] + 1.0
        if step is not None and self.cost is not None:
            st.times[drafted].append((step[0], max(0.0, seconds - step[1])))
        else:
            st.times[drafted].append((0, seconds))
        st.update(drafted, self._forward_memo, getattr(self.cost, "version", 0))

    def _forward_memo(self, n: int) -> float:
        """cost(n), memoized per cost model version (a bucket's figures are re-read every step)."""
        version = getattr(self.cost, "version", 0)
        if version != self._memo_version:
            self._memo.clear()
            self._memo_version = version
        t = self._memo.get(n)
        if t is None:
            t = self._memo[n] = self.cost(n)
        return t

    def bands_of(self, column_sums: list[float], k: int, ranks: np.ndarray | None,
                 accepted: int) -> tuple[list[float], list[float]]:
        """A step's ``bands`` for ``observe``: the estimates of its kept ranks 1..k (``column_sums``,
        each rank's summed over the batch) and its accepted nodes' ``ranks``, per band; ``ranks``
        None (the nodes' ranks are not known): the ``accepted`` tokens spread over the bands as predicted."""
        last = len(self.band_predicted) - 1
        pred = [0.0] * (last + 1)
        for r in range(1, k + 1):
            pred[min(rank_band(r), last)] += column_sums[r - 1]
        if ranks is None:
            total = sum(pred)
            return pred, [accepted * p / total if total > 0 else 0.0 for p in pred]
        # rank_band over the array: floor(log2(rank)), exact for ints
        return pred, np.bincount(np.minimum(np.log2(ranks).astype(np.int64), last), minlength=last + 1).tolist()

    def observe(self, predicted: float, accepted: int, bands: tuple | None = None) -> None:
        """One step's sum of path probabilities of the verified nodes vs draft tokens accepted;
        ``bands``: the same per band of node ranks (two sequences, ``rank_band``'s order), where the
        step knows which ranks were accepted."""
        decay = 0.98
        self.predicted = decay * self.predicted + predicted
        self.accepted = decay * self.accepted + accepted
        if bands is None:  # (the node choice reads the bands: the engine always gives them)
            return
        pred, acc = bands
        for j in range(min(len(pred), len(self.band_predicted))):
            if pred[j] > 0:  # a band decays over its own steps: one a step's trees did not reach keeps its figure
                self.band_predicted[j] = decay * self.band_predicted[j] + pred[j]
                self.band_accepted[j] = decay * self.band_accepted[j] + acc[j]
