"""Per-request draft decisions (verifier/budget/request_gate.py): a request whose measured acceptance
does not pay for a drafting step gets no drafts, per request, counted by reason; no model."""

import logging

import pytest

from verifier.budget import request_gate as rg
from verifier.budget.policy import BudgetPolicy, BudgetStats, CostModel
from verifier.budget.request_gate import RequestGate


def drafted_steps(gate, rid, accepted, n):
    for _ in range(n):
        assert gate.select([rid], None) == [True]
        gate.observe(rid, accepted)


def test_a_new_request_drafts_until_it_has_been_measured():
    gate = RequestGate(BudgetStats())
    for _ in range(rg.MIN_DRAFTED - 1):
        assert gate.select(["a"], 3.0) == [True]  # no figure yet: not judged against the ratio
        gate.observe("a", 0)
    assert gate.select(["a"], 3.0) == [True]
    gate.observe("a", 0)
    assert gate.select(["a"], 3.0) == [False]


def test_low_acceptance_is_held_off_per_request_and_counted():
    stats = BudgetStats()
    gate = RequestGate(stats)
    drafted_steps(gate, "repeats", 3, rg.MIN_DRAFTED)  # accepts 3 per drafted step
    drafted_steps(gate, "penalised", 0, rg.MIN_DRAFTED)  # accepts nothing
    # A drafting step costs 1.5x a plain one: each of the two requests' share is 0.25 step; 3 tokens
    # pay for it, 0 do not.
    assert gate.select(["repeats", "penalised"], 1.5) == [True, False]
    assert gate.held("penalised") and not gate.held("repeats")
    assert stats.request_switches_acceptance == 1 and stats.request_steps_held == 1
    gate.select(["repeats", "penalised"], 1.5)
    assert stats.request_switches_acceptance == 1 and stats.request_steps_held == 2  # one switch, two steps
    assert gate.counts()["held_now"] == 1


def test_the_cost_ratio_decides_where_it_is_known():
    gate = RequestGate(BudgetStats())
    drafted_steps(gate, "a", 1, rg.MIN_DRAFTED)  # gain ~1 accepted token per drafted step
    assert gate.gain("a") == pytest.approx(1.0)
    assert gate.select(["a"], 1.9) == [True]  # 2 tokens per drafted step pay for a step 1.9x as long
    assert gate.select(["a"], 2.2) == [False]  # not for one 2.2x as long (a grammar mask per node)
    # In a batch the extra step time is shared: 1 token per drafted step pays for a share of 2.2x / 8.
    assert gate.select([f"b{i}" for i in range(7)] + ["a"], 2.2)[-1] is True
    drafted_steps(gate, "low", 0.1, rg.MIN_DRAFTED)  # 0.1 tokens: not for a share of 0.9 / 8
    assert gate.select([f"b{i}" for i in range(7)] + ["low"], 1.9)[-1] is False
    # Without a measured ratio only a request that accepts almost nothing is held off.
    gate2 = RequestGate(BudgetStats())
    drafted_steps(gate2, "b", 0, rg.MIN_DRAFTED)
    assert gate2.select(["b"], None) == [False]


def test_a_held_request_explores_and_comes_back_when_it_accepts_again():
    gate = RequestGate(BudgetStats())
    drafted_steps(gate, "a", 0, rg.MIN_DRAFTED)
    first, second = rg.EXPLORE_EVERY, 2 * rg.EXPLORE_EVERY  # an exploration that did not pay doubles the wait
    picks = []
    for _ in range(first + second):
        picks.append(gate.select(["a"], 1.3)[0])
        if picks[-1]:
            gate.observe("a", 0)
    assert [i for i, p in enumerate(picks) if p] == [first - 1, first + second - 1]
    waits = []  # the wait stops growing at EXPLORE_MAX
    for _ in range(6 * rg.EXPLORE_MAX):
        waits.append(gate.select(["a"], 1.3)[0])
        if waits[-1]:
            gate.observe("a", 0)
    gaps = [j - i for i, j in zip(*(lambda ix: (ix, ix[1:]))([i for i, p in enumerate(waits) if p]))]
    assert gaps and max(gaps) == rg.EXPLORE_MAX
    # The text starts repeating itself: explored steps accept well, and the request drafts again.
    for _ in range(rg.EXPLORE_MAX * 6):
        if gate.select(["a"], 1.3)[0]:
            gate.observe("a", 4)
    assert not gate.held("a") and gate.select(["a"], 1.3) == [True]


def test_new_requests_of_a_kind_that_does_not_pay_start_held():
    from verifier.step.sampling import SamplingParams
    stats = BudgetStats()
    gate = RequestGate(stats)
    penalised = SamplingParams(presence_penalty=0.5, frequency_penalty=0.5)
    greedy = SamplingParams()
    # Earlier penalised requests accepted nothing over enough drafted steps; greedy ones 2 per step.
    steps = int(rg.KIND_MIN_STEPS) + 8
    for i in range(steps // rg.MIN_DRAFTED + 1):
        for _ in range(rg.MIN_DRAFTED):
            picks = gate.select([f"p{i}", f"g{i}"], 1.4, [penalised, greedy])
            if picks[0]:
                gate.observe(f"p{i}", 0)
            gate.observe(f"g{i}", 2)
    held_by_kind = stats.request_switches_kind
    assert held_by_kind >= 1  # the later ones of the setup already started held
    # A new request of each kind: the penalised one is held from its first step, the greedy one drafts.
    assert gate.select(["p-new", "g-new"], 1.4, [penalised, greedy]) == [False, True]
    assert stats.request_switches_kind == held_by_kind + 1 and stats.request_switches_acceptance == 0
    assert gate.counts()["kinds"] == 2
    # Its own figure decides once measured: it explores, and accepting well brings it back.
    for _ in range(rg.EXPLORE_MAX * rg.MIN_DRAFTED * 2):
        if gate.select(["p-new"], 1.4, [penalised])[0]:
            gate.observe("p-new", 3)
    assert gate.select(["p-new"], 1.4, [penalised]) == [True]
    # Another temperature is another kind: no pooled figure, it drafts.
    assert gate.select(["s-new"], 1.4, [SamplingParams(temperature=0.8)]) == [True]


def test_kinds_are_bounded():
    from verifier.step.sampling import SamplingParams
    gate = RequestGate(BudgetStats())
    for i in range(rg.MAX_KINDS + 40):
        gate.select([f"r{i}"], None, [SamplingParams(temperature=0.1 * (i % 500) + 0.1, top_k=i)])
    assert gate.counts()["kinds"] == rg.MAX_KINDS


def test_disabled_gate_lets_every_request_draft():
    gate = RequestGate(BudgetStats(), enabled=False)
    drafted_steps(gate, "a", 0, rg.MIN_DRAFTED)
    assert gate.select(["a", "b"], 5.0) == [True, True]
    assert BudgetPolicy(7, fixed=3).request_gate.enabled is False  # a fixed budget drafts as told


def test_finished_requests_are_forgotten():
    gate = RequestGate(BudgetStats())
    for i in range(200):  # 200 requests, each seen in a few steps and gone
        for _ in range(3):
            gate.select([f"r{i}"], None)
    for _ in range(rg.MAX_IDLE + 64):
        gate.select(["live"], None)
    assert gate.counts()["tracked"] <= 2 + 64


def test_one_log_line_per_interval(caplog):
    gate = RequestGate(BudgetStats())
    with caplog.at_level(logging.INFO, logger=rg.__name__):
        for rid in ("a", "b", "c"):
            drafted_steps(gate, rid, 0, rg.MIN_DRAFTED)
            gate.select([rid], 1.5)
    lines = [r for r in caplog.records if "no drafts (acceptance)" in r.getMessage()]
    assert len(lines) == 1 and gate.stats.request_switches_acceptance == 3


def test_policy_step_cost_ratio_comes_from_measured_steps():
    grid = [1, 2, 4, 8, 16, 32, 64]
    policy = BudgetPolicy(15, None, CostModel(grid, [0.001] * len(grid)))
    assert policy.step_cost_ratio(1) is None
    for _ in range(3):
        policy.observe_delivered(1, True, 0.003, 3)  # drafting steps: 3 ms
        policy.observe_delivered(1, False, 0.001, 1)  # plain steps: 1 ms
    assert policy.step_cost_ratio(1) == pytest.approx(3.0)
    assert policy.step_cost_ratio(64) is None  # another bucket: not measured
