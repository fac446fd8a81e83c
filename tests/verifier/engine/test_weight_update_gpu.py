"""New weights copied into a live engine on the GPU (verifier/model/loader.py ``copy_weights_``, as
POST /v1/update-weights does): its captured CUDA graphs and compiled kernels read the new values,
so it then decodes exactly what an engine built on a fresh load of those weights decodes, plain and
speculative."""

import pytest
import torch

from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.model import load_model
from verifier.model.loader import copy_weights_, read_weights
from verifier.step.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SIGMA, SEED = 0.014075, 11
PROMPTS = [[1, 9690, 2683, 314, 260, 3349, 30], [1, 4093, 253, 1523, 281, 7353, 7]]


def _outputs(lm, budget: int) -> list[list[int]]:
    drafter = Drafter(vocab_size=lm.model.config.vocab_size) if budget else None
    eng = Engine(lm.model, lm.codec, drafter, EngineConfig(max_batch=4, max_len=512, budget=budget, max_budget=15))
    try:
        return [r.output_ids for r in eng.generate(PROMPTS, SamplingParams(max_tokens=48, ignore_eos=True))]
    finally:
        if drafter is not None:
            drafter.close()


@pytest.mark.parametrize("budget", [0, 7])
def test_engine_decodes_with_the_copied_weights(budget):
    try:
        live = load_model("smollm2", "cuda", "float32")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    fresh = load_model("smollm2", "cuda", "float32", SIGMA, SEED)
    drafter = Drafter(vocab_size=live.model.config.vocab_size) if budget else None
    eng = Engine(live.model, live.codec, drafter, EngineConfig(max_batch=4, max_len=512, budget=budget, max_budget=15))
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    try:
        before = [r.output_ids for r in eng.generate(PROMPTS, params)]  # graphs captured on the old weights
        eng.quiesce()
        copy_weights_(live.model, *read_weights("smollm2", SIGMA, SEED))
        after = [r.output_ids for r in eng.generate(PROMPTS, params)]
    finally:
        if drafter is not None:
            drafter.close()
    assert after == _outputs(fresh, budget)
    assert after != before  # (the noise changes 48 greedy tokens of these prompts somewhere)
