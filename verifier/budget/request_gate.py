"""Which requests of a drafting step get drafts: none for a request whose own measured acceptance
does not pay for what a drafting step costs.

The batch policy (``verifier.budget.policy``) decides per batch-size bucket whether a step drafts
and how deep; it sees the batch's mean. Requests differ: in one batch, a plain greedy request may
accept 2-3 tokens per drafted step while one with presence and frequency penalties accepts 0.02
(the penalties steer away from repeating the context, which is what n-gram drafts propose; H200,
2026-11-30: MAT 1.02-1.03 and speculation at 0.85x plain), and a structured-output request pays a
grammar mask per drafted node (MAT 2.32 and still 0.70x plain at batch 1). So each request keeps
its own figure: accepted draft tokens per step it verified drafts in (decayed sums, ``DECAY``), and
drafts only while ``gain`` pays for its share of what drafting adds to a step: the bucket's measured
cost of a drafting step over a plain one (``BudgetPolicy.step_cost_ratio``: median step times, host
work included) less one, over the batch size (a batch's requests share the padded forward, so one
request more or less in the trees moves the step time by about that share; at batch 1, the whole
extra), and at least ``MIN_GAIN``. On the H100 (2026-12-06) the whole extra at every batch size held
sampled requests (T = 0.8, MAT 1.3) off at batch 8 and cost 1.32x -> 1.03x plain there.

Off by default (``EngineConfig.request_gate``, ``--request-gate``): on the H100 (2026-12-06,
``bench/modes.py``) every serving mode measured ran as fast or faster with the batch policy alone
(penalties at batch 1: 0.993x plain drafting every request, 0.956x with this gate holding them).

A request is judged by its own figure after ``MIN_DRAFTED`` drafted steps. Before that its kind
decides (``request_kind``: sampling temperature and top-p/top-k, penalties, a grammar): every kind
keeps a pooled figure over its requests' drafted steps (decayed by ``KIND_DECAY``), and a new
request of a kind measured over at least ``KIND_MIN_STEPS`` drafted steps that does not pay starts
held. Without it every short penalised request drafted its first steps for nothing (H100,
2026-12-06: penalties at batch 1 0.955x plain with 96-token requests, MAT 1.05). One that is held
off drafts again on one step in its exploration interval (``EXPLORE_EVERY``, doubled after each
exploration that did not pay, up to ``EXPLORE_MAX``: text that starts to repeat itself, a
structured field whose value the prompt holds), which refreshes its figure. Every switch of a
request to no drafts is counted by its reason (``acceptance``: its own measured gain, against the
step cost ratio or ``MIN_GAIN``, in ``BudgetStats.request_switches_acceptance``; ``kind``: its
kind's, in ``request_switches_kind``), the request-steps held off in ``request_steps_held``, and
logged once per ``LOG_EVERY_S``. Per-request state lives here
only while the request runs: entries of requests no longer seen are dropped (``MAX_IDLE`` decisions
after their last).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

DECAY = 0.9  # per drafted step: a request's figure follows its last ~10 drafted steps
MIN_DRAFTED = 4  # drafted steps before a request can be held off (its first steps are a guess)
MIN_GAIN = 0.05  # accepted tokens per drafted step below which a request is held off without a cost ratio
EXPLORE_EVERY = 16  # a held-off request drafts once per this many of its steps in drafting batches ...
EXPLORE_MAX = 64  # ... doubled after each exploration that did not pay, up to this
KIND_DECAY = 0.99  # per drafted step of a kind: its pooled figure follows its last ~100 drafted steps
KIND_MIN_STEPS = 16.0  # decayed drafted steps of a kind before its figure holds new requests off
MAX_KINDS = 64  # kinds kept (least recently seen dropped): each distinct sampling setting is one
LOG_EVERY_S = 60.0
MAX_IDLE = 256  # select() calls after which a request not seen in any is forgotten


def request_kind(params) -> tuple:
    """What a request's acceptance depends on besides its text: temperature (to 0.1), top-p, top-k,
    penalties, a grammar (``verifier.step.sampling.SamplingParams``)."""
    temp = round(float(params.temperature), 1) if params.temperature > 0 else 0.0
    grammar = params.grammar
    return (temp, round(float(params.top_p), 2) if temp else 1.0, params.top_k if temp else 0,
            bool(params.penalized), None if grammar is None else (grammar.kind, hash(grammar.source)))


@dataclass(slots=True)
class _Kind:
    accepted: float = 0.0  # decayed accepted draft tokens over its requests' drafted steps
    drafted: float = 0.0

    @property
    def gain(self) -> float:
        return self.accepted / self.drafted if self.drafted > 0 else 0.0


@dataclass(slots=True)
class _Request:
    accepted: float = 0.0  # decayed accepted draft tokens over drafted steps
    drafted: float = 0.0  # decayed drafted steps
    steps: int = 0  # drafted steps seen (not decayed)
    held: bool = False
    since: int = 0  # steps held off since the last exploration
    explore: int = EXPLORE_EVERY  # steps between explorations while held
    explored: bool = False  # the last drafted step was an exploration
    seen: int = 0  # the select() call that last saw it
    kind: _Kind | None = None

    @property
    def gain(self) -> float:
        return self.accepted / self.drafted if self.drafted > 0 else 0.0


class RequestGate:
    """Per-request draft decisions for one engine (its engine thread only)."""

    def __init__(self, stats, enabled: bool = True) -> None:
        """``stats``: the policy's ``BudgetStats``, whose request counters this gate raises."""
        self.enabled = enabled
        self.stats = stats
        self._reqs: dict[str, _Request] = {}
        self._kinds: dict[tuple, _Kind] = {}  # insertion order = least recently used first
        self._calls = 0
        self._last_log = -LOG_EVERY_S
        self._switches_since_log = 0

    def select(self, req_ids: list[str], ratio: float | None, params: list | None = None) -> list[bool]:
        """For a step that drafts: whether each request gets drafts. ``ratio``: the bucket's
        drafting step time over its plain step time (None: not measured yet); ``params``: each
        request's ``SamplingParams``, whose ``request_kind`` pools its figure with others' (None:
        no pooled figures)."""
        self._calls += 1
        if not self.enabled:
            return [True] * len(req_ids)
        need = MIN_GAIN if ratio is None else max(MIN_GAIN, (ratio - 1.0) / max(1, len(req_ids)))
        out = []
        now = self._calls
        for i, rid in enumerate(req_ids):
            st = self._reqs.get(rid)
            if st is None:
                st = self._reqs[rid] = _Request()
                if params is not None:
                    st.kind = self._kind(request_kind(params[i]))
            st.seen = now
            if st.steps >= MIN_DRAFTED:
                pays, why = st.gain >= need, "acceptance"
            elif st.kind is not None and st.kind.drafted >= KIND_MIN_STEPS:
                pays, why = st.kind.gain >= need, "kind"
            else:
                out.append(True)
                continue
            if pays:
                st.held, st.explore = False, EXPLORE_EVERY
                out.append(True)
                continue
            if not st.held:
                st.held, st.since = True, 0
                self._switched(rid, st.gain if why == "acceptance" else st.kind.gain, ratio, why)
            elif st.explored:  # the exploration did not pay: wait longer before the next
                st.explore = min(EXPLORE_MAX, 2 * st.explore)
            st.explored = False
            st.since += 1
            if st.since >= st.explore:  # drafts this step: its figure is measured again
                st.since, st.explored = 0, True
                out.append(True)
            else:
                self.stats.request_steps_held += 1
                out.append(False)
        if now % 64 == 0 and len(self._reqs) > 2 * len(req_ids) + 64:
            self._forget(now)
        return out

    def _kind(self, key: tuple) -> _Kind:
        k = self._kinds.pop(key, None)
        if k is None:
            k = _Kind()
            if len(self._kinds) >= MAX_KINDS:
                del self._kinds[next(iter(self._kinds))]
        self._kinds[key] = k  # most recently used last
        return k

    def observe(self, req_id: str, accepted: int) -> None:
        """A drafted step of the request (it verified draft nodes) accepted ``accepted`` of them."""
        st = self._reqs.get(req_id)
        if st is None:
            return
        st.accepted = DECAY * st.accepted + accepted
        st.drafted = DECAY * st.drafted + 1.0
        st.steps += 1
        if st.kind is not None:
            st.kind.accepted = KIND_DECAY * st.kind.accepted + accepted
            st.kind.drafted = KIND_DECAY * st.kind.drafted + 1.0

    def gain(self, req_id: str) -> float | None:
        st = self._reqs.get(req_id)
        return None if st is None or st.steps == 0 else st.gain

    def held(self, req_id: str) -> bool:
        st = self._reqs.get(req_id)
        return st is not None and st.held

    def counts(self) -> dict[str, int]:
        return {"tracked": len(self._reqs), "held_now": sum(s.held for s in self._reqs.values()),
                "switches_acceptance": self.stats.request_switches_acceptance,
                "switches_kind": self.stats.request_switches_kind, "kinds": len(self._kinds),
                "request_steps_held": self.stats.request_steps_held}

    def _forget(self, now: int) -> None:
        """Drops requests that no select() saw in the last MAX_IDLE calls (finished or aborted)."""
        for rid in [r for r, s in self._reqs.items() if now - s.seen > MAX_IDLE]:
            del self._reqs[rid]

    def _switched(self, rid: str, gain: float, ratio: float | None, why: str) -> None:
        if why == "kind":
            self.stats.request_switches_kind += 1
        else:
            self.stats.request_switches_acceptance += 1
        self._switches_since_log += 1
        t = time.monotonic()
        if t - self._last_log >= LOG_EVERY_S:
            against = f"a drafting step {ratio:.2f}x as long as a plain one" if ratio is not None else \
                f"the minimum {MIN_GAIN}"
            more = f" ({self._switches_since_log} requests since the last line)" if self._switches_since_log > 1 else ""
            whose = "its" if why == "acceptance" else "its kind's"
            log.info("request %s: no drafts (%s): %.3f accepted tokens per drafted step (%s) against %s%s",
                     rid, why, gain, whose, against, more)
            self._last_log, self._switches_since_log = t, 0
