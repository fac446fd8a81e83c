"""Engines that share one model keep their own ``native_linear`` choice: the flag lives on the model,
each engine sets it at its start, and a step sets it back to the stepping engine's choice, so the
forwards of one engine (its eagerly run steps and lazily captured graphs) all compute alike."""

from verifier.step.sampling import SamplingParams
from tests.verifier.engine_fixtures import engine


def test_engines_on_one_model_keep_their_own_choice(smollm2):
    model = smollm2.model
    before = model.native_linear
    seen: list[bool] = []
    hook = model.register_forward_pre_hook(lambda m, args: seen.append(m.native_linear))
    try:
        on = engine(smollm2, None, max_batch=1, native_linear="on")
        off = engine(smollm2, None, max_batch=1, native_linear="off")
        assert (on.native_linear, off.native_linear, model.native_linear) == (True, False, False)
        for eng, want in ((on, True), (off, False), (on, True)):
            seen.clear()
            eng.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3))
            assert seen and all(v is want for v in seen)
    finally:
        hook.remove()
        model.native_linear = before
