"""Sampled steps on the GPU verify straight from the logits (``kernels.tree_sampling_logits``): in a
batch that mixes sampled and greedy requests, the greedy ones decode exactly what plain greedy
decoding gives (float32: no near-ties), and seeded sampled requests repeat themselves run after run.
The distribution itself is tested against the reference kernel-side (tests/verifier/kernels)."""

import pytest
import torch

from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.model import load_model
from verifier.step.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[1, 9690, 2683, 314, 260, 3349, 30], [1, 4093, 253, 1523, 281, 7353, 7]]


@pytest.fixture(scope="module")
def lm():
    try:
        return load_model("smollm2", "cuda", "float32")
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _run(lm, params: list[SamplingParams], budget: int) -> list:
    drafter = Drafter(vocab_size=lm.model.config.vocab_size) if budget else None
    eng = Engine(lm.model, lm.codec, drafter, EngineConfig(max_batch=8, max_len=512, budget=budget, max_budget=15))
    try:
        prompts = [PROMPTS[i % 2] for i in range(len(params))]
        return eng.generate(prompts, params)
    finally:
        if drafter is not None:
            drafter.close()


def test_greedy_requests_in_a_sampled_batch_decode_as_plain_greedy(lm):
    greedy = SamplingParams(max_tokens=64, ignore_eos=True)
    want = [r.output_ids for r in _run(lm, [greedy, greedy], budget=0)]
    sampled = [SamplingParams(max_tokens=64, temperature=0.8, seed=s, ignore_eos=True) for s in range(4)]
    reqs = _run(lm, [greedy, greedy] + sampled, budget=7)
    assert [r.output_ids for r in reqs[:2]] == want
    assert sum(r.accepted_tokens for r in reqs) > 0  # the step verified drafts
    assert all(len(r.output_ids) == 64 for r in reqs)


def test_seeded_sampling_repeats(lm):
    # top-p / top-k on half of them: the floor kernel in the same step
    params = [SamplingParams(max_tokens=48, temperature=0.7, seed=100 + s, ignore_eos=True,
                             **({"top_p": 0.9, "top_k": 50} if s % 2 else {})) for s in range(4)]
    a = [r.output_ids for r in _run(lm, params, budget=7)]
    b = [r.output_ids for r in _run(lm, params, budget=7)]
    assert a == b
    assert len({tuple(x) for x in a}) > 1  # different seeds, different samples
