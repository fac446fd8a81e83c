"""The request gate in the engine's step (verifier/budget/request_gate.py): within a drafting step, a
request whose measured acceptance does not pay gets no drafts while the others in its batch do, the
output stays lossless, and EngineConfig.request_gate=False (the default) turns it off. Real SmolLM2, fp32, CPU."""

import pytest
from engine_fixtures import engine

from verifier.budget import request_gate as rg
from verifier.draft.drafter import Drafter
from verifier.step.sampling import SamplingParams

# Short enough that a held request ends before its first exploring step (one in EXPLORE_EVERY).
GREEDY = SamplingParams(max_tokens=rg.EXPLORE_EVERY)


@pytest.fixture(scope="module")
def prompts(trace_rows):
    return [r["prompt_ids"] for r in trace_rows[:2]]


@pytest.fixture(scope="module")
def plain_outputs(smollm2, prompts):
    return [r.output_ids for r in engine(smollm2, None).generate(prompts, GREEDY)]


def run_with_held_request(lm, prompts, **config):
    """Two requests in one batch; the gate has already measured "held" accepting nothing."""
    eng = engine(lm, Drafter(vocab_size=lm.model.config.vocab_size), budget=7, **config)
    gate = eng.policy.request_gate
    gate.enabled = True  # (a fixed budget turns it off; here the budget is fixed only to make every step draft)
    for _ in range(rg.MIN_DRAFTED):
        gate.select(["held"], None)
        gate.observe("held", 0)
    reqs = [eng.add_request(p, GREEDY, req_id=rid) for p, rid in zip(prompts, ("held", "fresh"))]
    while not all(r.finished for r in reqs):
        eng.step()
    return eng, reqs


def test_held_request_gets_no_drafts_while_its_batch_drafts(smollm2, prompts, plain_outputs):
    eng, (held, fresh) = run_with_held_request(smollm2, prompts, request_gate=True)
    assert [held.output_ids, fresh.output_ids] == plain_outputs  # lossless
    assert held.verify_steps < rg.EXPLORE_EVERY and held.spec_steps == 0 and held.draft_tokens == 0
    assert fresh.draft_tokens > 0 and fresh.spec_steps >= 1
    assert eng.stats.budget.request_switches_acceptance == 1
    assert eng.stats.budget.request_steps_held == held.verify_steps


def test_request_gate_off_drafts_for_every_request(smollm2, prompts, plain_outputs):
    eng, (held, fresh) = run_with_held_request(smollm2, prompts)  # the default: off
    assert [held.output_ids, fresh.output_ids] == plain_outputs
    assert eng.stats.budget.request_steps_held == 0
    assert held.draft_tokens > 0  # drafted like any other request
