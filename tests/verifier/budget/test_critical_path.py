"""The makespan rule (``critical_path``): drafting is judged by what it gains the request expected to
end last, not the batch's mean (verifier/budget/makespan.py)."""

from types import SimpleNamespace

import pytest

from verifier.budget.cost_model import CostModel
from verifier.budget.makespan import PRIOR_STEPS, MakespanConfig, critical_acceptance
from verifier.budget.policy import BudgetPolicy
from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.step.sampling import SamplingParams

from tiny_lm import one_thread, tiny_lm  # noqa: F401 (a fixture)


def _req(spec_steps, spec_committed, out, max_tokens=384):
    return SimpleNamespace(spec_steps=spec_steps, accepted_tokens=spec_committed - spec_steps, output_ids=[0] * out,
                           params=SimpleNamespace(max_tokens=max_tokens))


def test_critical_acceptance_is_the_figure_of_the_request_with_the_most_steps_left():
    fast = _req(100, 300, 300)  # 3 tokens per drafting step, 84 tokens left
    slow = _req(100, 110, 110)  # 1.1 tokens per step, 274 left: ends last
    short = _req(100, 105, 380)  # slower still, but 4 tokens left
    a = critical_acceptance([fast, slow, short], mean=2.0)
    assert a == pytest.approx((110 + PRIOR_STEPS * 2.0) / (100 + PRIOR_STEPS))
    # A request with no drafting steps of its own counts at the batch's mean.
    assert critical_acceptance([_req(0, 0, 0)], mean=1.7) == pytest.approx(1.7)
    assert critical_acceptance([], mean=2.0) is None
    assert critical_acceptance([slow], mean=0.0) is None
    assert critical_acceptance([slow], mean=None) is None  # the batch has no drafting steps yet


def _policy():
    pol = BudgetPolicy(15, None, CostModel([1, 8, 64, 512, 1024], [1e-3, 1e-3, 1.2e-3, 2e-3, 3e-3]))
    pol.explore_run = 1
    return pol


def _run(pol, steps, critical, draft_s=5.5e-3, plain_s=4.7e-3):
    """Steps of batch 64: drafting commits 1.6 tokens per request in draft_s, plain 1 in plain_s."""
    modes = []
    for _ in range(steps):
        drafted = pol.draft_budget(64, critical=critical) > 0
        modes.append(drafted)
        pol.observe_delivered(64, drafted, draft_s if drafted else plain_s, 102 if drafted else 64)
    return modes


def test_drafting_that_pays_the_batch_but_not_its_last_request_turns_off():
    # The batch's mean gains 1.6x for steps 1.17x as long: the throughput rule drafts.
    pol = _policy()
    modes = _run(pol, 96, critical=None)
    assert sum(modes[-32:]) >= 30
    # The request expected to end last gains 1.1x: not worth steps 1.17x as long.
    pol = _policy()
    modes = _run(pol, 96, critical=1.1)
    assert sum(modes[-32:]) <= 2  # exploration steps only
    assert pol.stats.plain_switches_critical >= 1 and pol.stats.plain_switches_delivered == 0
    assert pol.states() == {"64": "critical"}
    # ... and back on when that request gains more than the steps cost.
    modes = _run(pol, 96, critical=1.3)
    assert sum(modes[-32:]) >= 30
    assert pol.states() == {"64": "draft"}


def test_a_fixed_budget_ignores_the_critical_figure():
    pol = BudgetPolicy(7, 5)
    assert pol.draft_budget(8, critical=0.5) == 5


@pytest.mark.usefixtures("one_thread")
def test_an_engine_with_critical_path_counts_each_requests_drafting_steps_and_stays_lossless():
    lm = tiny_lm(vocab_size=16, seed=3)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4, 5], [6, 7, 8, 6, 7, 8]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = Engine(lm.model, lm.codec, None, EngineConfig(max_batch=4, max_len=128, budget=0))
    want = [r.output_ids for r in plain.generate(prompts, params)]
    eng = Engine(lm.model, lm.codec, Drafter(vocab_size=16),
                 EngineConfig(max_batch=4, max_len=128, budget=None, max_budget=4, cost_probe_s=0.5,
                              makespan=MakespanConfig(critical_path=True)))
    reqs = eng.generate(prompts, params)
    assert [r.output_ids for r in reqs] == want
    assert sum(r.spec_steps for r in reqs) > 0
    for r in reqs:
        assert r.spec_steps <= r.verify_steps and r.spec_steps + r.accepted_tokens <= len(r.output_ids)


@pytest.mark.parametrize("bad", [0, 65, True, 2.0])
def test_gpu_share_is_checked_at_the_engine_config(bad):
    with pytest.raises(ValueError, match="gpu_share"):
        EngineConfig(gpu_share=bad)
