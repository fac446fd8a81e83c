"""The calibration per band of node ranks: what the policy learns from a step's accepted ranks, and
the node choice it makes from them (no model)."""

from types import SimpleNamespace

import numpy as np
import pytest

from verifier.budget.policy import BudgetPolicy, CostModel, rank_band
from verifier.engine.verify import Verify

# Forward ms by tokens in the step, shaped as the H100's batch-64 probe (bench/closed_batch.py).
GRID = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
FORWARD_S = [1e-3 * t for t in (1.035, 1.039, 1.043, 1.051, 1.099, 1.242, 1.518, 1.646, 1.663, 1.93, 2.53)]


def pow2(k: int) -> int:
    return 1 << (k - 1).bit_length()


def policy(bands: bool = True) -> BudgetPolicy:
    p = BudgetPolicy(15, None, CostModel(GRID, FORWARD_S))
    p.node_bucket = pow2  # trees padded to powers of two, as the engine's graphs are
    p.rank_bands = bands  # (off by default: docs/verifier.md, "Draft budget")
    return p


def test_rank_bands_are_powers_of_two():
    assert [rank_band(r) for r in (1, 2, 3, 4, 7, 8, 15, 16, 31)] == [0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert len(policy().band_predicted) == 4  # ranks up to 15: 1, 2-3, 4-7, 8-15


def test_each_band_learns_its_own_calibration_and_an_untouched_band_keeps_its_figure():
    p = policy()
    for _ in range(300):
        p.observe(10.0, 12, ([2.0, 3.0, 3.0, 2.0], [4, 4, 3, 1]))
    cal = p.band_calibrations()
    assert cal == pytest.approx([2.0, 4 / 3, 1.0, 0.5], rel=0.01)  # (the first capped at 2)
    assert p.calibration == pytest.approx(1.2, rel=0.01)  # the total, for /metrics
    for _ in range(50):  # steps whose trees did not reach ranks 8-15
        p.observe(8.0, 8, ([2.0, 3.0, 3.0, 0.0], [2, 3, 3, 0]))
    assert p.band_calibrations()[3] == pytest.approx(0.5, rel=0.01)
    learned = p.band_calibrations()
    p.rank_bands = False  # the one calibration for every rank (the default)
    assert p.band_calibrations() == [p.calibration] * 4
    assert p.band_calibrations(learned=True) == learned  # still learned (/metrics)
    assert not BudgetPolicy(15, None, CostModel(GRID, FORWARD_S)).rank_bands


def test_deep_ranks_that_accept_less_than_estimated_choose_a_smaller_tree():
    # 64 requests; the corpus estimates each rank's acceptance as 0.9, 0.6, ... 0.25 for every
    # request (column sums over the batch). Verification accepted 1.6x the estimates of ranks 1-7
    # and half those of ranks 8-15: the total (1.37x) spread over every rank made 15 nodes look best.
    sums = [64 * p for p in (0.9, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35, 0.3, 0.3, 0.3, 0.3, 0.28, 0.27, 0.26, 0.25)]
    pred = [sums[0], sum(sums[1:3]), sum(sums[3:7]), sum(sums[7:15])]
    acc = [1.6 * pred[0], 1.6 * pred[1], 1.6 * pred[2], 0.5 * pred[3]]
    bands, one = policy(), policy(bands=False)
    for p in (bands, one):
        for _ in range(300):
            p.observe(sum(pred), sum(acc), (pred, acc))
    assert one.choose_nodes_summary(64, 15, sums) == 15
    assert bands.choose_nodes_summary(64, 15, sums) == 7


def test_a_step_attributes_its_accepted_nodes_to_their_ranks():
    # Best-first rows keep their first k nodes in order: an accepted node's position is its rank.
    p = policy()
    K = 8
    accept_index = np.array([[0, 1, 3, -1, -1, -1, -1, -1],   # ranks 1, 3
                             [8, 10, 13, 15, 0, 0, 0, 0]])  # ranks 2, 5, 7 (past the path: any value)
    accept_num = np.array([2, 3])
    sums = [1.5, 1.0, 0.8, 0.6, 0.5, 0.4, 0.3]  # ranks 1..7 over both rows
    Verify._observe_acceptance(SimpleNamespace(policy=p), 5.1, 5, accept_index, accept_num, K, (sums, 7, True))
    d = 0.98
    assert p.band_predicted == pytest.approx([d + 1.5, d + 1.8, d + 1.8, 1.0])  # band 3 untouched
    assert p.band_accepted == pytest.approx([d + 1, d + 2, d + 2, 1.0])
    # Rows that were not best-first: the step's accepted tokens spread over the bands as predicted.
    q = policy()
    Verify._observe_acceptance(SimpleNamespace(policy=q), 5.1, 5, accept_index, accept_num, K, (sums, 7, False))
    assert q.band_accepted == pytest.approx([d + 5 * 1.5 / 5.1, d + 5 * 1.8 / 5.1, d + 5 * 1.8 / 5.1, 1.0])
