"""EngineStats' host-time fields (bench/e2e.py reports them to show where a step's time goes):
filled by real steps, each within the step time that contains it."""

import pytest

from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.step.sampling import SamplingParams

from tiny_lm import one_thread, tiny_lm  # noqa: F401 (a fixture)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("graphs", [False, True])
def test_a_speculative_run_fills_the_phase_times(graphs):
    lm = tiny_lm(vocab_size=16, seed=3)
    eng = Engine(lm.model, lm.codec, Drafter(vocab_size=16),
                 EngineConfig(max_batch=2, max_len=128, budget=3, max_budget=4, emulate_graphs=graphs))
    eng.generate([[1, 2, 3, 1, 2, 3], [4, 5, 4, 5, 4]], SamplingParams(max_tokens=12, ignore_eos=True))
    st = eng.stats
    for name in ("corpus_seconds", "pack_seconds", "forward_seconds", "commit_seconds"):
        assert getattr(st, name) > 0, name
    # Phases of verify steps do not overlap each other and lie within the steps' wall time.
    assert st.pack_seconds + st.forward_seconds + st.commit_seconds <= st.step_seconds
    if graphs:
        assert eng.graphs.wait_seconds >= 0  # eager emulation: no events to wait on


@pytest.mark.usefixtures("one_thread")
def test_a_plain_engine_spends_no_corpus_time():
    lm = tiny_lm(vocab_size=16, seed=3)
    eng = Engine(lm.model, lm.codec, None, EngineConfig(max_batch=2, max_len=128, budget=0))
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert eng.stats.corpus_seconds == 0 and eng.stats.forward_seconds > 0
