"""Adaptive draft budget and draft pruning (no model)."""

import itertools

import numpy as np
import pytest

from verifier.budget.policy import BudgetPolicy, CostModel, explore_factor
from verifier.step.tree_batch import prune_tree


def flat_then_linear(n):  # launch-bound up to 64 tokens, then compute-bound
    return 0.01 * max(1.0, n / 64)


def test_cost_model_interpolates_and_is_monotone():
    # A dip is pooled with its neighbour (weighted least squares), not lifted to it: a running
    # maximum let one noisy figure raise every larger size's.
    cm = CostModel([1, 4, 16], [0.010, 0.009, 0.020])
    assert cm(1) == pytest.approx(0.0095) and cm(4) == pytest.approx(0.0095)
    assert cm(10) == pytest.approx(0.01475) and cm(28) == pytest.approx(0.0305)
    assert CostModel([1, 2, 4], [1.0, 3.0, 2.0]).seconds == pytest.approx([1.0, 2.5, 2.5])
    with pytest.raises(ValueError):
        CostModel([4, 1], [0.1, 0.2])


def test_large_batches_draft_less_or_not_at_all():
    grid = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    policy = BudgetPolicy(15, None, CostModel(grid, [flat_then_linear(n) for n in grid]))
    budgets = {bs: policy.draft_budget(bs) for bs in (1, 8, 64, 256)}
    assert budgets[1] == 15 and budgets[8] >= 7 and budgets[64] == 0 and budgets[256] == 0


def test_choose_nodes_never_expects_slower_than_plain():
    grid = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    policy = BudgetPolicy(15, None, CostModel(grid, [flat_then_linear(n) for n in grid]))
    sure = [np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.1, 0.05])] * 4
    assert policy.choose_nodes(sure) == 7  # free at this size: take everything
    hopeless = [np.full(15, 0.01)] * 64  # at 64 requests every extra node per request costs a decode step
    assert policy.choose_nodes(hopeless) == 0
    policy.observe(predicted=100.0, accepted=0)  # drafts were far worse than predicted
    assert policy.calibration < 0.1


def test_prune_tree_keeps_ancestors():
    tokens = np.array([10, 11, 12, 13, 14])
    parents = np.array([-1, 0, -1, 1, 2])
    probs = np.array([0.9, 0.5, 0.3, 0.45, 0.1])
    t, p, q = prune_tree(tokens, parents, probs, 3)
    assert t.tolist() == [10, 11, 13] and p.tolist() == [-1, 0, 1]


def test_observed_step_overhead_turns_marginal_speculation_off():
    """Speculation whose steps cost much more than the cost model says (host work) stops paying."""
    from verifier.budget.policy import BudgetPolicy, CostModel

    pol = BudgetPolicy(7, None, CostModel([1, 8, 64], [1e-3, 1.05e-3, 1.5e-3]))
    probs = [np.array([0.3, 0.2, 0.1])]
    assert pol.choose_nodes(probs) > 0  # a nearly free forward: draft
    for _ in range(50):
        pol.observe_step(True, 3e-3, 4)  # but speculative steps take 3x the modeled time
        pol.observe_step(False, 1e-3, 1)
    assert pol.choose_nodes(probs) == 0
    assert pol.choose_nodes([np.array([0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.93])]) > 0  # still pays here


def test_drafting_that_delivers_less_than_plain_turns_itself_off_and_back_on():
    """Realized committed tokens per second decide, per batch-size bucket: host work the GPU cost
    model cannot see (large batches) turns drafting off; one step in explore_every still runs the
    losing mode, so drafting comes back when it pays again."""
    grid = [1, 8, 64, 512, 1024]
    pol = BudgetPolicy(15, None, CostModel(grid, [1e-3, 1e-3, 1.2e-3, 2e-3, 3e-3]))
    pol.explore_run = 3  # an engine whose plain steps overlap the host (Engine sets it)
    assert pol.draft_budget(64) > 0  # no figures yet: draft
    modes = []
    for _ in range(64):  # drafting steps: 64 * 1.6 tokens in 14 ms; plain steps: 64 in 4.7 ms
        drafted = pol.draft_budget(64) > 0
        modes.append(drafted)
        pol.observe_delivered(64, drafted, 14e-3 if drafted else 4.7e-3, 102 if drafted else 64)
    assert pol.delivered(64, False) > pol.delivered(64, True)
    assert set(pol.delivered_rates()) == {"64_drafted", "64_plain"}
    assert not any(modes[32:-16]) or sum(modes[32:]) <= 2  # off, but for exploration steps
    assert any(modes[32:]) and pol.draft_budget(1) > 0  # other buckets keep their own figures
    modes = []
    for _ in range(700):  # drafts got cheaper (or better): drafting delivers more again
        drafted = pol.draft_budget(64) > 0
        modes.append(drafted)
        pol.observe_delivered(64, drafted, 5e-3 if drafted else 4.7e-3, 110 if drafted else 64)
    assert pol.delivered(64, True) > pol.delivered(64, False)
    assert sum(modes[-32:]) >= 32 - pol.explore_run  # drafting again, but for exploration steps
    # Plain steps are explored in runs (their overlapped steady state needs more than one step).
    # Drafting leads by 1.6x here: one run per 4 * explore_scale (4) * explore_every steps.
    assert explore_factor(pol.relative_rate(64)) == 4 and pol.explore_scale == 4
    window = modes[-16 * pol.explore_every:]
    runs = [len(list(g)) for k, g in itertools.groupby(window) if not k]
    assert sum(runs) == pol.explore_run and (len(runs) == 1 or window[-1] is window[0] is False)
    counts = pol.decision_counts()  # every decision of bucket 64 is counted once, by how it was made
    assert sum(n for k, n in counts.items() if k.startswith("64_")) == 1 + 64 + 700
    assert counts["64_start_draft"] >= 1 and counts["64_plain"] > 0 and counts["64_draft"] > 0
    assert counts["64_explore_draft"] > 0 and counts["64_explore_plain"] > 0


@pytest.mark.parametrize("draft_ms, per_run", [(1.0, 8), (1.3, 4), (2.0, 2), (3.0, 1), (5.0, 2), (20.0, 2)])
def test_the_losing_mode_is_explored_less_often_the_clearer_the_lead(draft_ms, per_run):
    """Batch 1, around the figures of the H100's greedy rounds (a plain step 0.72 ms, a drafting
    one 1.3 ms for 3.6 tokens: drafting leads ~2x): each exploration costs the losing mode's steps,
    so a clear lead is re-checked ``explore_factor`` times ``explore_every`` apart, a lead of
    plain's at most 2x apart (drafting's figure follows the text, plain's does not)."""
    pol = BudgetPolicy(15, None, CostModel([1, 8, 64], [0.7e-3, 0.7e-3, 0.8e-3]))
    pol.explore_run, pol.explore_scale, pol.explore_max = 3, 1, 8  # explore_factor alone
    modes = []
    for _ in range(1200):
        drafted = pol.draft_budget(1) > 0
        modes.append(drafted)
        pol.observe_delivered(1, drafted, draft_ms * 1e-3 if drafted else 0.72e-3, 3.6 if drafted else 1)
    rel = pol.relative_rate(1)
    assert explore_factor(rel) == per_run
    leader = rel > 1
    window = modes[-2 * per_run * pol.explore_every:]  # two exploration periods in the steady state
    explored = sum(m is not leader for m in window)
    assert explored == 2 * (pol.explore_run if leader else 1)
    assert explore_factor(1.0) == explore_factor(1.2) == explore_factor(0.9) == 1 and explore_factor(0.1) == 2


@pytest.mark.parametrize("draft_ms, per_run", [(1.0, 32), (1.3, 16), (2.0, 8), (3.0, 1), (5.0, 2)])
def test_explore_scale_re_checks_a_clear_lead_rarer(draft_ms, per_run):
    """``explore_scale`` 4 and ``explore_max`` 32 (the defaults): where drafting leads by 1.25x or
    more, plain decoding is explored 4x rarer than ``explore_factor`` says; a small lead, or
    plain's, as ``explore_factor`` says."""
    pol = BudgetPolicy(15, None, CostModel([1, 8, 64], [0.7e-3, 0.7e-3, 0.8e-3]))
    assert (pol.explore_scale, pol.explore_max) == (4, 32)
    pol.explore_run = 3
    modes = []
    for _ in range(2400):
        drafted = pol.draft_budget(1) > 0
        modes.append(drafted)
        pol.observe_delivered(1, drafted, draft_ms * 1e-3 if drafted else 0.72e-3, 3.6 if drafted else 1)
    leader = pol.relative_rate(1) > 1
    window = modes[-per_run * pol.explore_every:]  # one exploration period in the steady state
    assert sum(m is not leader for m in window) == (pol.explore_run if leader else 1)


def test_fixed_budget_ignores_delivered_rates():
    pol = BudgetPolicy(7, 5)
    pol.observe_delivered(8, True, 1.0, 1)
    pol.observe_delivered(8, False, 1e-3, 8)
    assert pol.draft_budget(8) == 5


def test_gpu_share_counts_a_trees_extra_forward_time_for_every_process():
    """Replicas sharing one GPU: a tree's forward time beyond a plain step's delays all of them, so
    the node choice and the budget's cap count it gpu_share times (smaller trees, never larger)."""
    cm = CostModel([1, 64, 128, 256, 512, 1024], [1e-3, 1e-3, 1.1e-3, 1.3e-3, 1.8e-3, 6e-3])
    probs = [np.array([0.6, 0.4, 0.3, 0.2, 0.1, 0.05, 0.02])] * 64
    alone, shared = BudgetPolicy(15, None, cm), BudgetPolicy(15, None, cm)
    shared.gpu_share = 4
    assert 0 < shared.draft_budget(64) < alone.draft_budget(64)
    assert 0 < shared.choose_nodes(probs) < alone.choose_nodes(probs)


def test_a_node_choice_of_nothing_backs_the_bucket_off_for_1_2_4_steps():
    """A drafting step whose node choice verifies no node paid drafting's host work for a plain
    step's tokens (H100, batch 64, n = 4 sampled: 0.3-0.45 ms of a 2 ms step, often several in a
    row). The bucket decodes plain for the next 1, then 2, then at most 4 steps (counted), and a
    step that verifies drafts ends the back-off."""
    grid = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    pol = BudgetPolicy(15, None, CostModel(grid, [0.01 + 5e-5 * n for n in grid]))  # trees may pay at 64
    pol.explore_every = 1 << 20  # no exploration or optimistic steps in this test
    hopeless, sure = [np.full(3, 0.01)] * 64, [np.array([0.99, 0.98, 0.97])] * 64
    asks = []
    for step in range(30):
        budget = pol.draft_budget(64)
        asks.append(budget > 0)
        if budget:
            pol.choose_nodes(sure if step == 20 else hopeless)
    assert asks[:12] == [True, False, True, False, False, True, False, False, False, False, True, False]
    assert pol.stats.plain_steps_backoff == asks.count(False)
    assert pol.decision_counts()["64_backoff"] == asks.count(False)
    assert asks[20] and asks[21]  # the step at 20 verified drafts: the next one asks again
