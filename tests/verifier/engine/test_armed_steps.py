"""Armed steps (EngineConfig.arm_steps): a speculative engine enqueues its next drafting step while
the current one runs, behind a gate its drafts open (GraphRunner.arm). Outputs must be exactly
those of the same engine launching every step itself, through batch changes (finishes, newcomers
admitted behind an armed step), plain steps between drafting ones, and stops. On the CPU
(``emulate_graphs``) an armed step runs when it is released; on a CUDA device (``-m gpu``) it
waits on the device behind the gate kernel."""

import itertools

import pytest

from verifier.budget.policy import CostModel
from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.step.sampling import SamplingParams

from tiny_lm import one_thread, tiny_lm  # noqa: F401 (a fixture)


def _prompts():
    return [[1, 2, 3, 1, 2, 3], [4, 5, 4, 5], [6, 1, 2, 3, 4], [2, 2], [3, 3, 3, 1], [5, 6, 7, 1, 5, 6], [1, 1]]


def _params():
    return [SamplingParams(max_tokens=n, ignore_eos=True, stop=["t9 t9"] if i == 2 else ())
            for i, n in enumerate([6, 30, 9, 17, 4, 25, 13])]


# Forward time against tokens in the batch: flat (wide trees cost nothing extra: every drafting step
# arms the next) or steep (they cost twice as much: no step is armed).
FLAT = CostModel([1, 64], [1e-3, 1e-3])
STEEP = CostModel([1, 64], [1e-3, 64e-3])


def _run(lm, arm: bool, pattern=None, cost=FLAT, **config):
    eng = Engine(lm.model, lm.codec, Drafter(vocab_size=lm.model.config.vocab_size),
                 EngineConfig(max_batch=3, max_len=128, max_budget=4, arm_steps=arm, **config), cost=cost)
    if pattern is not None:  # the policy's decisions, scripted: drafting and plain steps in turn
        decisions = itertools.cycle(pattern)
        eng.policy.draft_budget = lambda bs: next(decisions)
    armed = []
    arm_fn = eng.graphs.arm
    eng.graphs.arm = lambda *a: armed.append(a) or arm_fn(*a)
    reqs = eng.generate(_prompts(), _params())
    return [r.output_ids for r in reqs], [r.finish_reason for r in reqs], armed, eng


@pytest.mark.usefixtures("one_thread")
def test_armed_steps_change_no_output_cpu():
    lm = tiny_lm(vocab_size=16, seed=3)
    for pattern, extra in ((None, {"budget": 4}), ([4, 4, 0, 4, 0, 0, 4], {}), ([4], {"overlap_spec_plain": False})):
        want, reasons, armed, _ = _run(lm, False, pattern, emulate_graphs=True, **extra)
        got, got_reasons, armed_on, eng = _run(lm, True, pattern, emulate_graphs=True, **extra)
        assert got == want and got_reasons == reasons
        assert not armed and len(armed_on) > 10  # armed steps really ran
        assert eng.graphs.armed is None  # nothing left armed once the work is done
    steep, _, armed, _ = _run(lm, True, [4, 4, 0, 4], cost=STEEP, emulate_graphs=True)
    assert steep == _run(lm, False, [4, 4, 0, 4], cost=STEEP, emulate_graphs=True)[0] and not armed


def test_arm_steps_is_a_flag_off_by_default():
    from verifier.config import VerifierConfig

    assert EngineConfig().arm_steps is False and VerifierConfig().engine_config().arm_steps is False
    assert VerifierConfig(arm_steps=True).engine_config().arm_steps is True


@pytest.mark.gpu
def test_armed_steps_change_no_output_cuda():
    """The same with captured graphs: the gate kernel, pinned inputs written after the step was
    enqueued, padding steps of disarmed ones; and no gate ever timed out."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from tiny_lm import tiny_lm_cuda

    lm = tiny_lm_cuda(vocab_size=64, seed=5)
    plain = Engine(lm.model, lm.codec, None, EngineConfig(max_batch=3, max_len=128, budget=0))
    want = [r.output_ids for r in plain.generate(_prompts(), _params())]
    for pattern in (None, [4, 4, 0, 4, 0, 0, 4]):
        off, _, _, _ = _run(lm, False, pattern, budget=4 if pattern is None else None)
        on, _, armed, eng = _run(lm, True, pattern, budget=4 if pattern is None else None)
        assert on == off == want
        assert len(armed) > 10 and eng.graphs.gate_timeouts == 0 and eng.graphs.armed is None
