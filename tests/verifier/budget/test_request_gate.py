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
    picks = [gate.select(["a"], 1.3)[0] for _ in range(2 * rg.EXPLORE_EVERY)]
    assert picks.count(True) == 2  # one exploring step in EXPLORE_EVERY
    assert picks.index(True) == rg.EXPLORE_EVERY - 1
    # The text starts repeating itself: explored steps accept well, and the request drafts again.
    for _ in range(rg.EXPLORE_EVERY * 6):
        if gate.select(["a"], 1.3)[0]:
            gate.observe("a", 4)
    assert not gate.held("a") and gate.select(["a"], 1.3) == [True]


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
