"""What the budget policy is told a drafting step delivered: the tokens the step really committed,
not the accepted path where max_tokens (or a stop) cuts it short. Counting accepted tokens made
drafting look better than it was near the end of short outputs, where whole accepted runs are cut
(on the H100, batch 64 of 128-token outputs, 2026-12-06)."""

import pytest

from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.step.sampling import SamplingParams

from tiny_lm import one_thread, tiny_lm  # noqa: F401 (a fixture)

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [2, 4, 6, 8, 10]]


@pytest.mark.usefixtures("one_thread")
def test_policy_sees_committed_tokens_when_max_tokens_cuts_the_path():
    lm = tiny_lm(vocab_size=16, seed=3)
    eng = Engine(lm.model, lm.codec, Drafter("local", vocab_size=16),
                 EngineConfig(max_batch=3, max_len=128, budget=7, max_budget=7))
    # The first pass teaches the corpus these prompts' whole outputs: the second one's drafts are
    # those outputs, fully accepted, and its max_tokens cuts every accepted run after the first.
    eng.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True))
    seen = []
    observe = eng.policy.observe_delivered
    eng.policy.observe_delivered = lambda bs, drafted, s, committed: seen.append(committed) or observe(bs, drafted, s, committed)
    accepted0 = eng.stats.accepted_tokens
    reqs = eng.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    eng.drafter.close()
    assert all(len(r.output_ids) == 4 for r in reqs)
    prefilled = len(reqs)  # each request's first token comes from its prefill
    assert sum(seen) == sum(len(r.output_ids) for r in reqs) - prefilled
    # The verification accepted more than max_tokens let through (without the fix the policy was
    # told bs + accepted, which this exceeds).
    assert len(reqs) * len(seen) + (eng.stats.accepted_tokens - accepted0) > sum(seen)
